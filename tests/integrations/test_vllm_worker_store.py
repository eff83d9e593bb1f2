"""The vLLM connector's worker half against a real yuebing store (master and node processes on
loopback), without vLLM: saves put whole store objects, loads copy them into other paged
tensors bit for bit, and a missing, wrong-sized or unreachable object is reported for
recompute and never copied."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from yuebing.integrations.vllm.layout import KvLayout
from yuebing.integrations.vllm.plan import LoadJob, SaveJob
from yuebing.integrations.vllm.worker import WorkerSide, layer_order
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "store"))
import store_procs  # noqa: E402

LAYOUT = KvLayout(model="tiny", dtype="float32", layers=2, kv_heads=2, head_size=4,
                  block_tokens=4, store_block_tokens=8)
NAMES = ["model.layers.1.self_attn.attn", "model.layers.0.self_attn.attn"]


@pytest.fixture(scope="module")
def master():
    with store_procs.store_cluster("vllmw", dram="32MiB") as (m, _):
        yield m.info["address"]


def client(addr: str) -> StoreClient:
    return StoreClient(ClientConfig(master=addr), heartbeat=False)


def paged(fill: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    make = (lambda: torch.randn(10, *LAYOUT.block_shape, generator=g)) if fill else (
        lambda: torch.zeros(10, *LAYOUT.block_shape))
    return {n: make() for n in NAMES}


def worker(addr: str, kv: dict[str, torch.Tensor]) -> WorkerSide:
    w = WorkerSide(LAYOUT, client(addr), client(addr), load_timeout_s=5.0)
    w.register(kv)
    return w


def save(w: WorkerSide, kv: dict[str, torch.Tensor], jobs: list[SaveJob]) -> None:
    for name in layer_order(list(kv)):
        w.save_layer(name, kv[name], jobs)
    w.end_step()
    w.flush()


def load(w: WorkerSide, jobs: list[LoadJob]) -> set[int]:
    w.start_load(jobs)
    for name in layer_order(list(w.kv)):
        w.wait_layer(name)
    w.end_load()
    return w.load_errors()


def test_layers_are_ordered_by_their_index():
    assert layer_order(["a.10.x", "a.2.x", "a.0.x"]) == ["a.0.x", "a.2.x", "a.10.x"]


def test_saved_objects_load_bit_for_bit_into_other_blocks(master):
    keys = LAYOUT.store_keys(list(range(100, 120)))
    src = paged(True)
    a = worker(master, src)
    save(a, src, [SaveJob("r", keys[0], (3, 5)), SaveJob("r", keys[1], (6, 1))])
    assert a.stats["saved_objects"] == 2
    with client(master) as c:
        assert c.prefix_match(keys) == 2
    dst = paged(False)
    b = worker(master, dst)
    job = LoadJob("r", tuple(keys), ((0, 0, 0), (0, 1, 2), (1, 0, 4), (1, 1, 9)))
    assert load(b, [job]) == set()
    for name in NAMES:
        for s, d in ((3, 0), (5, 2), (6, 4), (1, 9)):
            assert torch.equal(dst[name][d], src[name][s])
        assert not dst[name][1].any()
    a.close()
    b.close()


def test_a_missing_object_and_every_later_one_are_recomputed_not_copied(master):
    keys = LAYOUT.store_keys(list(range(200, 224)))
    src = paged(True)
    a = worker(master, src)
    save(a, src, [SaveJob("r", keys[0], (1, 2)), SaveJob("r", keys[2], (3, 4))])
    dst = paged(False)
    b = worker(master, dst)
    job = LoadJob("r", tuple(keys), ((0, 0, 5), (0, 1, 6), (1, 0, 7), (1, 1, 8), (2, 0, 9)))
    assert load(b, [job]) == {7, 8, 9}
    assert torch.equal(dst[NAMES[0]][5], src[NAMES[0]][1])
    assert not dst[NAMES[0]][7:].any()
    a.close()
    b.close()


def test_an_object_of_another_size_is_refused(master):
    key = LAYOUT.store_keys(list(range(300, 308)))[0]
    with client(master) as c:
        c.put(key, bytes(LAYOUT.object_bytes // 2))
    dst = paged(False)
    b = worker(master, dst)
    assert load(b, [LoadJob("r", (key,), ((0, 0, 1), (0, 1, 2)))]) == {1, 2}
    assert not dst[NAMES[0]].any()
    b.close()


class _Silent:
    """A store client whose master does not answer."""

    def limited(self, s):
        raise TimeoutError("no answer from the master")

    def close(self):
        pass


def test_a_store_that_does_not_answer_is_a_recompute_and_a_dropped_save():
    kv = paged(True)
    w = WorkerSide(LAYOUT, _Silent(), _Silent())
    w.register(kv)
    assert load(w, [LoadJob("r", ("kv/x/0000000000000001",), ((0, 0, 3),))]) == {3}
    save(w, kv, [SaveJob("r", "kv/x/0000000000000001", (1, 2))])
    assert w.stats["save_failures"] == 1 and w._pending_bytes == 0
    w.close()


def test_tensors_of_another_geometry_are_refused_naming_both():
    w = WorkerSide(LAYOUT, None, None)
    with pytest.raises(ValueError, match=r"has blocks of shape \(2, 4, 4\).*expects \(2, 4, 8\)"):
        w.register({n: torch.zeros(4, 2, 4, 4) for n in NAMES})
    with pytest.raises(ValueError, match="vLLM has 1 KV layers.*layout has 2"):
        w.register({NAMES[0]: torch.zeros(4, *LAYOUT.block_shape)})
    with pytest.raises(ValueError, match="is torch.float16, the yuebing connector expects"):
        w.register({n: torch.zeros(4, *LAYOUT.block_shape, dtype=torch.float16) for n in NAMES})
    w.close()
