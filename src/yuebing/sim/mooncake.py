"""The simulated Mooncake cluster (system ``mooncake``): P prefill + D decode nodes over a
global KV pool, driven by `sim.runner` through the shared Conductor policy.

Life cycle of a request (paper §3–§4): at arrival the policy decides on a `ClusterView` built
from the pool index and the nodes (a `Reject` is recorded); the chosen prefill node fetches a
planned remote prefix over the NICs (replicating hot blocks) and serves its queue in the
policy's queue order (CPP groups for long inputs); at prefill end the KV moves to the decode
node, which batches it continuously within HBM (`sim.decode.DecodeInstance`). `MooncakeSystem`
spells out each stage and its options (``prefill_reject``, ``decode_reject``, ``colocated``).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from yuebing.conductor.policy import (
    ClusterView,
    DecodeState,
    PendingDecode,
    Policy,
    QueuedPrefill,
    Reject,
    RejectStage,
    RequestInfo,
    Route,
)
from yuebing.conductor.view import PrefillLoad, PrefixLookup, build_view
from yuebing.core.ids import BlockHash, InstanceId
from yuebing.sim.colocation import (
    HostMate,
    Interference,
    SharedHost,
    load_interference,
    stretch,
)
from yuebing.sim.decode import DecodeInstance, DecodeJob, SlowSteps
from yuebing.sim.kvpool import GlobalKVPool
from yuebing.sim.loop import Priority
from yuebing.sim.metrics import RequestRecord
from yuebing.sim.predict import policy_for
from yuebing.sim.system import SYSTEMS, SimSystem, SystemContext
from yuebing.sim.workload import SimRequest

HOT_KEYS = 10
"""How many of the trace's most shared prefixes the replica report follows."""
TRACKED_RANKS = (10, 100, 1000, 10000)
"""Ranks (by number of requests using it) of the blocks whose replicas are sampled (Fig. 11)."""


def ranked_keys(requests: Sequence[SimRequest], ranks: Sequence[int]) -> dict[int, int]:
    """{rank: block} for the blocks ranked ``ranks`` (1 = most used; ties by first use) among
    the requests' blocks; ranks past the number of blocks are left out."""
    counts: Counter[int] = Counter(k for r in requests for k in r.block_keys)
    order = [k for k, _ in sorted(counts.items(), key=lambda kv: -kv[1])]
    return {rank: order[rank - 1] for rank in ranks if 0 < rank <= len(order)}


def hot_prefixes(requests: Sequence[SimRequest], top: int) -> list[int]:
    """The ``top`` most used blocks, one per shared prefix: blocks first seen in the same
    request and used equally often are one chain segment, represented by its first block."""
    counts: Counter[int] = Counter()
    first_seen: dict[int, int] = {}
    for r in requests:
        for k in r.block_keys:
            counts[k] += 1
            first_seen.setdefault(k, r.index)
    chosen: list[int] = []
    segments: set[tuple[int, int]] = set()
    for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        segment = (first_seen[k], n)
        if segment not in segments:
            segments.add(segment)
            chosen.append(k)
            if len(chosen) == top:
                break
    return chosen


@dataclass(eq=False, slots=True)
class _Waiting:
    """A routed request in a prefill node's queue (orders other than FIFO)."""

    request: SimRequest
    record: RequestRecord
    decode: int
    hit: int
    ready: float
    item: QueuedPrefill


class MooncakeSystem(SimSystem):
    """Disaggregated prefill/decode with a global cache-aware Conductor (see module docstring).

    Stages: (1) arrival — the prefix blocks are looked up in the pool index, the view built (per
    prefill node: queued work and its own prefix; per decode node: batch, context, KV use; the best
    prefix anywhere) and `Policy.decide` called; a request whose KV exceeds a decode instance's
    capacity is rejected (``kv_capacity``), as the vLLM baselines do. (2) route — the node
    refreshes its reused blocks; a planned fetch copies the missing blocks from the holder over both
    NICs (serialised per NIC). Prefill starts when the node (or a chunked-pipeline group of up to
    ``cpp_max_nodes`` for more than ``cpp_threshold_tokens`` new tokens; with ``cpp_groups`` a
    declared group of dedicated stage nodes, `_start_group`, and with ``cpp_twins`` a
    whole-model twin node per stage that waits for its group and holds it up) is free and the
    fetch done;
    in FIFO a request's turn is placed at arrival, in another order the node picks the next when it
    is free (`_dispatch`). With ``prefill_reject`` a prefill that would end past its TTFT SLO is
    dropped when placed; with ``colocated`` prefill node i and decode node i share a host
    (with ``host_cores``, all nodes share one) and stretch each other (`sim.colocation`). (3)
    prefill end = first token; the KV stored layer by layer into the node's DRAM pool moves to
    the decode node after the prefill (Figure 14). (4)
    decode (a tenth of the steps ``decode_tail`` times slower, the rest of it beside a prefill:
    `_slow`, `sim.decode.SlowSteps`): with
    ``decode_reject`` a request whose KV cannot join at the next iteration, or would
    push it past the TBT SLO (by the Conductor's decode predictor), is rejected there."""

    def __init__(self, ctx: SystemContext) -> None:
        super().__init__(ctx)
        cfg = self.config
        k = cfg.cpp_group_stages
        self.twin_group: dict[int, int] = {}
        """Twin nodes (`SimConfig.cpp_twins`, after the prefill nodes) → their group: each a
        whole-model node on a stage's machine, busy while the group is and holding it up."""
        self.prefill_ids = [InstanceId(f"p{i}") for i in range(cfg.prefill_nodes)]
        for g in range(cfg.cpp_groups if cfg.cpp_twins else 0):
            for s in range(k):
                self.twin_group[len(self.prefill_ids)] = g
                self.prefill_ids.append(InstanceId(f"g{g}t{s}"))
        self.twins = [[i for i, tg in self.twin_group.items() if tg == g]
                      for g in range(cfg.cpp_groups)]
        self.P, self.D = len(self.prefill_ids), cfg.decode_nodes
        self.pool = GlobalKVPool(self.P, cfg.dram_kv_tokens // cfg.policy.block_tokens)
        self.prefill_index = {pid: i for i, pid in enumerate(self.prefill_ids)}
        self.decode_ids = [InstanceId(f"d{j}") for j in range(self.D)]
        self.decode_index = {did: j for j, did in enumerate(self.decode_ids)}
        self.free_at = [0.0] * self.P
        self.queued = [0] * self.P
        self.waiting: list[list[_Waiting]] = [[] for _ in range(self.P)]
        """Requests not yet placed on each node's timeline, in queueing order."""
        self.dispatch_at = [-1.0] * self.P
        """When each node's `_dispatch` is next scheduled."""
        self.nic_free = [0.0] * self.P
        self.group_ids = [InstanceId(f"g{g}") for g in range(cfg.cpp_groups)]
        self.group_index = {gid: g for g, gid in enumerate(self.group_ids)}
        self.stage_ids = [[InstanceId(f"g{g}s{i}") for i in range(k)]
                          for g in range(cfg.cpp_groups)]
        """Declared groups' stage nodes (`SimConfig.cpp_groups`): no prefix cache of their
        own, busy together (one request at a time per group, in arrival order)."""
        self.stage_free = [0.0] * cfg.cpp_groups
        self.stage_queued = [0] * cfg.cpp_groups
        self.host: SharedHost | None = None
        """All nodes on one host (`SimConfig.host_cores`), else None."""
        self.mates = self._host_mates()
        self.decodes = [DecodeInstance(str(d), self.loop, self.cost, stretch=(
            self.host.decode_step if self.host is not None
            else self.mates[j].decode_step if j in self.mates else None), slow=self._slow(j))
            for j, d in enumerate(self.decode_ids)]
        self.pending: dict[int, PendingDecode] = {}
        self.policy: Policy | None = None
        self.hot_keys: list[int] = []
        self.replica_series: dict[str, list[int]] = {}
        self.ranked: dict[int, int] = {}
        self.rank_series: dict[str, list[int]] = {}
        self._kvb = self.cost.kv_bytes_per_token

    # -- set-up ----------------------------------------------------------------------------
    def _host_mates(self) -> dict[int, HostMate]:
        """{i: the host-mate of decode node i = prefill node i} when ``colocated``."""
        cfg = self.config
        if not cfg.colocated:
            self.interference = Interference()
            return {}
        self.interference = load_interference(cfg.interference_profile or cfg.profile)
        if cfg.host_cores:
            self.host = SharedHost(cfg.host_cores, self.interference.decode_factor, self.P,
                                   self.D)
            return {}
        return {i: HostMate(self.interference.decode_factor) for i in range(min(cfg.prefill_nodes, self.D))}

    def _slow(self, j: int) -> SlowSteps | None:
        """Decode node ``j``'s slow steps (`SimConfig.decode_tail`; its own stream, seeded from
        the loop's), else None. A node whose steps beside a prefill already take the measured
        ``decode_factor`` (on the shared host, or with a host-mate), which the learned tail
        counts (its requests' slowest tenth of steps ran beside a prefill), has slow steps of
        the rest, ``decode_tail / decode_factor`` (at least 1), so a step both slow and beside
        a prefill takes ``decode_tail``."""
        stretched = self.host is not None or j in self.mates
        factor = max(1.0, self.interference.decode_factor) if stretched else 1.0
        tail = max(1.0, self.config.decode_tail / factor)
        return None if tail == 1.0 else SlowSteps(
            tail, random.Random(self.loop.rng.getrandbits(64)))

    def prepare(self, requests: Sequence[SimRequest]) -> None:
        self.policy = policy_for(self.config, self.cost, requests)
        self.hot_keys = hot_prefixes(requests, HOT_KEYS)
        self.replica_series = {str(k): [] for k in self.hot_keys}
        self.ranked = ranked_keys(requests, TRACKED_RANKS)
        self.rank_series = {str(rank): [] for rank in self.ranked}

    # -- arrival and routing -------------------------------------------------------------------
    def _view(self, request: SimRequest, lengths: list[int], best: int,
              holder: int) -> ClusterView:
        now = self.loop.now
        loads = [PrefillLoad(pid, max(0.0, self.free_at[i] - now)
                             + sum(w.item.prefill_s for w in self.waiting[i]), self.queued[i],
                             waiting=tuple(w.item for w in self.waiting[i]))
                 for i, pid in enumerate(self.prefill_ids)]
        decodes = [DecodeState(self.decode_ids[j], d.batch_size, d.context_tokens, d.kv_used,
                               d.capacity, len(d.waiting), d.waiting_tokens)
                   for j, d in enumerate(self.decodes)]
        lookup = PrefixLookup(tuple(lengths), best, self.prefill_ids[holder] if best > 0 else None)
        groups = [(gid, [(PrefillLoad(sid, max(0.0, self.stage_free[g] - now),
                                      self.stage_queued[g]), 0) for sid in self.stage_ids[g]])
                  for g, gid in enumerate(self.group_ids)]
        twins = [[loads[t] for t in ts] for ts in self.twins] if self.twin_group else []
        return build_view(now, loads, lookup, decodes, link_bandwidth_Bps=self.cost.link_Bps,
                          link_latency_s=self.cost.link_latency_s, pending=self.pending.values(),
                          groups=groups, twins=twins)

    def on_arrival(self, request: SimRequest, record: RequestRecord) -> None:
        assert self.policy is not None, "prepare() runs before the first arrival"
        if request.input_tokens + request.output_tokens > self.decodes[0].capacity:
            # its KV could never fit a decode instance: rejected at once, as the baselines do
            record.rejected, record.reject_reason = RejectStage.ARRIVAL, "kv_capacity"
            return
        keys = request.block_keys
        lengths, best, holder = self.pool.prefix_lengths(keys)
        info = RequestInfo(str(request.index), request.arrival_s, request.input_tokens,
                           tuple(BlockHash(k) for k in keys), request.output_tokens)
        decision = self.policy.decide(info, self._view(request, lengths, best, holder))
        if isinstance(decision, Reject):
            record.rejected = decision.stage
            record.reject_reason = decision.reason
            return
        j = self.decode_index[decision.decode_id]
        if decision.stages:
            self._start_group(request, record, self.group_index[decision.prefill_id], j)
            return
        i = self.prefill_index[decision.prefill_id]
        bt = self.config.policy.block_tokens
        n_in = request.input_tokens
        local = lengths[i]
        reused = max(decision.reused_blocks, local)
        ready = self.loop.now
        if decision.fetch_from is not None and reused > local:
            h = self.prefill_index[InstanceId(str(decision.fetch_from))]
            fetched = min(reused * bt, n_in) - min(local * bt, n_in)
            start = max(ready, self.nic_free[i], self.nic_free[h])
            ready = start + self.cost.transfer_time(fetched * self._kvb)
            self.nic_free[i] = self.nic_free[h] = ready
            self.pool.touch(h, keys[local:reused])
            self.pool.insert(i, keys[:reused])
            record.fetched_tokens = fetched
        else:
            reused = local
            self.pool.touch(i, keys[:local])
        hit = min(reused * bt, n_in - 1)
        record.hit_tokens = hit
        record.prefill_id, record.decode_id = str(decision.prefill_id), str(decision.decode_id)
        record.prefill_busy = decision.prefill_busy
        if self.policy.queue_order.arrival_order:  # its turn is known now
            self._start_prefill(request, record, i, j, hit, ready)
            return
        self.waiting[i].append(_Waiting(request, record, j, hit, ready,
                                        self.policy.queued(info, decision)))
        self.queued[i] += 1
        self.pending[request.index] = self._pending(request, decision)
        self._dispatch(i)

    def _pending(self, request: SimRequest, route: Route) -> PendingDecode:
        return PendingDecode(self.loop.now + route.est_ttft_s, request.output_tokens,
                             route.decode_id, request.input_tokens)

    def _dispatch(self, i: int) -> None:
        """While node ``i`` is free, place the next of its waiting requests in the queue
        order; when it is busy, come back when it is free."""
        assert self.policy is not None, "prepare() runs before the first arrival"
        order, queue, now = self.policy.queue_order, self.waiting[i], self.loop.now
        while queue:
            free = self._free(i)
            if free > now:
                if self.dispatch_at[i] != free:
                    self.dispatch_at[i] = free
                    self.loop.at(free, Priority.COMPLETE, self._dispatch, i)
                return
            w = queue.pop(order.first([w.item for w in queue], now))
            self.queued[i] -= 1
            for g in self._start_prefill(w.request, w.record, i, w.decode, w.hit, w.ready):
                if g != i:
                    self._dispatch(g)  # a pipeline group took its time: come back later

    def _free(self, i: int) -> float:
        """When node ``i`` is free (a twin: and its group, which runs on its machine)."""
        g = self.twin_group.get(i)
        return self.free_at[i] if g is None else max(self.free_at[i], self.stage_free[g])

    def _group(self, i: int, new_tokens: int) -> list[int]:
        cfg = self.config
        pol = cfg.policy
        if new_tokens <= pol.cpp_threshold_tokens or pol.cpp_max_nodes == 1 or self.P == 1 \
                or cfg.cpp_groups:  # declared groups: single nodes prefill alone
            return [i]
        size = min(pol.cpp_max_nodes, self.P, math.ceil(new_tokens / pol.cpp_threshold_tokens))
        others = heapq.nsmallest(size - 1, (k for k in range(self.P) if k != i),
                                 key=lambda k: (self.free_at[k], k))
        return [i, *others]

    def _start_prefill(self, request: SimRequest, record: RequestRecord, i: int, j: int,
                       hit: int, ready: float) -> list[int]:
        """Place the request's prefill on the timeline of node ``i`` (and of its pipeline
        group); the nodes it occupies (none when ``prefill_reject`` drops it)."""
        new = request.input_tokens - hit
        group = self._group(i, new)
        k = len(group)
        duration = self.cost.prefill_time(new, hit)
        chunks = max(1, math.ceil(new / self.cost.prefill_chunk_tokens))
        if k > 1:  # pipeline over k nodes: 1/k of the layers each, bubbles of one chunk
            duration = duration / k * (1.0 + (k - 1) / chunks)
        start = max(ready, *(self._free(g) for g in group))
        duration = self._colocated(group, start, duration, chunks + k - 1)
        end = start + duration
        if self.config.prefill_reject and end - request.arrival_s > self.config.policy.ttft_slo_s:
            record.rejected = RejectStage.PREFILL
            record.reject_reason = "prefill_ttft_slo"
            self.pending.pop(request.index, None)
            return []
        for g in group:
            self.free_at[g] = end
            self.queued[g] += 1
        record.prefill_start_s = start
        record.prefill_gpu_s = duration * k
        self._add_colocated(group, start, end, chunks + k - 1)
        kv_ready = end + self.cost.transfer_time(request.input_tokens * self._kvb)
        self.pending[request.index] = PendingDecode(
            kv_ready, request.output_tokens, self.decode_ids[j], request.input_tokens)
        self.loop.at(end, Priority.COMPLETE, self._prefill_done, request, record, group, j,
                     kv_ready)
        return group

    def _colocated(self, group: list[int], start: float, duration: float, steps: int) -> float:
        """The prefill's ``duration`` (alone) on ``group``'s nodes from ``start``, ``steps``
        engine steps per node (chunks, plus a pipeline's fill), stretched by the decode nodes
        that share their hosts: each node's host-mate (``colocated``), or all of them and the
        other prefill nodes on the one shared host (``host_cores``)."""
        mates = [g for g in group if g in self.mates]
        if mates:
            busy = [self._decode_busy(g) for g in mates]
            duration = stretch(start, duration, min(b[0] for b in busy),
                               max(b[1] for b in busy), self.interference.prefill_factor)
        host = self.host
        if host is not None:
            # any decode node may take the core a step end frees: the longest step of theirs
            step = max(self.cost.decode_step_time(max(1, d.batch_size), max(1, d.context_tokens))
                       for d in self.decodes)
            alone, beside = host.prefill_factors(host.busy_at(start, but=group),
                                                 self.interference.prefill_factor,
                                                 duration / steps, step, threads=len(group))
            duration = stretch(start, duration * alone, *self._decode_busy_any(), beside)
        return duration

    def _add_colocated(self, group: list[int], start: float, end: float, steps: int) -> None:
        """Record a prefill placed on ``group``'s nodes with the hosts they share; the decode
        nodes on them re-plan."""
        now = self.loop.now
        for g in group:
            if g in self.mates:
                self.mates[g].add_prefill(start, end, now)
                self.decodes[g].replan()
        if self.host is not None:
            for g in group:
                self.host.add_prefill(g, start, end, now, steps)
            for d in self.decodes:
                d.replan()

    def _start_group(self, request: SimRequest, record: RequestRecord, g: int, j: int) -> None:
        """Place a request routed to declared group ``g``: it starts when the group is free
        and runs t₁/k · (1 + (k-1)/chunks) plus a chunk's hand-off per stage boundary (the
        policy's estimate, with the cost model's prefill and transfer times)."""
        pol, k = self.config.policy, self.config.cpp_group_stages
        new = request.input_tokens
        chunks = math.ceil(new / pol.cpp_chunk_tokens)
        hop = self.cost.transfer_time(min(new, pol.cpp_chunk_tokens)
                                      * pol.cpp_boundary_bytes_per_token)
        duration = self.cost.prefill_time(new, 0) / k * (1.0 + (k - 1) / chunks) + (k - 1) * hop
        start = max(self.loop.now, self.stage_free[g],
                    *(self.free_at[t] for t in self.twins[g]))  # twins' work on its machines
        end = start + duration
        if self.config.prefill_reject and end - request.arrival_s > pol.ttft_slo_s:
            record.rejected, record.reject_reason = RejectStage.PREFILL, "prefill_ttft_slo"
            return
        self.stage_free[g] = end
        self.stage_queued[g] += 1
        record.prefill_id, record.decode_id = str(self.group_ids[g]), str(self.decode_ids[j])
        record.prefill_start_s, record.prefill_gpu_s = start, duration * k
        kv_ready = end + self.cost.transfer_time(request.input_tokens * self._kvb)
        self.pending[request.index] = PendingDecode(
            kv_ready, request.output_tokens, self.decode_ids[j], request.input_tokens)
        self.loop.at(end, Priority.COMPLETE, self._group_done, request, record, g, j, kv_ready)

    def _group_done(self, request: SimRequest, record: RequestRecord, g: int, j: int,
                    kv_ready: float) -> None:
        self.stage_queued[g] -= 1
        self._prefill_done(request, record, [], j, kv_ready)

    def _decode_busy(self, j: int) -> tuple[float, float]:
        """Estimated window in which decode node ``j`` steps: from now while it runs (else
        from the first KV arriving for it) to the end of its running batch or of the requests
        whose KV is on its way, at its current step time (colocated nodes only)."""
        d = self.decodes[j]
        did = self.decode_ids[j]
        step = self.cost.decode_step_time(max(1, d.batch_size), max(1, d.context_tokens))
        coming = [(p.expected_decode_start_s, p.expected_output_tokens)
                  for p in self.pending.values() if p.decode_id == did]
        begin = self.loop.now if d.batch_size else min((s for s, _ in coming), default=math.inf)
        until = max([d.busy_until(), *(s + (n - 1) * step for s, n in coming)])
        return begin, until

    def _decode_busy_any(self) -> tuple[float, float]:
        """The union of the decode nodes' `_decode_busy` windows (a shared host)."""
        windows = [self._decode_busy(j) for j in range(self.D)]
        return min(w[0] for w in windows), max(w[1] for w in windows)

    def _prefill_done(self, request: SimRequest, record: RequestRecord, group: list[int],
                      j: int, kv_ready: float) -> None:
        for g in group:
            self.queued[g] -= 1
        if group:  # a declared group's stages cache no whole-model prefix
            self.pool.insert(group[0], request.block_keys)
        record.first_token_s = self.loop.now
        if request.output_tokens < 2:
            self.pending.pop(request.index, None)
            record.kv_ready_s = record.decode_start_s = self.loop.now
            record.finish_decode([self.loop.now])
            return
        self.loop.at(kv_ready, Priority.COMPLETE, self._kv_arrived, request, record, j)

    def _kv_arrived(self, request: SimRequest, record: RequestRecord, j: int) -> None:
        self.pending.pop(request.index, None)
        record.kv_ready_s = self.loop.now
        job = DecodeJob(record, request.input_tokens, request.output_tokens)
        d = self.decodes[j]
        if self.config.decode_reject:
            reason = ""
            if not d.can_admit_now(job):
                reason = "decode_kv_full"
            elif self._predicted_tbt(d, job) > self.config.policy.tbt_slo_s:
                reason = "decode_tbt_slo"
            if reason:
                record.rejected = RejectStage.DECODE
                record.reject_reason = reason
                return
        d.enqueue(job)

    def _predicted_tbt(self, d: DecodeInstance, job: DecodeJob) -> float:
        """The decode node's re-check of the TBT with ``job`` joining: the step time by the
        Conductor's decode predictor (the node and the Conductor predict alike; with the cost
        model itself here, the predictor's error of ≈ 2 % near a full node — larger than one
        request's share of a step — would make every arrival-time check pass that this check
        then fails)."""
        assert self.policy is not None, "prepare() runs before the first arrival"
        now = self.loop.now
        busy = self.policy.tbt_tail != 1.0 and (any(
            f > now or q for f, q in zip(self.free_at, self.waiting, strict=True))
            or any(f > now for f in self.stage_free))
        step = self.policy.decode_time(d.batch_size + 1, d.context_tokens + job.input_tokens + 1)
        return self.policy.tbt(step, busy)

    # -- observation ---------------------------------------------------------------------------
    def load(self) -> dict[str, float]:
        now = self.loop.now
        slo = self.config.policy.ttft_slo_s
        for k in self.hot_keys:
            self.replica_series[str(k)].append(self.pool.replicas(k))
        for rank, k in self.ranked.items():
            self.rank_series[str(rank)].append(self.pool.replicas(k))
        stages = self.config.cpp_group_stages * len(self.stage_free)
        return {  # a declared group's queue counts once per stage (each is a prefill instance)
            "prefill_load": (sum(max(0.0, f - now) + sum(w.item.prefill_s for w in q)
                                 for f, q in zip(self.free_at, self.waiting, strict=True))
                             + sum(max(0.0, f - now) for f in self.stage_free)
                             * self.config.cpp_group_stages) / (self.P + stages) / slo,
            "prefill_queued": float(sum(self.queued) + sum(self.stage_queued)),
            "decode_load": sum(d.kv_used / d.capacity for d in self.decodes) / self.D,
            "decode_tbt_load": self._tbt_load(),
            "decode_batch": sum(d.batch_size for d in self.decodes) / self.D,
            "decode_waiting": float(sum(len(d.waiting) for d in self.decodes)),
        }

    def _tbt_load(self) -> float:
        """arXiv §7.1's decode load: predicted TBT of each node's running batch / TBT SLO,
        averaged over the decode nodes (an idle node counts 0)."""
        assert self.policy is not None, "prepare() runs before the first sample"
        predict, slo = self.policy.decode_time, self.config.policy.tbt_slo_s
        return sum(predict(d.batch_size, d.context_tokens) / slo
                   for d in self.decodes if d.batch_size) / self.D

    def extra(self) -> dict[str, object]:
        return {"hot_key_replicas": self.replica_series, "ranked_key_replicas": self.rank_series,
                "pool_evictions": self.pool.evictions,
                "decode_iterations": sum(len(d.step_ends) for d in self.decodes)}


@SYSTEMS.register("mooncake")
def _build(ctx: SystemContext) -> SimSystem:
    return MooncakeSystem(ctx)
