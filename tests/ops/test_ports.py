"""`yuebing.ops.ports`: launchers' ports come from outside the ephemeral range and are free."""
from __future__ import annotations

import random
import socket
from pathlib import Path

from yuebing.ops import ports


def test_the_range_file_is_read_and_a_bad_one_gives_the_linux_default(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(f) == (40000, 50000)
    for bad in ("", "x y", "50000 40000", "0 70000"):
        f.write_text(bad)
        assert ports.ephemeral_range(f) == ports.LINUX_EPHEMERAL
    assert ports.ephemeral_range(tmp_path / "absent") == ports.LINUX_EPHEMERAL


def test_outside_leaves_out_the_ephemeral_range_and_the_low_ports() -> None:
    assert ports.outside(32768, 60999) == [range(10000, 32768), range(61000, 65536)]
    assert ports.outside(1024, 65535) == []
    assert ports.outside(1024, 20000) == [range(20001, 65536)]


def test_free_port_is_outside_the_kernels_ephemeral_range_and_bindable() -> None:
    lo, hi = ports.ephemeral_range()
    for _ in range(20):
        port = ports.free_port("127.0.0.1")
        assert ports.LOWEST <= port <= 65535 and not lo <= port <= hi
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: a listener can take it


def test_a_taken_port_is_skipped() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert not ports.is_free("127.0.0.1", taken)
        free = next(p for p in range(taken + 1, 65536) if ports.is_free("127.0.0.1", p))
        # the draws: first the taken port, then the free one
        got = ports.free_port("127.0.0.1", ranges=[range(taken, taken + 1), range(free, free + 1)],
                              rng=_Draws([0, 1]))
        assert got == free


def test_no_free_draw_falls_back_to_the_kernels_choice() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        port = ports.free_port("127.0.0.1", ranges=[range(taken, taken + 1)])
        assert port != taken and ports.is_free("127.0.0.1", port)
    assert ports.free_port("127.0.0.1", ranges=[]) > 0


class _Draws(random.Random):
    """`randrange` answers the given indexes in turn."""

    def __init__(self, draws: list[int]) -> None:
        super().__init__(0)
        self.draws = iter(draws)

    def randrange(self, *args: object, **kwargs: object) -> int:
        return next(self.draws)
