"""`Conductor`: what one Conductor process holds (cluster view, policy, dispatcher, metrics).

`build_conductor(cfg)` reads the model's tokenizer and shape (`load_model_info`) and the
predictors (a file from ``yuebing profile``, or linear ones from the configured rates).
`yuebing.conductor.server.run_conductor` serves it; the app's lifespan (`Conductor.lifespan`)
starts the `LiveCluster` (``--instances`` and/or etcd discovery) and the store's KV event feed,
publishes this Conductor's URL in etcd, and stops them on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from yuebing.conductor.api import Limits
from yuebing.conductor.calibration import Calibration, DecodeDurations, StepLedger, TbtTail
from yuebing.conductor.cluster import LiveCluster, Member
from yuebing.conductor.config import ConductorConfig
from yuebing.conductor.dispatch import Dispatcher
from yuebing.conductor.kvfeed import StoreFeed, StoreHoldings
from yuebing.conductor.learned import LearnedState, configuration
from yuebing.conductor.metrics import ConductorMetrics
from yuebing.conductor.model import ModelInfo, load_model_info
from yuebing.conductor.policy import (
    BivariatePolynomial,
    DecodePredictor,
    Policy,
    Predictors,
    PrefillPredictor,
    TransferPredictor,
    load_predictors,
)
from yuebing.conductor.render import TokenText
from yuebing.conductor.view import STORE_HOLDER
from yuebing.core import env
from yuebing.instance.client import InstanceError, InstanceUnavailable
from yuebing.protocol.instance import LoadReport, Role

log = logging.getLogger(__name__)


def default_predictors(cfg: ConductorConfig) -> Predictors:
    """Linear predictors from ``--prefill-tokens-per-s`` and ``--decode-step-s``."""
    return Predictors(
        PrefillPredictor(BivariatePolynomial(((1, 0),), (1.0 / cfg.prefill_tokens_per_s,))),
        DecodePredictor(BivariatePolynomial(((0, 0),), (cfg.decode_step_s,))),
        TransferPredictor(), source="conductor defaults")


class Conductor:
    """Everything one Conductor process holds; the HTTP routes read it."""

    def __init__(self, cfg: ConductorConfig, model: ModelInfo,
                 predictors: Predictors | None = None) -> None:
        kv = cfg.kv_bytes_per_token or model.kv_bytes_per_token
        self.cfg = cfg
        self.model = model
        self.tokens = TokenText(model.tokenizer)
        """Token strings and bytes for logprobs (`yuebing.conductor.render`)."""
        self.policy = Policy(replace(cfg.policy, kv_bytes_per_token=kv),
                             predictors or default_predictors(cfg))
        self.calibration = Calibration(
            self.policy.predictors,
            cfg.predictors or ("given" if predictors is not None else ""), self._use_predictors,
            cfg.predictor_online, cfg.predictor_check)
        self.durations = DecodeDurations(self._use_durations, cfg.learn_decode_durations,
                                         configured=cfg.policy.decode_durations_s)
        self.tail = TbtTail(self._use_tail, cfg.learn_tbt_tail, cfg.policy.tbt_tail,
                            quantile=cfg.tbt_tail_quantile)
        self.steps = StepLedger(keep_s=max(900.0, 1.5 * cfg.request_timeout_s))
        """Each decode instance's predicted step over time: the tail's denominator (kept for
        longer than a request may run; an instance's, until it dies or leaves)."""
        self.learned = LearnedState(
            (Path(cfg.learned_dir) if cfg.learned_dir else env.learned_dir())
            if cfg.persist_learned else None,
            {"tbt_tail": self.tail, "decode_durations": self.durations,
             "prefill_scale": self.calibration}, cfg.learned_save_s)
        """What the three learners hold, kept per cluster configuration (`_members_changed`)."""
        self.metrics = ConductorMetrics()
        self.started = int(time.time())
        self.inflight = 0
        self.id_prefix = uuid.uuid4().hex[:12]
        """Request ids are this random prefix + a counter (unique across restarts)."""
        self.ids = itertools.count(1)
        self.url = ""
        self.cluster = LiveCluster(cfg.heartbeat_timeout_s, cfg.rpc_timeout_s,
                                   cfg.store_block_tokens, self.policy.prefill_time,
                                   cfg.link_bandwidth_Bps, cfg.link_latency_s, cfg.conductor_id,
                                   cfg.prefill_gate_tokens, self.policy.queue_order)
        self.dispatcher = Dispatcher(self.cluster, self.policy, self.metrics,
                                     cfg.request_timeout_s, cfg.reserve_wait_s)
        self.cluster.admit_checks.append(self.calibration.admit)
        self.cluster.prefill_factor = self.calibration.prefill_factor
        self.cluster.on_members.append(self._members_changed)
        self.cluster.on_reports.append(self._on_report)
        self.cluster.on_dead.append(lambda m: self.steps.forget(m.id))
        self.feed: StoreFeed | None = None
        self._closers: list[Any] = []
        self._listed: set[str] = set(cfg.instances)
        """The addresses of ``--instances`` and of discovery's latest list."""

    # ------------------------------------------------------------------ life cycle

    @contextlib.asynccontextmanager
    async def lifespan(self, app: object) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.cluster.start()
        for address in self.cfg.instances:
            self.cluster.add(address)
        if self.cfg.store_events:
            holdings = StoreHoldings(self.cluster.index, lambda: self.cluster.fingerprint,
                                     self.cluster.ranges)
            self.feed = StoreFeed(self.cfg.store_events, self.cfg.store_admin, holdings,
                                  loop).start()
        if self.cfg.etcd:
            await asyncio.to_thread(self._discover, loop)

    def _on_report(self, m: Member, r: LoadReport) -> None:
        """A decode instance's report: the step its batch now takes (`StepLedger`), on the
        clock of the token times (``time.perf_counter``)."""
        if m.role in (Role.DECODE, Role.COUPLED):
            step = self.policy.decode_time(r.running, r.context_tokens) if r.running else 0.0
            self.steps.record(m.id, step, time.perf_counter())

    def _use_predictors(self, predictors: Predictors) -> None:
        """A start-up profile gave new predictors (`Calibration`): every user of the policy
        takes the new one (decisions in flight keep the one they started with)."""
        self._use_policy(Policy(self.policy.config, predictors))

    def _use_durations(self, durations: tuple[float, ...]) -> None:
        """Finished requests gave a new decode-duration distribution (`DecodeDurations`)."""
        self._use_policy(Policy(replace(self.policy.config, decode_durations_s=durations),
                                self.policy.predictors))

    def _use_tail(self, tail: float) -> None:
        """Finished requests gave a new TBT tail (`TbtTail`)."""
        self._use_policy(Policy(replace(self.policy.config, tbt_tail=tail),
                                self.policy.predictors))

    def _members_changed(self) -> None:
        """An instance joined or left: once prefill and decode both serve, what was learned
        is kept for the configuration they make and taken from its file (`LearnedState`)."""
        c = self.cluster
        members = [*(m for r in Role for m in c.alive(r)), *c.stages()]
        roles = {m.role for m in members}
        if not (roles & {Role.PREFILL, Role.COUPLED} or c.stages()) \
                or not roles & {Role.DECODE, Role.COUPLED}:
            return
        self.learned.switch(configuration(
            c.fingerprint, [(m.role.label + (f" layers {m.hello.layers}" if m.hello.layers
                                             else ""), m.hello.engine) for m in members],
            self.calibration.key(), self.policy.config.decode_selector))

    def _use_policy(self, policy: Policy) -> None:
        self.policy = policy
        self.dispatcher.policy = policy
        self.cluster.prefill_time = policy.prefill_time

    def _discover(self, loop: asyncio.AbstractEventLoop) -> None:
        from yuebing.cluster.discovery import Discovery

        disc = Discovery(self.cfg.etcd, self.cfg.cluster)

        def seen(snapshot: dict[str, dict[str, Any]]) -> None:
            addresses = {str(v.get("control_address", "")) for v in snapshot.values()}
            loop.call_soon_threadsafe(self._sync_instances, addresses - {""})

        self.cluster.on_dead.append(self._unlisted_dead)
        self._closers.append(disc.watch("instances", seen))
        if self.url:
            self._closers.append(disc.publish("conductor", self.cfg.conductor_id,
                                              {"url": self.url}, ttl_s=5, retry=True))

    def _sync_instances(self, addresses: set[str]) -> None:
        """Discovery's latest list: connect to new instances; let go of those that left it
        once they no longer answer. etcd deletes every key whose lease it did not see
        refreshed in time — all of them after etcd itself was stopped or stalled for longer
        than the lease — while their instances serve on and publish again within a third of
        the lease: dropping them at once would fail every request in flight."""
        self._listed = addresses | set(self.cfg.instances)
        for a in addresses:
            self.cluster.add(a)
        for a in list(self.cluster.by_address):
            if a not in self._listed:
                self.cluster.spawn(self._let_go(a))

    async def _let_go(self, address: str) -> None:
        """Discard the unlisted instance at ``address`` unless it still answers a ping (one
        that does stays until it is listed again or stops reporting: `_unlisted_dead`)."""
        m = self.cluster.by_address.get(address)
        if m is not None and m.alive:
            with contextlib.suppress(InstanceUnavailable, InstanceError):
                await m.client.ping(timeout_s=min(1.0, self.cfg.rpc_timeout_s))
                return
        if address not in self._listed:
            self.cluster.discard(address)

    def _unlisted_dead(self, m: Member) -> None:
        if m.address not in self._listed:  # left discovery, then stopped reporting
            self.cluster.spawn(self._let_go(m.address))

    async def stop(self) -> None:
        try:
            for closer in self._closers:
                await asyncio.to_thread(closer.close)
            if self.feed is not None:
                await asyncio.to_thread(self.feed.close)
            await self.cluster.close()
        finally:  # after the last request and membership change: its last write, even so
            await asyncio.to_thread(self.learned.close)

    # ------------------------------------------------------------------ read by the routes

    def max_model_len(self) -> int:
        return self.cluster.max_model_len or self.model.config.max_position

    def limits(self) -> Limits:
        ctx = self.max_model_len()
        cap = self.cfg.max_prompt_tokens or ctx
        cfg = self.cfg
        return Limits(cfg.model_name, ctx, min(cap, ctx), cfg.max_tokens_cap, cfg.max_n,
                      cfg.max_logprobs, cfg.max_prompts)

    def health(self) -> dict[str, Any]:
        c = self.cluster
        roles = {r.label: [str(m.id) for m in c.alive(r)] for r in Role}
        roles["stage"] = [str(m.id) for m in c.stages()]
        groups = {str(gid): [str(m.id) for m in stages] for gid, stages in c.groups()}
        ready = bool(((roles["prefill"] or groups) and roles["decode"]) or roles["coupled"])
        load = {str(m.id): {"incarnation": m.report.incarnation,
                            "free_blocks": m.report.free_blocks,
                            "total_blocks": m.report.total_blocks,
                            "reserved_blocks": m.report.reserved_blocks,
                            "running": m.report.running,
                            "queued_requests": m.report.queued_requests,
                            "queued_prefill_tokens": m.report.queued_prefill_tokens,
                            "prefill_tokens_per_s": m.report.prefill_tokens_per_s,
                            "decode_step_s": m.report.decode_step_s,
                            "step_threads": m.report.step_threads,
                            "cached_blocks": len(c.index.keys_of(m.id))}
                for m in [*(m for r in Role for m in c.alive(r)), *c.stages()]
                if m.report is not None}
        return {"status": "ok", "ready": ready, "model": self.cfg.model_name,
                "instances": roles, "groups": groups, "load": load, "pools": self.pool_loads(),
                "inflight": self.inflight,
                "kv_index_blocks": len(c.index),
                "kv_index_store_blocks": len(c.index.keys_of(STORE_HOLDER)),
                "kv_index_range_blocks": {r: len(c.ranges.keys_of(r))
                                          for r in c.ranges.holder_names()},
                "predictors": self.calibration.state(),
                "decode_durations": self.durations.state(), "tbt_tail": self.tail.state(),
                "learned": self.learned.state()}

    def pool_loads(self) -> dict[str, float]:
        """The pools' load now (`LiveCluster.pool_loads`, with this policy's predictor and
        SLOs): what early rejection compares with its threshold, per pool."""
        cfg = self.policy.config
        return self.cluster.pool_loads(self.policy.decode_time, cfg.ttft_slo_s, cfg.tbt_slo_s,
                                       time.monotonic())

    def metrics_text(self) -> bytes:
        for r in Role:
            self.metrics.instances.labels(r.label).set(len(self.cluster.alive(r)))
        for pool, value in self.pool_loads().items():
            self.metrics.pool_load.labels(pool).set(value)
        return self.metrics.exposition()


def build_conductor(cfg: ConductorConfig) -> Conductor:
    """Read the model metadata and predictors named by ``cfg`` (errors name the file/flag)."""
    model = load_model_info(cfg.model)
    predictors = load_predictors(cfg.predictors) if cfg.predictors else None
    return Conductor(cfg, model, predictors)
