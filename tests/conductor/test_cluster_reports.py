"""`LiveCluster._on_report`: a load report reaches the member, the view and the KV index
before the report listeners (`on_reports`), and a listener that raises is logged without
stopping either."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from yuebing.conductor.cluster import LiveCluster, Member
from yuebing.conductor.policy import RequestInfo, Route
from yuebing.protocol.instance import Hello, LoadReport, Role


def _report(seq: int, added: list[int], step_threads: int = 0, running: int = 0,
            name: str = "p0") -> LoadReport:
    return LoadReport(instance_id=name, incarnation="i", report_seq=seq, time_s=0.0,
                      queued_prefill_tokens=0, queued_requests=0, running=running, waiting=0,
                      context_tokens=0, free_blocks=64, total_blocks=64, reserved_blocks=0,
                      prefill_tokens_per_s=1000.0, decode_step_s=0.05, cache_added=added,
                      step_threads=step_threads)


def _member(c: LiveCluster, name: str = "p0", role: Role = Role.PREFILL,
            host: str = "h") -> Member:
    h = Hello(seq=0, instance_id=name, role=role, model="m", fingerprint="fp",
              host=host, control_address=f"tcp://{name}:1", kv_segment="s", block_size=16,
              store_block_tokens=256, num_blocks=64, max_model_len=4096, incarnation="i",
              num_layers=4)
    m = Member(f"tcp://{name}:1", SimpleNamespace(), h, alive=False)  # type: ignore[arg-type]
    c.members[m.id] = m
    c.by_address[m.address] = m
    return m


def _cluster() -> tuple[LiveCluster, Member]:
    c = LiveCluster(2.0, 1.0, 256, lambda n, k: 0.0, 1e7, 0.0)
    return c, _member(c)


def _route(rid: str, pre: Member, dec: Member) -> tuple[RequestInfo, Route]:
    return RequestInfo(rid, 0.0, 100, (), 10), Route(
        prefill_id=pre.id, decode_id=dec.id, reused_blocks=0, fetch_from=None, fetch_blocks=0,
        est_transfer_s=0.0, est_queue_s=0.0, est_prefill_s=1.0, est_ttft_s=1.0, est_tbt_s=0.1)


def test_a_prefill_whose_host_mates_are_idle_is_viewed_on_every_core() -> None:
    """Its own report may lag its host-mates: this Conductor's own work on a mate keeps it
    to its own cores, and a mate idle by its report net of this Conductor's requests that
    ended there since lends it every core."""
    c, p = _cluster()
    d = _member(c, "d0", Role.DECODE)
    far = _member(c, "d1", Role.DECODE, host="elsewhere")
    c.prefill_factor = lambda threads, _id: 0.5 if threads >= 2 else 1.0

    def factor() -> float:
        return c.view(RequestInfo("r", 0.0, 100, (), 10), [p], [], 0.0).prefills[0].time_factor

    c._on_report(far.address, _report(1, [], running=3, name="d1"))  # another host: no say
    c._on_report(p.address, _report(1, [], step_threads=1))  # its report: d0 was busy
    c._on_report(d.address, _report(1, [], running=0, name="d0"))
    assert factor() == 0.5  # d0 idle by its own, newer report
    c._on_report(p.address, _report(2, [], step_threads=2))
    c.routed(*_route("r1", p, d), 0.0)  # r1 will prefill here, then decode on d0 ...
    assert factor() == 1.0  # ... so the next prefill runs beside it, whatever p0 reported
    c.prefill_done("r1", p.id)  # r1's first token: decoding on d0 now
    assert factor() == 1.0
    c._on_report(p.address, _report(3, [], step_threads=1))
    c._on_report(d.address, _report(2, [], running=1, name="d0"))
    c.decode_done("r1", d.id)  # r1 ended before d0's report says so
    assert factor() == 0.5
    c.routed(*_route("r2", p, d), 0.0)  # an attempt that failed before d0 held it
    c.prefill_done("r2", p.id)
    c.decode_done("r2", d.id)
    assert factor() == 0.5  # counted nowhere: d0's report never had it
    c._on_report(d.address, _report(3, [], running=1, name="d0"))  # another Conductor's
    assert factor() == 1.0
    c._on_report(d.address, _report(4, [], running=0, name="d0"))
    c._on_report(p.address, _report(4, [], step_threads=0))  # one that never borrows
    assert factor() == 1.0


def test_a_raising_report_listener_does_not_stop_the_index_update(caplog) -> None:
    c, m = _cluster()
    seen: list[tuple[bool, frozenset[int]]] = []
    joins: list[bool] = []

    def broken(_m: Member, _r: LoadReport) -> None:
        raise RuntimeError("listener bug")

    c.on_reports += [broken, lambda mem, r: seen.append((mem.alive, c.index.keys_of("p0")))]
    c.on_members.append(lambda: joins.append(True))
    with caplog.at_level(logging.ERROR, logger="yuebing.conductor.cluster"):
        c._on_report(m.address, _report(1, [7, 8]))
        c._on_report(m.address, _report(2, [9]))
    assert m.alive and joins == [True] and m.report is not None and m.report.report_seq == 2
    assert c.index.keys_of("p0") == frozenset({7, 8, 9})
    # the listeners run after the view and the index took each report
    assert seen == [(True, frozenset({7, 8})), (True, frozenset({7, 8, 9}))]
    assert sum("load report listener" in r.getMessage() for r in caplog.records) == 2
