"""The raw socket RPC reference of the benchmarks (`yuebing.transfer.rawsock`): its calls move
the bytes they claim to, and `interleave` alternates rounds and reports their spread."""

from __future__ import annotations

import numpy as np

from yuebing.transfer.rawsock import RawClient, RawServer, interleave, rpc_loop


def test_put_lands_and_get_brings_back_the_bytes() -> None:
    server = RawServer(1 << 20)
    try:
        client = RawClient(server.port)
        try:
            src = np.arange(4 << 10, dtype=np.uint8)
            client.put(memoryview(src), 8192)
            back = np.zeros(4 << 10, dtype=np.uint8)
            client.get(memoryview(back), 8192)
            assert np.array_equal(back, src)
            views = [memoryview(np.zeros(4096, dtype=np.uint8)) for _ in range(3)]
            lat, took = rpc_loop(client, "get", views, 0.0, min_calls=5)
            assert len(lat) == 5 and took >= sum(lat) > 0
            assert np.array_equal(np.asarray(views[2]), src[:4096])  # offset 2 × 4096 = 8192
        finally:
            client.close()
    finally:
        server.close()
    assert server.proc.returncode is not None


def test_interleave_alternates_and_reports_the_spread() -> None:
    order: list[str] = []
    rates_a = iter([2.0, 4.0, 6.0])

    def a() -> float:
        order.append("a")
        return next(rates_a)

    def b() -> float:
        order.append("b")
        return 2.0

    res = interleave(a, b, 3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert (res.a, res.b, res.ratio, res.ratio_min, res.ratio_max) == (4.0, 2.0, 2.0, 1.0, 3.0)
