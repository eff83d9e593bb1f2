"""Prometheus metrics of the Conductor (``GET /metrics``), vLLM-like names under ``yuebing:``.

One `ConductorMetrics` per server, on its own registry (`ops.admin.new_registry`: several
servers in one process, as in tests, never share counters). The dispatcher calls `routed`,
`rejected` and `finished` (with the request's `RequestStats`); the HTTP layer renders
`exposition` (the text of `ops.admin`, the admin helper every service uses).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from yuebing.conductor.stats import RequestStats
from yuebing.ops import admin

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
            1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TBT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
        0.5, 0.75, 1.0, 2.5)


class ConductorMetrics:
    """Counters and histograms of one Conductor."""

    def __init__(self) -> None:
        self.registry = admin.new_registry()
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY) -> Histogram:
            return Histogram(f"yuebing:{name}", doc, registry=r, buckets=buckets)

        self.routed_requests = Counter(
            "yuebing:routed_requests", "requests routed, by instance and its part", ["instance",
                                                                                  "role"],
            registry=r)
        self.rejected_requests = Counter(
            "yuebing:rejected_requests", "requests refused with 429/503, by reason", ["reason"],
            registry=r)
        self.request_success = Counter(
            "yuebing:request_success", "finished requests, by finish reason", ["finished_reason"],
            registry=r)
        self.request_failures = Counter(
            "yuebing:request_failures", "requests ended by an error after routing", ["code"],
            registry=r)
        self.redispatched = Counter(
            "yuebing:redispatched_requests", "requests re-dispatched after a dead prefill",
            registry=r)
        self.prompt_tokens = Counter("yuebing:prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("yuebing:generation_tokens", "generated tokens",
                                         registry=r)
        self.prefix_tokens_reused = Counter(
            "yuebing:prefix_tokens_reused", "prompt tokens whose KV was reused (cached_tokens)",
            registry=r)
        self.blocks_replicated = Counter(
            "yuebing:blocks_replicated", "store blocks planned to be copied to the prefill "
            "instance from the store or a peer (replicating hot blocks)", ["source"], registry=r)
        self.running = Gauge("yuebing:num_requests_running", "requests in flight", registry=r)
        self.pool_load = Gauge(
            "yuebing:pool_load", "load of each pool (prefill: queued seconds / TTFT SLO; "
            "decode: predicted step / TBT SLO; decode_kv: share of KV in use)", ["pool"],
            registry=r)
        self.instances = Gauge("yuebing:instances_alive", "instances in the view", ["role"],
                               registry=r)
        self.ttft = hist("time_to_first_token_seconds",
                         "HTTP arrival to the first token reaching the Conductor")
        self.tbt = hist("time_between_tokens_seconds",
                        "per request: mean of its longest 10 % token intervals (paper TBT)", _TBT)
        self.queue = hist("request_queue_time_seconds", "time queued before the prefill started "
                          "(the Conductor's queue for the instance + the instance's own)")
        self.prefix_load = hist("request_prefix_load_time_seconds",
                                "time loading the reused prefix KV")
        self.prefill = hist("request_prefill_time_seconds", "prefill compute time")
        self.transfer = hist("request_transfer_time_seconds",
                             "prefill's last layer to the KV complete at the decode instance")
        self.decode_wait = hist("request_decode_wait_time_seconds",
                                "KV complete to the first decode step")
        self.e2e = hist("e2e_request_latency_seconds", "HTTP arrival to the last token")
        overhead = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 1.0)
        self.overhead = hist("conductor_dispatch_seconds",
                             "Conductor overhead: HTTP arrival to the task sent to the instances "
                             "(the decode reservation's round trip excluded)", overhead)
        self.dispatch_phase = Histogram(
            "yuebing:conductor_dispatch_phase_seconds", "conductor_dispatch_seconds in parts: "
            "body (read), parse (validate, tokenize), start (to the dispatcher's task), route "
            "(keys, policy), send (the rest)", ["phase"], registry=r, buckets=overhead)
        self.gc = Histogram("yuebing:conductor_gc_seconds", "the Conductor's garbage "
                            "collections (the event loop stands still meanwhile), by generation",
                            ["generation"], registry=r, buckets=overhead)
        self._gc_start = 0.0
        self.relay = hist("conductor_relay_seconds", "Conductor overhead: a token event's "
                          "frame read from the instance's socket to its chunk handed to the "
                          "HTTP transport", overhead)

    def watch_gc(self) -> None:
        """Time every garbage collection of this process into ``gc`` (the Conductor's own
        process, `server.run_conductor`; `unwatch_gc` stops)."""
        gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start:
            self.gc.labels(str(info.get("generation", "?"))).observe(
                time.perf_counter() - self._gc_start)
            self._gc_start = 0.0

    def finished(self, s: RequestStats) -> None:
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generation_tokens.inc(s.completion_tokens)
        self.prefix_tokens_reused.inc(s.cached_tokens)
        if s.error_code:
            self.request_failures.labels(s.error_code).inc()
        else:
            self.request_success.labels(s.finish_reason or "unknown").inc()
        if s.first_token_s is None:
            return
        self.ttft.observe(s.ttft_s)
        self.tbt.observe(s.tbt_s)
        b = s.breakdown
        self.queue.observe(s.queue_s)
        self.prefix_load.observe(b.prefix_load_s)
        self.prefill.observe(b.prefill_s)
        self.transfer.observe(b.transfer_s)
        self.decode_wait.observe(b.decode_wait_s)
        self.e2e.observe(s.e2e_s)

    def exposition(self) -> bytes:
        return admin.exposition(self.registry)
