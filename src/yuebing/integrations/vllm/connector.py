"""`YuebingConnector`: vLLM's ``KVConnectorBase_V1`` over the yuebing store.

vLLM builds it from ``--kv-transfer-config`` (``"kv_connector": "YuebingConnector",
"kv_connector_module_path": "yuebing.integrations.vllm.connector"``; a full example in
docs/serving.md, settings in `config.VllmConnectorConfig`) in its scheduler (role SCHEDULER →
`scheduler.SchedulerSide`) and in each worker (role WORKER → `worker.WorkerSide`). This module
only adapts vLLM's calls and objects to those two halves, and is the only one that imports
vLLM. A vLLM without this API fails here with one line naming the supported versions
(`version.require_connector_api`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from yuebing.integrations.vllm.version import require_connector_api

require_connector_api()

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from yuebing.integrations.vllm.config import VllmConnectorConfig  # noqa: E402
from yuebing.integrations.vllm.layout import KvLayout, check_expected, model_id  # noqa: E402
from yuebing.integrations.vllm.lend import StepThreads  # noqa: E402
from yuebing.integrations.vllm.plan import LoadJob, SaveJob  # noqa: E402
from yuebing.integrations.vllm.scheduler import SchedulerSide, StoreLookup  # noqa: E402
from yuebing.integrations.vllm.stream import StreamJob  # noqa: E402
from yuebing.integrations.vllm.worker import WorkerSide  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """yuebing's loggers (``yuebing.*``) write through vLLM's handlers at INFO, so the
    connector's lines (hits, failed loads and saves) are in vLLM's log."""
    ours = logging.getLogger("yuebing")
    if not ours.handlers:
        for handler in logging.getLogger("vllm").handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


_log_through_vllm()


@dataclass
class YuebingMeta(KVConnectorMetadata):
    """One step's jobs, from the scheduler half to the workers."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    sends: list[StreamJob] = field(default_factory=list)
    recvs: list[StreamJob] = field(default_factory=list)
    unsent: list[str] = field(default_factory=list)


def layout_of(vllm_config: VllmConfig, cfg: VllmConnectorConfig) -> KvLayout:
    """The instance's `KvLayout` from vLLM's config (TP 1: one rank holds every head)."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise ValueError("yuebing's vLLM connector supports tensor and pipeline parallel size "
                         f"1, got TP {pc.tensor_parallel_size} PP {pc.pipeline_parallel_size}")
    dtype = str(mc.dtype).removeprefix("torch.") if cc.cache_dtype == "auto" else cc.cache_dtype
    served = mc.served_model_name
    name = cfg.model_id or (served[0] if isinstance(served, list | tuple) else served) or mc.model
    layout = KvLayout(model=model_id(name), dtype=dtype, layers=mc.get_num_layers(pc),
                      kv_heads=mc.get_num_kv_heads(pc), head_size=mc.get_head_size(),
                      block_tokens=cc.block_size, store_block_tokens=cfg.store_block_tokens)
    check_expected(layout, cfg.expect_model or None, cfg.expect_block_size or None)
    return layout


def _client(cfg: VllmConnectorConfig, timeout_s: float) -> Any:
    from yuebing.store.client.client import StoreClient
    from yuebing.store.config import ClientConfig
    return StoreClient(ClientConfig(master=cfg.master, rpc_timeout_s=timeout_s,
                                    failover_s=timeout_s))


def _transfer_engine() -> Any:
    """The worker's transfer engine for layer-wise hand-offs (peer-to-peer metadata: a
    decode's pool segment is named ``host:port/name``)."""
    from yuebing.transfer import TransferConfig, TransferEngine
    return TransferEngine(TransferConfig(metadata="p2p"))


class YuebingConnector(KVConnectorBase_V1):
    """Prefix KV from and to the yuebing store (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.cfg = VllmConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        self.layout = layout_of(vllm_config, self.cfg)
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kv_load_failure_policy is %r: a store block that fails to load fails "
                        "the request; set \"recompute\" to compute it instead",
                        ktc.kv_load_failure_policy)
        load = self.cfg.load and ktc.kv_role != "kv_producer"
        save = self.cfg.save and ktc.kv_role != "kv_consumer"
        self.sched: SchedulerSide | None = None
        self.work: WorkerSide | None = None
        self.lend: StepThreads | None = None
        if role == KVConnectorRole.SCHEDULER:
            lookup = StoreLookup(_client(self.cfg, self.cfg.load_timeout_s),
                                 self.cfg.load_timeout_s)
            self.sched = SchedulerSide(self.layout, lookup, load=load, save=save)
        else:
            self.work = WorkerSide(
                self.layout, _client(self.cfg, self.cfg.load_timeout_s) if load else None,
                _client(self.cfg, self.cfg.save_timeout_s) if save else None,
                self.cfg.load_timeout_s, self.cfg.save_timeout_s,
                self.cfg.max_pending_save_bytes, transfer=_transfer_engine)
            if self.cfg.lend_threads:
                from yuebing.instance.cores import CoreLedger
                # vLLM-CPU's worker replaces torch.set_num_threads with a no-op after its
                # thread binding; torch._C.set_num_threads (omp_set_num_threads) is the original
                # a consumer's (decode's) or coupled worker's claim is reserved (`CoreLedger`)
                self.lend = StepThreads(CoreLedger(self.cfg.lend_threads,
                                                   cores=self.cfg.lend_cores,
                                                   critical=ktc.kv_role != "kv_producer"),
                                        torch._C.set_num_threads)
        log.info("yuebing connector (%s): store %s, fingerprint %s, load %s, save %s",
                 role, self.cfg.master, self.layout.fingerprint(), load, save)

    # ------------------------------------------------------------------ worker side
    def _meta(self) -> YuebingMeta:
        meta = self._get_connector_metadata()
        assert isinstance(meta, YuebingMeta)
        return meta

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM calls this first in each step, before it builds the step's attention metadata,
        # which holds the thread count its CPU attention kernel must then run with
        if self.lend is not None:
            self.lend.begin()
        super().handle_preemptions(kv_connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.lend is not None:  # after its forward and its saves
            self.lend.end()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.work is not None
        self.work.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.work is not None
        meta = self._meta()
        self.work.forget_sends(meta.unsent)
        self.work.start_receive(meta.recvs)
        self.work.start_load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.work is not None
        self.work.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        assert self.work is not None
        meta = self._meta()
        if meta.sends:
            self.work.send_layer(layer_name, kv_layer, meta.sends)
        if meta.saves:
            self.work.save_layer(layer_name, kv_layer, meta.saves)

    def wait_for_save(self) -> None:
        assert self.work is not None
        self.work.end_load()
        self.work.end_send(self._meta().sends)
        self.work.end_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.work.load_errors() if self.work is not None else set()

    def shutdown(self) -> None:
        if self.lend is not None:
            self.lend.close()
        if self.work is not None:
            self.work.close()
        if self.sched is not None and isinstance(self.sched.lookup, StoreLookup):
            self.sched.lookup.close()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self.sched is not None
        prompt = request.prompt_token_ids or []
        return self.sched.matched(request.request_id, prompt, num_computed_tokens,
                                  getattr(request, "kv_transfer_params", None)), False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self.sched is not None
        if num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        self.sched.allocated(request.request_id, request.prompt_token_ids or [], block_ids,
                             num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> YuebingMeta:
        assert self.sched is not None
        jobs = self.sched.build(scheduler_output)
        return YuebingMeta(loads=jobs.loads, saves=jobs.saves, sends=jobs.sends,
                           recvs=jobs.recvs, unsent=jobs.unsent)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        if self.sched is not None:
            self.sched.finished(request.request_id)
        return False, None
