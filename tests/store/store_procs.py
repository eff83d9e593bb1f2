"""Test helpers: real master and node processes on 127.0.0.1 (started via the CLI, `cli_procs`),
stopped by the handle that started them; `store_cluster` starts a master and its nodes and stops
them all."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from cli_procs import CliProc
from yuebing.ops.shm import sweep
from yuebing.transfer.liveness import DEFAULT_SHM_DIR, SHM_PREFIX


class Proc(CliProc):
    """A ``yuebing store ...`` process; ``info`` is what it wrote to its ready file, its output
    is on ``proc.stdout`` (read by tests that check what it logged; 60 s to get ready: a loaded
    2-core VM can take tens of seconds to start a Python process)."""

    def __init__(self, args: list[str]) -> None:
        super().__init__(args, name="store", pipe=True, timeout_s=60.0, stop_s=10.0)

    def kill(self) -> None:
        """SIGKILL, then the shared-memory segment files of its transfer engine (only a clean
        exit unlinks them)."""
        super().kill()
        self.sweep()

    def stop(self) -> None:
        """`CliProc.stop`; for a process killed earlier, its segment files that a client still
        mapped when it was killed go now."""
        super().stop()
        self.sweep()

    def sweep(self) -> None:
        """Unlink its segment files that no living process maps (`ops.shm.sweep`)."""
        sweep(Path(DEFAULT_SHM_DIR).glob(f"{SHM_PREFIX}{self.proc.pid}-*"))


def master(*extra: str) -> Proc:
    return Proc(["store", "master", "--rpc-address", "tcp://127.0.0.1:0", "--tick-s", "0.05",
                 *extra])


def node(master_addr: str, dram: str = "16MiB", *extra: str) -> Proc:
    return Proc(["store", "node", "--master", master_addr, "--dram", dram, "--heartbeat-s",
                 "0.2", *extra])


@contextlib.contextmanager
def store_cluster(*names: str, dram: str = "16MiB", master_args: Sequence[str] = (),
                  node_args: Sequence[str] = ()) -> Iterator[list[Proc]]:
    """A master (`master` with ``master_args``) and a node per name in ``names`` (`node` with
    ``dram``, ``--name``, ``node_args``): ``[master, *nodes]``. Every process it started is
    stopped when the block ends, the nodes before the master, also when a later one fails to
    start."""
    with contextlib.ExitStack() as stack:
        mst = master(*master_args)
        stack.callback(mst.stop)
        procs = [mst]
        for name in names:
            procs.append(node(mst.info["address"], dram, "--name", name, *node_args))
            stack.callback(procs[-1].stop)
        yield procs


def wait_leader(etcd_url: str, cluster: str, master: Proc, timeout_s: float = 20.0) -> None:
    """Until ``master`` holds the store's election key in etcd (it leads)."""
    from yuebing.cluster.discovery import Discovery

    disc, end = Discovery(etcd_url, cluster), time.monotonic() + timeout_s
    while disc.store_master() != master.info["address"]:
        assert time.monotonic() < end, f"{master.info['address']} did not win the election"
        time.sleep(0.05)


def leader_of(etcd_url: str, cluster: str, masters: list[Proc], timeout_s: float = 20.0) -> Proc:
    """The one of ``masters`` that holds the store's election key in etcd now (waits while none
    does: an election in progress)."""
    from yuebing.cluster.discovery import Discovery

    disc, end = Discovery(etcd_url, cluster), time.monotonic() + timeout_s
    while True:
        named = disc.store_master()
        found = [p for p in masters if p.info["address"] == named]
        if found:
            return found[0]
        assert time.monotonic() < end, f"none of the masters leads (the key names {named!r})"
        time.sleep(0.05)
