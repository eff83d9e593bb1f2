"""`LiveCluster`: the Conductor's picture of its instances, turned into a `ClusterView` per
request (all on the Conductor's loop; built by `conductor.service`, read by `conductor.dispatch`).

`add(address)` connects an `InstanceClient` and subscribes; each `LoadReport` refreshes the
member's load and its cache keys in the `KvIndex` (the store's holder comes from
`conductor.kvfeed`). `view` reduces the live members to the pure builder's inputs
(`conductor.view.build_view`, shared with the simulator). The dispatcher reports what it routed
(`routed`, `admitted`, `prefill_done`) so the load between two reports includes its own work.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from yuebing.conductor.gate import PrefillGate
from yuebing.conductor.pages import EnginePages
from yuebing.conductor.policy import (
    DecodeState,
    PendingDecode,
    QueueOrder,
    RequestInfo,
    Route,
)
from yuebing.conductor.policy.types import ClusterView
from yuebing.conductor.view import KvIndex, PrefillLoad, build_view
from yuebing.core.errors import ConfigError
from yuebing.core.ids import InstanceId
from yuebing.engine.config import parse_group_layers, parse_layers
from yuebing.instance.client import InstanceClient, InstanceError, InstanceUnavailable
from yuebing.protocol.instance import Hello, LoadReport, Role

log = logging.getLogger(__name__)


def seat_of(hello: Hello) -> tuple[str, str] | None:
    """The pipeline seat a stage (``--layers``) or its whole-model twin (``--twin-of``) sits
    in: its group and its layer range written canonically (``0: 15`` is ``0:15``), so a stage
    and its twin meet whatever spelling each was given; None for any other instance."""
    seat = hello.layers or hello.twin_of
    if not (hello.group and seat and hello.role == Role.PREFILL):
        return None
    try:
        a, b = parse_layers(seat, None)
    except ConfigError:
        return hello.group, seat
    return hello.group, f"{a}:{b}"


ALL_CORES = 1 << 16
"""`_step_threads` of a prefill whose host-mates are all idle: whatever the host has."""


@dataclass
class Member:
    """One instance as the Conductor knows it."""

    address: str
    client: InstanceClient
    hello: Hello
    report: LoadReport | None = None
    seen_s: float = 0.0
    alive: bool = True
    prefilling: dict[str, tuple[float, float]] = field(default_factory=dict)
    """This Conductor's tasks still in prefill here: request id → (est. seconds, routed at or,
    once out of the gate, admitted at)."""
    gate: PrefillGate = field(default_factory=lambda: PrefillGate(0))
    """This Conductor's queue for the instance (prefill role; see `yuebing.conductor.gate`)."""
    decoding: set[str] = field(default_factory=set)
    """This Conductor's requests routed here to decode (coupled: to run) and not ended yet."""
    reported: set[str] = field(default_factory=set)
    """Those of ``decoding`` when its latest report came (the report may count them)."""
    ended: int = 0
    """Requests of ``reported`` that ended since (`decode_done`): not running any more,
    whatever that report says."""
    pages: EnginePages | None = None
    """The engine's prefix pages as this Conductor knows them (a prefill or coupled instance
    of the whole model; `conductor.pages`)."""

    @property
    def id(self) -> InstanceId:
        return InstanceId(self.hello.instance_id)

    @property
    def role(self) -> Role:
        return self.hello.role


def _engine_pages(hello: Hello) -> EnginePages | None:
    """An empty `EnginePages` for a whole-model instance that prefills and reuses cached
    pages, sized to its pool (None for any other; a vLLM instance that says no pool size yet,
    before its first metrics, gets none)."""
    if hello.role == Role.DECODE or hello.layers or not hello.prefix_caching \
            or hello.block_size <= 0 or hello.num_blocks <= 0 \
            or hello.store_block_tokens % hello.block_size:
        return None
    return EnginePages(hello.block_size, hello.num_blocks)


class LiveCluster:
    """Members, their loads, the KV index and the routed-but-not-decoding requests.

    Liveness: an instance with no report for ``heartbeat_timeout_s``, or whose connection
    dropped (`_on_link`), is dead: it leaves the view, its cache leaves the index, and every
    open event stream on its client ends with one ERROR naming it (the cluster owns that ERROR
    for its clients). A dead instance is re-subscribed in the background and rejoins when it
    answers (a restarted one with its new incarnation)."""

    def __init__(self, heartbeat_timeout_s: float, rpc_timeout_s: float,
                 store_block_tokens: int, prefill_time: Callable[[float, float], float],
                 link_bandwidth_Bps: float, link_latency_s: float,
                 conductor_id: str = "conductor", prefill_gate_tokens: int = 0,
                 queue_order: QueueOrder | None = None) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self.store_block_tokens = store_block_tokens
        self.prefill_time = prefill_time
        self.prefill_factor: Callable[[int, str], float] = lambda step_threads, _id: 1.0
        """An instance's prefill time per predicted second when its steps would run with
        ``step_threads`` (its load report's; `Calibration.prefill_factor`), by its id."""
        self.link_bandwidth_Bps = link_bandwidth_Bps
        self.link_latency_s = link_latency_s
        self.conductor_id = conductor_id
        self.prefill_gate_tokens = prefill_gate_tokens
        self.queue_order = queue_order
        """The order of each prefill instance's gate (the policy's; None: FIFO)."""
        self.index = KvIndex()
        self.ranges = KvIndex()
        """The store's layer-range objects (pipeline stages'): holder ``"A:B"`` → block keys."""
        self.members: dict[InstanceId, Member] = {}
        self.by_address: dict[str, Member] = {}
        self.fingerprint = ""
        self.max_model_len = 0
        self.pending: dict[str, PendingDecode] = {}
        self.on_dead: list[Callable[[Member], None]] = []
        self.on_members: list[Callable[[], None]] = []
        """Called when an instance enters or leaves `alive` (its first report, back, dead)."""
        self.on_reports: list[Callable[[Member, LoadReport], None]] = []
        """Called with each accepted load report, after the member, the view and the index took
        it (a callback's exception is logged, not raised)."""
        self.admit_checks: list[Callable[[Hello], str]] = []
        """More checks of a joining instance's `Hello` ('' = fine, else why it is refused)."""
        self._wanted: set[str] = set()
        self._seat_gates: dict[tuple[str, str], PrefillGate] = {}
        """The gate of each pipeline stage's machine (group, layers), which the stage and its
        whole-model twin (``--twin-of``) share."""
        self._group_problems: set[tuple[str, str]] = set()
        """(group, problem) pairs already logged by `groups`."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._liveness: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ membership

    def start(self) -> None:
        self._liveness = asyncio.get_running_loop().create_task(self._watch_liveness())

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background, keeping a reference until it ends."""
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def add(self, address: str) -> None:
        """Connect to the instance at ``address`` (retried in the background until it answers)."""
        if address in self._wanted:
            return
        self._wanted.add(address)
        self.spawn(self._connect(address))

    def discard(self, address: str) -> None:
        """Stop using the instance at ``address`` (it left discovery)."""
        self._wanted.discard(address)
        m = self.by_address.pop(address, None)
        if m is not None:
            self._mark_dead(m, f"instance {m.id} left discovery")
            self.members.pop(m.id, None)
            self.spawn(m.client.close())

    async def _connect(self, address: str, delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        while address in self._wanted:
            client = InstanceClient(address, timeout_s=min(self.rpc_timeout_s, 1.0),
                                    on_report=functools.partial(self._on_report, address))
            client.on_link = functools.partial(self._on_link, address, client)
            try:
                hello = await client.subscribe(self.conductor_id)
            except (InstanceUnavailable, InstanceError) as e:
                log.debug("instance %s not ready: %s", address, e)
                await client.close()
                await asyncio.sleep(0.5)
                continue
            client.timeout_s = self.rpc_timeout_s
            problem = self._admit(hello)
            if problem:
                log.error("not using instance %s at %s: %s", hello.instance_id, address, problem)
                await client.close()
                return
            old = self.by_address.get(address)
            if old is not None:
                old.client.fail_all(f"instance {old.id} restarted")
                self.spawn(old.client.close())
            m = Member(address, client, hello, seen_s=time.monotonic(), gate=self._gate(hello),
                       pages=_engine_pages(hello))
            self.members[m.id] = m
            self.by_address[address] = m
            log.info("instance %s (%s, %s) joined from %s", m.id, m.role.label, hello.model,
                     address)
            return

    def _gate(self, hello: Hello) -> PrefillGate:
        """A new gate, or the one of the stage's machine a stage and its twin share."""
        key = seat_of(hello)
        if key is None:
            return PrefillGate(self.prefill_gate_tokens, self.queue_order)
        if key not in self._seat_gates:
            self._seat_gates[key] = PrefillGate(self.prefill_gate_tokens, self.queue_order)
        return self._seat_gates[key]

    def _admit(self, hello: Hello) -> str:
        if hello.store_block_tokens != self.store_block_tokens:
            return (f"its store blocks are {hello.store_block_tokens} tokens, this Conductor's "
                    f"{self.store_block_tokens} (--store-block-tokens)")
        if self.fingerprint and hello.fingerprint != self.fingerprint:
            return (f"its KV fingerprint {hello.fingerprint} differs from the cluster's "
                    f"{self.fingerprint} (another model, weights or dtype)")
        other = self.members.get(InstanceId(hello.instance_id))
        if other is not None and other.address != hello.control_address and other.alive \
                and other.address in self._wanted:
            return f"instance id {hello.instance_id} is already used by {other.address}"
        for check in self.admit_checks:
            if problem := check(hello):
                return problem
        self.fingerprint = hello.fingerprint
        self.max_model_len = min(self.max_model_len or hello.max_model_len, hello.max_model_len)
        return ""

    # ------------------------------------------------------------------ reports and liveness

    def _on_report(self, address: str, r: LoadReport) -> None:
        m = self.by_address.get(address)
        if m is None or r.instance_id != m.hello.instance_id:
            return
        if r.incarnation != m.hello.incarnation:  # restarted: start over with a new client
            self._mark_dead(m, f"instance {m.id} restarted")
            self.by_address.pop(address, None)
            if self.members.get(m.id) is m:
                del self.members[m.id]
            self.spawn(m.client.close())
            self.spawn(self._connect(address))
            return
        if m.report is not None and r.report_seq != m.report.report_seq + 1 \
                and not r.cache_full_resync:
            log.warning("instance %s: load report %d after %d; asking for a full resync", m.id,
                        r.report_seq, m.report.report_seq)
            self.spawn(self._resubscribe(m))
        joined = m.report is None or not m.alive
        m.report = r
        m.reported, m.ended = set(m.decoding), 0
        m.seen_s = time.monotonic()
        if not m.alive:
            log.info("instance %s is back", m.id)
            m.alive = True
        if joined:
            self._members_changed()
        if m.role != Role.DECODE:
            if r.cache_full_resync:
                self.index.replace(m.id, r.cache_added)
            else:
                self.index.add(m.id, r.cache_added)
                self.index.remove(m.id, r.cache_removed)
        for took in self.on_reports:
            try:
                took(m, r)
            except Exception:  # a listener's bug must not end this instance's reports
                log.exception("load report listener %s failed", took)

    def _on_link(self, address: str, client: InstanceClient, up: bool) -> None:
        """The connection of ``client`` dropped (the instance at ``address`` died or restarted:
        it leaves the view now rather than after the heartbeat timeout) or is up again (a
        new peer to the instance: subscribe there, and a restarted one's reports tell its new
        incarnation, `_on_report`). The client leaves ending its streams to this callback:
        `_mark_dead` does, and for a client no longer a member's, this."""
        m = self.by_address.get(address)
        if m is None or m.client is not client:
            if not up:
                client.fail_all(f"the connection to the instance at {address} was lost")
            return
        if up:
            self.spawn(self._resubscribe(m))
        else:
            self._mark_dead(m, f"the connection to instance {m.id} was lost")

    async def _resubscribe(self, m: Member) -> None:
        """Subscribe again: the instance answers with a full cache resync in its reports; a
        dead one that is alive again resumes its reports, a restarted one reports with its new
        incarnation (see `_on_report`)."""
        with contextlib.suppress(InstanceUnavailable, InstanceError):
            await m.client.subscribe(self.conductor_id)

    async def _watch_liveness(self) -> None:
        period = min(0.25, self.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for m in list(self.members.values()):
                if m.alive and now - m.seen_s > self.heartbeat_timeout_s:
                    self._mark_dead(m, f"instance {m.id} sent no load report for "
                                       f"{now - m.seen_s:.1f} s")
                elif not m.alive and m.address in self._wanted and now - m.seen_s > 1.0:
                    m.seen_s = now - self.heartbeat_timeout_s  # retry about once a second
                    self.spawn(self._resubscribe(m))

    def _mark_dead(self, m: Member, reason: str) -> None:
        """Out of the view and the index; its gate's waiters, calls and open event streams
        fail with ``reason`` (each stream once, `InstanceClient.fail_all`)."""
        left = m.alive
        if m.alive:
            log.warning("%s: it leaves the view", reason)
        m.alive = False
        exc = InstanceUnavailable(reason)
        if seat_of(m.hello) is None:
            m.gate.fail(exc)
        else:  # a shared gate: only this one's requests, and a group request fails at every
            mine = set(m.prefilling)  # stage's gate it waits at or holds, not after its turn
            for gate in {id(x.gate): x.gate for x in self.members.values()
                         if x.hello.group == m.hello.group and seat_of(x.hello)}.values():
                gate.fail(exc, mine)
        m.prefilling.clear()
        self.index.drop(m.id)
        for cb in self.on_dead:
            cb(m)
        if left:
            self._members_changed()
        m.client.fail_all(reason)

    def _members_changed(self) -> None:
        for changed in self.on_members:
            try:
                changed()
            except Exception:  # a listener's bug must not end this instance's reports
                log.exception("membership listener %s failed", changed)

    # ------------------------------------------------------------------ views

    def alive(self, *roles: Role) -> list[Member]:
        """The alive members of ``roles`` that serve alone (pipeline stages: `groups`)."""
        return [m for m in self.members.values() if m.alive and m.report is not None
                and m.role in roles and not m.hello.layers]

    def stages(self) -> list[Member]:
        """The alive pipeline stages (prefill instances of one layer range)."""
        return [m for m in self.members.values() if m.alive and m.report is not None
                and m.hello.layers]

    def groups(self) -> list[tuple[InstanceId, list[Member]]]:
        """The complete pipeline groups: stages of one ``--cpp-group`` name, in layer order,
        whose ranges tile the model's layers and which are all alive. A group with a stage
        down (or missing) is out until every stage answers again."""
        named: dict[str, list[Member]] = {}
        for m in self.members.values():
            if m.hello.layers and m.role == Role.PREFILL:
                named.setdefault(m.hello.group, []).append(m)
        out = []
        for name, stages in sorted(named.items()):
            if not all(m.alive and m.report is not None for m in stages):
                continue
            stages.sort(key=lambda m: parse_layers(m.hello.layers, None))
            try:
                parse_group_layers([m.hello.layers for m in stages],
                                   stages[0].hello.num_layers or None)
            except ConfigError as e:  # not (yet) covering the model, or overlapping
                if (name, str(e)) not in self._group_problems:
                    self._group_problems.add((name, str(e)))
                    log.warning("pipeline group %r is not used: %s", name or "cpp", e)
                continue
            out.append((InstanceId(name or "cpp"), stages))
        return out

    def twins(self, stages: list[Member]) -> list[Member]:
        """The alive whole-model twins (``--twin-of``) of a group's ``stages``, in stage order."""
        seats = {seat_of(m.hello): i for i, m in enumerate(stages)}
        found = sorted((seats[seat_of(m.hello)], m.hello.instance_id, m)
                       for m in self.alive(Role.PREFILL)
                       if m.hello.twin_of and seat_of(m.hello) in seats)
        return [m for _, _, m in found]

    def assembled_run(self, keys: tuple[int, ...]) -> tuple[int, list[str]]:
        """The longest leading run of ``keys`` whose every layer is in the store as the range
        objects of one group's tiling (any group ever seen, alive or not), and those ranges."""
        tilings: dict[str, list[str]] = {}
        for m in self.members.values():
            if m.hello.layers:
                tilings.setdefault(m.hello.group, []).append(m.hello.layers)
        best: tuple[int, list[str]] = (0, [])
        for ranges in tilings.values():
            ranges.sort(key=lambda r: parse_layers(r, None))
            try:
                parse_group_layers(ranges, None)
            except ConfigError:
                continue
            run = min(self.ranges.run_of(r, keys) for r in ranges)
            if run > best[0]:
                best = (run, ranges)
        return best

    def view(self, info: RequestInfo, prefills: list[Member], decodes: list[Member],
             now_s: float, groups: list[tuple[InstanceId, list[Member]]] | None = None,
             page_keys: Callable[[int], Sequence[int]] | None = None) -> ClusterView:
        """The request's `ClusterView` over ``prefills`` (and pipeline ``groups``) ×
        ``decodes`` at ``now_s``; ``page_keys``: the prompt's `conductor.pages.page_keys` for
        a page size (None: count the held blocks only)."""
        loads = [self._prefill_load(m, now_s) for m in prefills]
        lookup = self.index.lookup(info.block_keys, [m.id for m in prefills])
        if page_keys is not None and any(m.pages is not None for m in prefills):
            lookup = replace(lookup, local_extra=tuple(
                self._page_extra(m.pages, page_keys, n, info.input_tokens) if m.pages else 0
                for m, n in zip(prefills, lookup.local_blocks, strict=True)))
        states = [decode_state(m.report, m.hello.block_size, m.id)
                  for m in decodes if m.report is not None]
        glo = [(gid, [(self._prefill_load(m, now_s),
                       self.ranges.run_of(m.hello.layers, info.block_keys)) for m in stages])
               for gid, stages in groups or ()]
        twins = [[self._prefill_load(t, now_s) for t in self.twins(stages)]
                 for _, stages in groups or ()]
        return build_view(now_s, loads, lookup, states, link_bandwidth_Bps=self.link_bandwidth_Bps,
                          link_latency_s=self.link_latency_s, pending=self.pending.values(),
                          groups=glo, twins=twins)

    def _page_extra(self, pages: EnginePages, page_keys: Callable[[int], Sequence[int]],
                    blocks: int, prompt_tokens: int) -> int:
        """Tokens past ``blocks`` held store blocks that the engine's pages hold too, within
        the next block (a whole one held would be in the index; one it evicted would not, and
        the pages never learn of it) and short of the prompt's last token (the engine reuses
        whole pages before it)."""
        size, bt = pages.page_tokens, self.store_block_tokens
        upto = min((blocks + 1) * bt - size, (prompt_tokens - 1) // size * size)
        return pages.extra(page_keys(size), blocks * bt, upto)

    def _prefill_load(self, m: Member, now_s: float) -> PrefillLoad:
        r = m.report
        assert r is not None
        if r.prefill_tokens_per_s > 0:
            reported = r.queued_prefill_tokens / r.prefill_tokens_per_s
        else:
            reported = self.prefill_time(r.queued_prefill_tokens, 0) \
                if r.queued_prefill_tokens else 0.0
        reported -= max(0.0, now_s - m.seen_s)
        waiting = m.gate.queued()
        if seat_of(m.hello) is not None:  # a shared gate: this one's waiters
            waiting = tuple(w for w in waiting if w.request_id in m.prefilling)
        held = {w.request_id for w in waiting}
        started = [(est, t) for rid, (est, t) in m.prefilling.items() if rid not in held]
        own = 0.0
        if started:
            own = sum(est for est, _ in started) - (now_s - min(t for _, t in started))
        return PrefillLoad(m.id, max(reported, own, 0.0) + sum(w.prefill_s for w in waiting),
                           max(r.queued_requests, len(m.prefilling)), waiting=waiting,
                           time_factor=self.prefill_factor(self._step_threads(m), m.id))

    def _step_threads(self, m: Member) -> int:
        """The threads a prefill on ``m`` would run with. This Conductor's own work on one of
        its host's other instances (routed there and not ended) keeps it to its own; else
        every core when each of them is idle by its latest report, less this Conductor's
        requests that ended there since (a report can lag a decode that just went idle, and
        a client's next request often comes before it); else its report's."""
        r = m.report
        assert r is not None
        if not r.step_threads:  # it never borrows
            return 0
        mates = [o for o in self.members.values()
                 if o is not m and o.alive and o.hello.host == m.hello.host]
        if any(o.decoding or o.prefilling for o in mates):
            return 0
        if mates and all(o.report is not None and o.report.running <= o.ended
                         and not (o.report.waiting or o.report.queued_requests)
                         for o in mates):
            return ALL_CORES
        return r.step_threads

    def pool_loads(self, decode_time: Callable[[int, int], float], ttft_slo_s: float,
                   tbt_slo_s: float, now_s: float) -> dict[str, float]:
        """The pools' load as the arXiv report defines it (and the simulator samples it):
        ``prefill`` = mean predicted queued seconds of the prefill instances / TTFT SLO,
        ``decode`` = mean predicted step time of the decode instances' running batches / TBT
        SLO (an idle instance counts 0), ``decode_kv`` = mean share of decode KV in use.
        Coupled instances count in both pools; pipeline stages are prefill instances."""
        prefills = (self.alive(Role.PREFILL) + self.stages()) or self.alive(Role.COUPLED)
        decodes = self.alive(Role.DECODE) or self.alive(Role.COUPLED)
        queued = [self._prefill_load(m, now_s).queue_s for m in prefills]
        states = [decode_state(m.report, m.hello.block_size, m.id)
                  for m in decodes if m.report is not None]
        tbt = [decode_time(d.batch_size, d.context_tokens) if d.batch_size else 0.0
               for d in states]
        return {"prefill": sum(queued) / len(queued) / ttft_slo_s if queued else 0.0,
                "decode": sum(tbt) / len(tbt) / tbt_slo_s if tbt else 0.0,
                "decode_kv": (sum(d.kv_used_tokens / d.kv_capacity_tokens for d in states)
                              / len(states)) if states else 0.0}

    # ------------------------------------------------------------------ this Conductor's work

    def routed(self, info: RequestInfo, route: Route, now_s: float) -> None:
        for pid in route.stages or (route.prefill_id,):  # a group's prefill busies every stage
            p = self.members.get(pid)
            if p is not None:
                p.prefilling[info.request_id] = (route.est_prefill_s + route.est_transfer_s,
                                                 now_s)
        self.pending[info.request_id] = PendingDecode(
            now_s + route.est_ttft_s, info.expected_output_tokens, route.decode_id,
            info.input_tokens)
        d = self.members.get(route.decode_id)
        if d is not None:
            d.decoding.add(info.request_id)

    def admitted(self, request_id: str, prefill_id: InstanceId, now_s: float) -> None:
        """``request_id`` left the instance's gate: its prefill starts counting down now."""
        p = self.members.get(prefill_id)
        if p is not None and request_id in p.prefilling:
            p.prefilling[request_id] = (p.prefilling[request_id][0], now_s)

    def prefill_done(self, request_id: str, prefill_id: InstanceId) -> None:
        p = self.members.get(prefill_id)
        if p is not None:
            p.prefilling.pop(request_id, None)
            p.gate.release(request_id)
        self.pending.pop(request_id, None)

    def decode_done(self, request_id: str, decode_id: InstanceId) -> None:
        """``request_id``, routed to decode on ``decode_id``, ended (its stream is over, or
        the attempt failed)."""
        d = self.members.get(decode_id)
        if d is not None and request_id in d.decoding:
            d.decoding.discard(request_id)
            if request_id in d.reported:
                d.reported.discard(request_id)
                d.ended += 1

    async def close(self) -> None:
        self._wanted.clear()
        if self._liveness is not None:
            self._liveness.cancel()
        for t in list(self._tasks):
            t.cancel()
        for m in self.members.values():
            await m.client.close()


def decode_state(r: LoadReport, block_size: int, instance_id: InstanceId) -> DecodeState:
    """A decode instance's `DecodeState` from its report. Blocks reserved for requests still in
    prefill are not counted as used: those requests are in the view's pending decodes."""
    used = max(0, r.total_blocks - r.free_blocks - r.reserved_blocks) * block_size
    mean_ctx = r.context_tokens // r.running if r.running else 0
    return DecodeState(instance_id, r.running, r.context_tokens, used,
                       max(1, r.total_blocks * block_size), r.waiting, r.waiting * mean_ctx)
