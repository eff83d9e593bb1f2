"""`LiveCluster._on_report`: a load report reaches the member, the view and the KV index
before the report listeners (`on_reports`), and a listener that raises is logged without
stopping either."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from yuebing.conductor.cluster import LiveCluster, Member
from yuebing.conductor.policy import PendingDecode, RequestInfo
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


def test_a_prefill_whose_host_mates_are_idle_is_viewed_on_every_core() -> None:
    """Its own report may lag a decode that just went idle: the decode's report and this
    Conductor's accounting say it is, so the prefill borrows every core."""
    c, p = _cluster()
    d = _member(c, "d0", Role.DECODE)
    far = _member(c, "d1", Role.DECODE, host="elsewhere")
    c.prefill_factor = lambda threads: 0.5 if threads >= 2 else 1.0
    info = RequestInfo("r", 0.0, 100, (), 10)
    c._on_report(far.address, _report(1, [], running=3, name="d1"))  # another host: no say
    c._on_report(p.address, _report(1, [], step_threads=1))  # its report: d0 was busy
    c._on_report(d.address, _report(1, [], running=1, name="d0"))
    assert c.view(info, [p], [], 0.0).prefills[0].time_factor == 1.0
    c.decode_done(d.id)  # its request ended, before its report says so
    assert c.view(info, [p], [], 0.0).prefills[0].time_factor == 0.5
    c._on_report(d.address, _report(2, [], running=1, name="d0"))  # then another came
    assert c.view(info, [p], [], 0.0).prefills[0].time_factor == 1.0
    c._on_report(d.address, _report(3, [], running=0, name="d0"))  # d0 went idle
    assert c.view(info, [p], [], 0.0).prefills[0].time_factor == 0.5
    c.pending["r0"] = PendingDecode(1.0, 10, d.id)  # a request routed to d0 is on its way
    assert c.view(info, [p], [], 0.0).prefills[0].time_factor == 1.0
    del c.pending["r0"]
    c._on_report(p.address, _report(2, [], step_threads=0))  # one that never borrows
    assert c.view(info, [p], [], 0.0).prefills[0].time_factor == 1.0


def test_a_prefill_instance_reporting_lent_cores_is_viewed_at_their_speed() -> None:
    c, m = _cluster()
    c.prefill_factor = lambda threads: {1: 1.0, 2: 0.55}.get(threads, 1.0)
    info = RequestInfo("r", 0.0, 100, (), 10)
    for seq, (threads, factor) in enumerate(((2, 0.55), (1, 1.0), (0, 1.0)), 1):
        c._on_report(m.address, _report(seq, [], step_threads=threads))
        v = c.view(info, [m], [], 0.0)
        assert v.prefills[0].time_factor == factor


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
