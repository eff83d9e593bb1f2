"""Start a master and a storage node as child processes of the store benchmark (loopback only);
each is stopped through the handle that started it (`yuebing.ops.procs.ReadyProcess`).
``yuebing bench instance`` starts its processes as `Child` too."""

from __future__ import annotations

from yuebing.ops.procs import ReadyProcess, yuebing_argv


class Child(ReadyProcess):
    """A ``yuebing <args>`` child process of a benchmark; ``info`` is the JSON it wrote to its
    ready file, its output is in ``dir``."""

    def __init__(self, args: list[str], timeout_s: float = 60.0) -> None:
        super().__init__(yuebing_argv(args), name="-".join(args[:2]) or "yuebing",
                         timeout_s=timeout_s)


def start_master(*extra: str) -> Child:
    return Child(["store", "master", "--rpc-address", "tcp://127.0.0.1:0", *extra])


def start_node(master: str, dram: str, *extra: str) -> Child:
    return Child(["store", "node", "--master", master, "--dram", dram, "--name", "bench-node",
                  *extra])
