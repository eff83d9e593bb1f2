"""`CoreLedger`: steps borrow unclaimed cores, a claimer waits for the borrower's step, the
host never runs more step threads than it has cores, and a critical (decode) slot's claim is
reserved: prefill steps take turns on the other cores while it has work."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from yuebing.instance import cores
from yuebing.instance.cores import SLOTS, CoreLedger

PEER = """
import sys
from pathlib import Path
from yuebing.instance.cores import CoreLedger
ledger = CoreLedger(int(sys.argv[2]), Path(sys.argv[1]), critical=sys.argv[4] == "1")
ledger.cores = int(sys.argv[3])
for line in sys.stdin:
    what = line.strip()
    if what == "step":
        print(ledger.acquire(), flush=True)
        continue
    if what == "end":
        ledger.release(idle=False)
    elif what == "idle":
        ledger.release(idle=True)
    elif what == "close":
        ledger.close()
    print("ok", flush=True)
"""


class Peer:
    """Another instance's ledger, in its own process (the ledger ignores its own pid's slots
    only through the pid: a subprocess is a real other instance)."""

    def __init__(self, path: Path, threads: int, host_cores: int = 4,
                 critical: bool = False) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PEER, str(path), str(threads),
                                      str(host_cores), str(int(critical))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def say(self, what: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_steps_borrow_unclaimed_cores(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    me = CoreLedger(1, path)
    me.cores = 4  # as on a 4-core host, whatever this one has
    a, b = Peer(path, 1), Peer(path, 2)
    try:
        assert me.threads_now() == 4  # what a load report says a step would get now
        assert me.acquire() == 4  # both others idle: every core
        me.release(idle=False)
        assert a.say("step") == "3"  # I claim 1 (busy between steps): a takes the other 3
        assert a.say("end") == "ok"
        assert me.threads_now() == 3  # a claims 1 (busy)
        me.release(idle=True)
        assert b.say("step") == "3"  # a still claims 1 (busy), I am idle
        assert me.threads_now() == 1  # a claims 1 and b steps on 3: only my own
        assert b.say("end") == "ok"
        assert me.acquire(borrow=False) == 1
        me.release(idle=False)
        b.say("idle")
        a.say("idle")
        a.kill()  # a killed process claims nothing, and its slot is reclaimed
        assert me.acquire() == 4
        me.release(idle=True)
        again = Peer(path, 1)
        try:
            assert again.say("step") == "4"
        finally:
            again.kill()
    finally:
        for p in (a, b):
            p.kill()
        me.close()


def test_a_claimer_waits_for_the_borrowers_step(tmp_path: Path) -> None:
    """The lender gets work while the borrower steps with both cores: it waits for that step
    to end, and the borrower's next step leaves it its core."""
    path = tmp_path / "ledger"
    lender = CoreLedger(1, path)
    lender.cores = 2
    borrower = Peer(path, 1, host_cores=2)
    try:
        lender.release(idle=True)
        assert borrower.say("step") == "2"  # the lender is idle: both cores
        got: list[tuple[int, float]] = []
        t = threading.Thread(target=lambda: got.append((lender.acquire(), time.monotonic())))
        t.start()
        time.sleep(0.3)  # the lender's claim does not end the borrower's step
        assert not got  # still waiting: the borrower's step holds both cores
        ended = time.monotonic()
        assert borrower.say("end") == "ok"
        t.join(5)
        assert got and got[0][0] == 1 and got[0][1] >= ended
        assert borrower.say("step") == "1"  # the lender's claim stands: one core each
    finally:
        borrower.kill()
        lender.close()


def test_a_stuck_borrower_delays_a_claimer_at_most_wait_max(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cores, "WAIT_MAX_S", 0.2)
    path = tmp_path / "ledger"
    lender = CoreLedger(1, path)
    lender.cores = 2
    borrower = Peer(path, 2, host_cores=2)
    try:
        assert borrower.say("step") == "2"  # and never ends it
        t0 = time.monotonic()
        assert lender.acquire() == 1
        assert 0.2 <= time.monotonic() - t0 < 2.0
    finally:
        borrower.kill()
        lender.close()


def test_slots_are_never_shared(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    first = CoreLedger(1, path)
    second = CoreLedger(1, path)  # a second ledger of one process takes another slot
    assert second.slot != first.slot
    first.close()
    third = CoreLedger(1, path)  # a closed slot is free again
    assert third.slot == first.slot
    assert path.stat().st_size >= SLOTS * 40
    assert f"-v{cores.LAYOUT}-" in cores.ledger_path().name
    second.close()
    third.close()


class Stepper:
    """An `acquire` in a thread of its own (it may wait): its threads and when it returned."""

    def __init__(self, ledger: CoreLedger) -> None:
        self.got: list[tuple[int, float]] = []
        self.thread = threading.Thread(
            target=lambda: self.got.append((ledger.acquire(), time.monotonic())))
        self.thread.start()

    def waits(self, for_s: float = 0.3) -> bool:
        self.thread.join(for_s)
        return self.thread.is_alive() and not self.got

    def threads(self, timeout_s: float = 5.0) -> int:
        self.thread.join(timeout_s)
        assert self.got, "the step never started"
        return self.got[0][0]


def _host(path: Path) -> tuple[CoreLedger, CoreLedger, CoreLedger]:
    """2P1D on 2 cores, one thread each: (decode, prefill a, prefill b), all idle."""
    ledgers = (CoreLedger(1, path, cores=2, critical=True), CoreLedger(1, path, cores=2),
               CoreLedger(1, path, cores=2))
    for ledger in ledgers:
        ledger.release(idle=True)
    return ledgers


def test_a_decodes_claim_is_reserved_and_the_prefills_take_turns(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """Main's rule let the second prefill step beside the first (1 + 1 threads in use on 2
    cores) and the decode then waited for a chunk end: here the second waits for its turn."""
    monkeypatch.setattr(cores, "WAIT_MAX_S", 30.0)
    decode, a, b = _host(tmp_path / "ledger")
    try:
        assert decode.acquire() == 2  # both prefills idle: the decode borrows their cores
        decode.release(idle=False)  # it has work, between steps: its claim stands
        assert a.acquire() == 1  # the core left; borrowing never takes the decode's claim
        second = Stepper(b)
        assert second.waits()  # a's step and the decode's claim fill the host
        t0 = time.monotonic()
        assert decode.acquire() == 1  # the decode never waits behind a prefill chunk
        assert time.monotonic() - t0 < 0.2
        decode.release(idle=False)
        a.release(idle=False)
        again = Stepper(a)  # a's next chunk: b has waited longer, so b goes first
        assert second.threads() == 1 and again.waits()
        b.release(idle=False)
        assert again.threads() == 1
        assert again.got[0][1] >= second.got[0][1]
        decode.release(idle=True)  # the decode idle: both prefills step at once
        a.release(idle=False)
        assert a.acquire() == 1 and b.acquire() == 1
        b.release(idle=True)
        a.release(idle=False)
        assert a.acquire() == 2  # and one alone borrows every core
    finally:
        for ledger in (decode, a, b):
            ledger.close()


def test_a_prefill_is_not_starved_when_critical_claims_fill_the_host(tmp_path: Path,
                                                                     monkeypatch) -> None:
    """1P2D on 2 cores: the decodes' claims would take every core; the reservation leaves the
    prefill one, so it steps while they are between steps, and waits only for room."""
    monkeypatch.setattr(cores, "WAIT_MAX_S", 30.0)
    path = tmp_path / "ledger"
    d1, d2 = CoreLedger(1, path, cores=2, critical=True), CoreLedger(1, path, cores=2,
                                                                       critical=True)
    prefill = CoreLedger(1, path, cores=2)
    try:
        assert d1.acquire() == 2  # the others idle
        d1.release(idle=False)
        assert d2.acquire() == 1  # d1's claim: a core each
        d2.release(idle=False)
        t0 = time.monotonic()
        assert prefill.acquire() == 1
        assert time.monotonic() - t0 < 0.2
        prefill.release(idle=False)
        assert d1.acquire() == 1  # d1 steps, d2 between steps: the prefill still gets a core
        t0 = time.monotonic()
        assert prefill.acquire() == 1
        assert time.monotonic() - t0 < 0.2
        late = Stepper(d2)  # the host full: a critical step waits for room, as before
        assert late.waits()
        prefill.release(idle=False)
        assert late.threads() == 1
    finally:
        for ledger in (d1, d2, prefill):
            ledger.close()


def test_a_dead_decodes_claim_reserves_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cores, "WAIT_MAX_S", 30.0)
    path = tmp_path / "ledger"
    decode = Peer(path, 1, host_cores=2, critical=True)
    a, b = CoreLedger(1, path, cores=2), CoreLedger(1, path, cores=2)
    try:
        assert decode.say("step") == "2" and decode.say("end") == "ok"  # a claim between steps
        assert a.acquire() == 1
        waiting = Stepper(b)
        assert waiting.waits()
        decode.kill()  # killed with its claim in the ledger
        assert waiting.threads() == 1  # a dead slot's claim is no reservation
    finally:
        decode.kill()
        a.close()
        b.close()


def test_a_stuck_prefill_delays_the_others_turn_at_most_wait_max(tmp_path: Path,
                                                                 monkeypatch) -> None:
    monkeypatch.setattr(cores, "WAIT_MAX_S", 0.2)
    decode, a, b = _host(tmp_path / "ledger")
    try:
        decode.acquire()
        decode.release(idle=False)
        assert a.acquire() == 1  # and never ends its step
        t0 = time.monotonic()
        assert b.acquire() == 1
        assert 0.2 <= time.monotonic() - t0 < 2.0
    finally:
        for ledger in (decode, a, b):
            ledger.close()
