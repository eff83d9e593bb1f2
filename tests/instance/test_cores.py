"""`CoreLedger`: an idle instance's threads go to the busy ones of its host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from yuebing.instance.cores import SLOTS, CoreLedger

PEER = """
import sys, time
from pathlib import Path
from yuebing.instance.cores import CoreLedger
ledger = CoreLedger(int(sys.argv[2]), Path(sys.argv[1]))
for line in sys.stdin:
    if line.strip() == "busy":
        ledger.set_busy(True)
    elif line.strip() == "idle":
        ledger.set_busy(False)
    elif line.strip() == "close":
        ledger.close()
    print("ok", flush=True)
"""


class Peer:
    def __init__(self, path: Path, threads: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PEER, str(path), str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.say("idle")

    def say(self, what: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_borrows_idle_peers_threads_up_to_its_cores(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    me = CoreLedger(1, path)
    me.cores = 4  # as on a 4-core host, whatever this one has
    assert me.threads_now() == 1  # alone
    a, b = Peer(path, 1), Peer(path, 2)
    try:
        assert me.threads_now() == 4  # 1 + 1 + 2 idle
        a.say("busy")
        assert me.threads_now() == 3
        b.say("busy")
        assert me.threads_now() == 1
        b.say("idle")
        me.cores = 2
        assert me.threads_now() == 2  # capped at this process's cores
        b.say("close")  # a closed slot lends nothing
        me.cores = 4
        assert me.threads_now() == 1
        a.say("idle")
        a.kill()  # a killed process's slot lends nothing, and is reclaimed
        assert me.threads_now() == 1
        again = Peer(path, 1)
        try:
            assert me.threads_now() == 2
        finally:
            again.kill()
    finally:
        a.kill()
        b.kill()
        me.close()


def test_slots_are_never_shared(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    first = CoreLedger(1, path)
    second = CoreLedger(1, path)  # a second ledger of one process takes another slot
    assert second.slot != first.slot
    first.set_busy(True)
    first.close()
    third = CoreLedger(1, path)  # a closed slot is free again
    assert third.slot == first.slot
    assert path.stat().st_size >= SLOTS * 24
    second.close()
    third.close()
