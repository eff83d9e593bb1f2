"""`CoreLedger`: steps borrow unclaimed cores, a claimer waits for the borrower's step, and the
host never runs more step threads than it has cores."""

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
ledger = CoreLedger(int(sys.argv[2]), Path(sys.argv[1]))
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

    def __init__(self, path: Path, threads: int, host_cores: int = 4) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PEER, str(path), str(threads),
                                      str(host_cores)],
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
        assert me.acquire() == 4  # both others idle: every core
        me.release(idle=False)
        assert a.say("step") == "3"  # I claim 1 (busy between steps): a takes the other 3
        assert a.say("end") == "ok"
        me.release(idle=True)
        assert b.say("step") == "3"  # a still claims 1 (busy), I am idle
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
    assert path.stat().st_size >= SLOTS * 28
    second.close()
    third.close()
