"""`yuebing bench instance`: what the instances add to an engine, measured on real processes.

`run_bench` starts a store master and node, two prefill instances and a decode instance (and a
second decode reachable only over TCP), one engine thread each, and measures side by side: a
4,096-token prompt's TTFT cold vs loaded from the store (``hit_ratio``, ``greedy_identical``);
a 2,048-token prefill → decode hand-off (``handoff_gap_s``, layers streamed before the prefill
ended, over shared memory and TCP); the decode step beside a busy prefill vs the bare engine;
store → pool bandwidth (`measure_kv_load`).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from yuebing.core.config import require
from yuebing.engine.config import EngineConfig
from yuebing.instance.client import InstanceClient
from yuebing.protocol.instance import (
    EventKind,
    PrefixPlan,
    Sampling,
    SubmitTask,
    TaskEvent,
    TaskMode,
)
from yuebing.store.benchprocs import Child


@dataclass(frozen=True)
class InstanceBenchConfig:
    model: str = field(default="smollm2", metadata={"help": "model of every instance"})
    dtype: str = field(default="bfloat16", metadata={"help": "engine dtype"})
    prompt_tokens: int = field(default=4096, metadata={"help": "store-hit prompt length"})
    cached_tokens: int = field(default=3840, metadata={
        "help": "leading tokens of it loaded from the store"})
    handoff_tokens: int = field(default=2048, metadata={"help": "hand-off prompt length"})
    rounds: int = field(default=3, metadata={"help": "rounds of cold / store-hit TTFT"})
    decode_batch: int = field(default=8, metadata={"help": "decode batch measured"})
    decode_tokens: int = field(default=160, metadata={"help": "tokens per decode request"})
    kv_cache_bytes: int = field(default=512 << 20, metadata={
        "help": "KV pool of each instance", "size": True})
    store_dram: str = field(default="1GiB", metadata={"help": "store node DRAM"})
    seed: int = field(default=1, metadata={"help": "prompt seed"})

    def __post_init__(self) -> None:
        require(0 < self.cached_tokens < self.prompt_tokens,
                "cached_tokens must be in 1..prompt_tokens-1")
        require(self.rounds >= 1, "rounds must be >= 1")
        require(self.decode_batch >= 1, "decode_batch must be >= 1")


async def _events(client: InstanceClient, rid: str) -> list[TaskEvent]:
    return [ev async for ev in client.events(rid)]


def _check(events: list[TaskEvent], what: str) -> None:
    bad = [e for e in events if e.kind == EventKind.ERROR]
    if bad:
        raise RuntimeError(f"{what} failed: {bad[0].error}")


async def _ttft(client: InstanceClient, rid: str, ids: list[int],
                plan: PrefixPlan | None) -> tuple[float, list[int], int]:
    """TTFT (submit → first token event) of a coupled request with 8 greedy tokens."""
    t0 = time.time()
    await client.submit(SubmitTask(seq=0, request_id=rid, token_ids=ids, mode=TaskMode.COUPLED,
                                   sampling=Sampling(max_tokens=8, temperature=0,
                                                     ignore_eos=True), prefix=plan))
    evs = await _events(client, rid)
    _check(evs, rid)
    first = next(e for e in evs if e.kind == EventKind.FIRST_TOKEN)
    toks = [t for e in evs for t in e.token_ids]
    return first.time_s - t0, toks, max(e.cached_tokens for e in evs)


async def _handoff(p: InstanceClient, d: InstanceClient, rid: str, ids: list[int],
                   max_tokens: int = 2) -> tuple[Any, Any, list[TaskEvent]]:
    sampling = Sampling(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    r = await d.reserve(rid, ids, sampling)
    await p.submit(SubmitTask(seq=0, request_id=rid, token_ids=ids, sampling=sampling,
                              mode=TaskMode.PREFILL, decode=r.target))
    pe = await _events(p, rid)
    _check(pe, f"prefill of {rid}")
    de = await _events(d, rid)
    _check(de, f"decode of {rid}")
    return pe[-1].breakdown, de[-1].breakdown, de


class _Prompts:
    def __init__(self, seed: int, vocab: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab - 100) for _ in range(n)]


def run_bench(cfg: InstanceBenchConfig, progress: Callable[[str], None] = lambda s: None
              ) -> dict[str, Any]:
    """Start the processes, measure, stop them; the report as a JSON-able dict."""
    procs: list[Child] = []
    logs: dict[str, str] = {}

    def start(args: list[str], name: str) -> Child:
        progress(f"starting {name}")
        procs.append(Child(args, timeout_s=600.0))
        logs[name] = str(procs[-1].dir)
        return procs[-1]
    try:
        master = start(["store", "master", "--rpc-address", "tcp://127.0.0.1:0"], "master")
        start(["store", "node", "--master", master.info["address"], "--dram",
               cfg.store_dram], "node")
        common = ["--model", cfg.model, "--dtype", cfg.dtype, "--threads", "1",
                  "--kv-cache-bytes", str(cfg.kv_cache_bytes), "--report-hz", "20",
                  "--staging-bytes", str(cfg.kv_cache_bytes)]
        store = ["--store-master", master.info["address"]]
        p1 = start(["serve", "prefill", *common, *store], "prefill-1")
        p2 = start(["serve", "prefill", *common, *store], "prefill-2")
        d_shm = start(["serve", "decode", *common], "decode-shm")
        d_tcp = start(["serve", "decode", *common, "--host-id", "bench-other-host"],
                      "decode-tcp")
        report = asyncio.run(_measure(cfg, master.info["address"], p1, p2, d_shm, d_tcp, progress))
        for p in procs[2:]:
            p.stop()
        progress("store -> pool load rate")
        report["kv_load_gbps"] = measure_kv_load(cfg, master.info["address"])
    finally:
        for p in reversed(procs):
            p.stop()
    progress("bare engine decode step")
    report["engine_decode_step_ms_b8"] = engine_decode_step_ms(cfg)
    report["decode_vs_engine"] = report["decode_step_ms_b8"] / report["engine_decode_step_ms_b8"]
    report["config"] = {k: v for k, v in cfg.__dict__.items()}
    report["logs"] = logs
    return report


async def _measure(cfg: InstanceBenchConfig, master: str, p1: Child, p2: Child, d_shm: Child,
                   d_tcp: Child, progress: Callable[[str], None]) -> dict[str, Any]:
    a, b = InstanceClient(p1.info["control_address"]), InstanceClient(p2.info["control_address"])
    ds, dt = (InstanceClient(x.info["control_address"]) for x in (d_shm, d_tcp))
    vocab = 49152 if cfg.model == "smollm2" else 512
    prompts = _Prompts(cfg.seed, vocab)
    cold, hit, same = [], [], []
    for i in range(cfg.rounds):
        progress(f"round {i + 1}/{cfg.rounds}: cold and store-hit TTFT")
        shared = prompts(cfg.prompt_tokens)
        _, ref, _ = await _ttft(a, f"warm{i}", shared, None)  # computes, saves to the store
        await _wait_saved(master, p1.info["fingerprint"], shared, cfg.cached_tokens)
        tc, _, _ = await _ttft(b, f"cold{i}", prompts(cfg.prompt_tokens), None)
        th, toks, cached = await _ttft(b, f"hit{i}", shared,
                                       PrefixPlan(tokens=cfg.cached_tokens, source="store"))
        if cached < cfg.cached_tokens:
            raise RuntimeError(f"round {i}: only {cached} tokens came from the store")
        cold.append(tc)
        hit.append(th)
        same.append(toks == ref)
    progress("hand-off over shared memory and TCP")
    hand = {}
    for name, d in (("shm", ds), ("tcp", dt)):
        await _handoff(a, d, f"warmup-{name}", prompts(64))
        pb, db, _ = await _handoff(a, d, f"handoff-{name}", prompts(cfg.handoff_tokens))
        hand[name] = (pb, db)
    pb, db = hand["shm"]
    progress(f"decode step at batch {cfg.decode_batch} beside a busy prefill")
    try:
        step_ms = await _decode_under_prefill(cfg, a, b, ds, prompts)
    except RuntimeError as e:  # keep what was measured; say why this one is missing
        step_ms, decode_error = float("nan"), str(e)
    else:
        decode_error = ""
    for c in (a, b, ds, dt):
        await c.close()
    gap = db.transfer_s + db.decode_wait_s
    return {
        "cold_ttft_s": statistics.median(cold), "store_hit_ttft_s": statistics.median(hit),
        "hit_ratio": statistics.median(hit) / statistics.median(cold),
        "cold_ttft_rounds_s": cold, "store_hit_ttft_rounds_s": hit,
        "greedy_identical": all(same),
        "prefill_s": pb.prefill_s, "handoff_gap_s": gap, "handoff_gap_ratio": gap / pb.prefill_s,
        "layers_before_prefill_end": pb.layers_before_prefill_end,
        "num_layers": pb.streamed_layers,
        "layers_before_prefill_end_tcp": hand["tcp"][0].layers_before_prefill_end,
        "handoff_gap_tcp_s": hand["tcp"][1].transfer_s + hand["tcp"][1].decode_wait_s,
        "decode_step_ms_b8": step_ms, "decode_step_error": decode_error,
    }


async def _wait_saved(master: str, fingerprint: str, ids: list[int], tokens: int,
                      timeout_s: float = 60.0) -> None:
    """Wait until the background save (off the TTFT path by design) put ``tokens`` of
    ``ids`` into the store."""
    from yuebing.instance.kvkeys import store_block_keys, store_key
    from yuebing.store.client.client import StoreClient
    from yuebing.store.config import ClientConfig

    keys = [store_key(fingerprint, k) for k in store_block_keys(ids[:tokens], 256, fingerprint)]
    end = time.monotonic() + timeout_s
    with StoreClient(ClientConfig(master=master), heartbeat=False) as c:
        while c.prefix_match(keys) < len(keys):
            if time.monotonic() > end:
                raise RuntimeError(f"the prefill's blocks did not reach the store in {timeout_s} s")
            await asyncio.sleep(0.05)


async def _decode_under_prefill(cfg: InstanceBenchConfig, p: InstanceClient,
                                busy_p: InstanceClient, d: InstanceClient,
                                prompts: _Prompts) -> float:
    """Median inter-token time (ms) of ``decode_batch`` requests decoding together on ``d``
    while the prefill instance ``busy_p`` keeps computing long prompts on the other core."""
    stop = asyncio.Event()

    async def keep_prefill_busy() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            await _ttft(busy_p, f"busy{n}", prompts(1024), None)
    busy = asyncio.create_task(keep_prefill_busy())
    try:
        runs = await asyncio.gather(*[
            _handoff(p, d, f"b{cfg.decode_batch}-{i}", prompts(128), cfg.decode_tokens)
            for i in range(cfg.decode_batch)])
    finally:
        stop.set()
        await busy
    times = [[t for e in evs for t in e.token_times] for _, _, evs in runs]
    spans = [(ts[0], ts[-1]) for ts in times if ts]

    def active(t: float) -> int:
        return sum(1 for lo, hi in spans if lo <= t <= hi)
    full = max(active(t) for ts in times for t in ts)
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:], strict=False)
            if active(a) == full and active(b) == full]
    if full < cfg.decode_batch:
        progress_note = f"at most {full} of {cfg.decode_batch} requests decoded together"
        raise RuntimeError(progress_note + "; raise decode_tokens")
    return 1e3 * statistics.median(gaps)


def engine_decode_step_ms(cfg: InstanceBenchConfig) -> float:
    """`yuebing bench engine`'s decode step at batch ``decode_batch`` on one thread (ms)."""
    import torch

    from yuebing.engine.engine import LLMEngine
    from yuebing.engine.profile import _Tokens, time_decode
    torch.set_num_threads(1)
    e = LLMEngine(EngineConfig(model=cfg.model, dtype=cfg.dtype, threads=1,
                               kv_cache_bytes=cfg.kv_cache_bytes))
    e.warmup()
    t = time_decode(e, cfg.decode_batch, cfg.decode_batch * 128,
                    _Tokens(e.model_config.vocab_size, seed=1), 16)
    return 1e3 * t.wall


def measure_kv_load(cfg: InstanceBenchConfig, master: str, rounds: int = 5) -> float:
    """GB/s of loading a ``cached_tokens`` prefix from the store into an engine's pool on one
    host (the connector's fetch into registered staging + install into the prefix cache),
    median over ``rounds`` fresh prefixes."""
    import torch

    from yuebing.engine.engine import LLMEngine
    from yuebing.instance.connector import KVConnector, KVConnectorConfig
    from yuebing.store.client.client import StoreClient
    from yuebing.store.config import ClientConfig
    from yuebing.transfer.config import TransferConfig
    from yuebing.transfer.engine import TransferEngine

    e = LLMEngine(EngineConfig(model=cfg.model, dtype=cfg.dtype, threads=1,
                               kv_cache_bytes=cfg.kv_cache_bytes))
    with TransferEngine(TransferConfig(metadata="p2p")) as tx:
        staging = torch.frombuffer(tx.register_segment("staging", size=256 << 20).view,
                                   dtype=torch.uint8)
        with StoreClient(ClientConfig(master=master), engine=tx) as store:
            conn = KVConnector(e, store, KVConnectorConfig(), staging)
            prompts = _Prompts(cfg.seed + 7, e.model_config.vocab_size)
            rates = []
            for _ in range(rounds):
                ids = prompts(cfg.cached_tokens)
                keys = conn.keys(ids)
                values = [torch.randint(0, 255, (conn.object_bytes,), dtype=torch.uint8).numpy()
                          for _ in keys]
                store.batch_put(keys, values)
                t0 = time.perf_counter()
                loaded = conn.fetch(ids, cfg.cached_tokens)
                n = conn.install(e, ids, loaded)
                dt = time.perf_counter() - t0
                if n != len(keys) * conn.config.store_block_tokens:
                    raise RuntimeError(f"loaded {n} tokens of {len(keys) * 256}")
                rates.append(loaded.bytes / dt / 1e9)
                store.batch_remove(keys)
    return statistics.median(rates)
