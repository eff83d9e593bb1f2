"""etcd as a fault target (issue 16), under the steady load of `faultrig.Load`.

The cluster depends on etcd as ``yuebing serve --etcd`` makes it: the store master serves only
while it holds its leader lease in etcd (``--etcd``; it steps down when it cannot refresh
it), the instances publish themselves there and the Conductor finds them there (no
``--instances``). Faults: ``kill -9`` of etcd, 10 s down, then restarted at its address with
its data (as an operator would; slow) or without it (``wipe``: its data was lost, every key
and lease is gone; slow), and ``SIGSTOP`` for 10 s then ``SIGCONT``.

Checked, besides `faultcheck.fault_under_load`'s checks (deadlines, reference outputs,
recovery, levels back): every request of the load succeeded — while etcd was out (the
instances the Conductor already knew serve on; the store master stepped down, so loads and
saves of the KV pool are skipped) and after it came back — an instance started while etcd
was out joins once etcd is back (its registration is retried, not lost), an instance started
after it is back joins too, and the store master is elected again.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from faultcheck import Baseline, Fault, fault_under_load
from faultrig import Outcome, Rig

from etcd_util import EtcdServer, find_etcd
from yuebing.cluster.discovery import Discovery

pytestmark = [pytest.mark.etcd,
              pytest.mark.skipif(find_etcd() is None, reason="etcd binary not installed "
                                 "(scripts/install_test_servers.sh)")]

OUT_S = 10.0
"""How long etcd is out: longer than the instances' discovery lease (5 s) and the store
master's leader lease (3 s)."""


@dataclass
class EtcdRig:
    base: Baseline
    etcd: EtcdServer


@pytest.fixture(scope="module")
def state() -> Iterator[EtcdRig]:
    etcd = EtcdServer().start()
    try:
        rig = Rig(etcd=etcd.url)
        try:
            yield EtcdRig(Baseline(rig), etcd)
        finally:
            rig.stop()
    finally:
        etcd.stop()


def _fault(s: EtcdRig, kind: str, late: list[str]) -> Fault:
    """``kill`` (then restart with its data), ``wipe`` (restart empty) or ``stop``; half of
    ``OUT_S`` into the outage a new instance is started in the background (its name lands
    in ``late``)."""
    etcd, rig = s.etcd, s.base.rig

    def inject() -> None:
        if kind in ("kill", "wipe"):
            etcd.kill(lose_data=kind == "wipe")
        else:
            assert etcd.proc is not None
            etcd.proc.send_signal(signal.SIGSTOP)

    def end() -> None:
        time.sleep(OUT_S / 2)  # etcd stays out this long
        starter = threading.Thread(target=lambda: late.append(rig.add_instance("prefill")),
                                   daemon=True)
        starter.start()
        time.sleep(OUT_S / 2)  # the second half of the outage
        if kind in ("kill", "wipe"):
            etcd.start()
        else:
            assert etcd.proc is not None
            etcd.proc.send_signal(signal.SIGCONT)
        starter.join(rig.timeout_s)

    return Fault(inject, end)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["stop", *(pytest.param(k, marks=pytest.mark.slow)
                                             for k in ("kill", "wipe"))])
def test_etcd_fault_under_load(state: EtcdRig, kind: str) -> None:
    rig = state.base.rig
    late: list[str] = []

    def after() -> None:
        disc = Discovery(state.etcd.url, rig.cluster)
        end = time.monotonic() + 30
        while disc.store_master() != rig.master:  # the store master leads again
            assert time.monotonic() < end, "the store master was not elected again"
            time.sleep(0.2)
        assert late, "an instance started while etcd was out did not get ready"
        rig.wait_joined()  # the one started in the outage joined once etcd was back
        name = rig.add_instance("decode")  # a registration after etcd is back
        rig.wait_joined()
        for n in (name, *late):
            rig.remove_instance(n)
        rig.wait_joined()  # the Conductor let go of them (they left discovery)

    row = fault_under_load(state.base, "etcd", f"{kind}{OUT_S:.0f}", _fault(state, kind, late),
                           allowed=frozenset({Outcome.OK}), after=after)
    assert row["during"].get("OK", 0) > 0, row  # served while etcd was out
