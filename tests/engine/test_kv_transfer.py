"""KV export/import: whole blocks, whole requests (prefill engine → fresh decode engine),
prefix blocks (store → prefix cache) and layer-by-layer streaming through hooks."""

from __future__ import annotations

import pytest
import torch
from engine_factories import make_engine, prompts

from yuebing.core.errors import EngineError, InputError
from yuebing.engine.kv_transfer import (
    LayerStreamer,
    RequestKV,
    export_prefix,
    export_request,
    import_prefix,
    import_request,
)
from yuebing.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0)


def _prefill_one(engine, prompt):
    """Run until the request produced its first token; return (request id, first output)."""
    rid = engine.add_request(prompt, GREEDY)
    while True:
        for out in engine.step():
            if out.request_id == rid:
                return rid, out


def test_block_export_import_roundtrip_is_exact(tiny_weights):
    a = make_engine(tiny_weights)
    a.pool.data.normal_()
    buf = a.pool.export_blocks([5, 2, 9])
    assert buf.is_contiguous() and tuple(buf.shape) == (3, *a.pool.block_shape)
    assert buf.numel() * buf.element_size() == 3 * a.pool.block_nbytes
    b = make_engine(tiny_weights)
    b.pool.import_blocks([0, 1, 7], buf)
    for src, dst in ((5, 0), (2, 1), (9, 7)):
        assert torch.equal(a.pool.data[:, :, src], b.pool.data[:, :, dst])
    view = a.pool.export_layer(1, [3, 4, 5])
    assert view.data_ptr() == a.pool.data[1, :, 3].data_ptr()  # consecutive → zero-copy view
    assert torch.equal(a.pool.export_layer(1, [5, 3]), a.pool.data[1][:, [5, 3]])


def test_request_kv_continues_in_fresh_engine(tiny_weights):
    p = prompts(1, seed=11, lo=21, hi=22)[0]
    ref = make_engine(tiny_weights).generate([p], GREEDY)[0].output_token_ids
    prefill = make_engine(tiny_weights)
    rid, first = _prefill_one(prefill, p)
    kv = export_request(prefill, rid)
    assert (kv.num_tokens, kv.token_ids, kv.data.shape[0]) == (21, p + first.new_token_ids, 6)
    decode = make_engine(tiny_weights, num_blocks=16)
    new = import_request(decode, kv, GREEDY, prompt_len=len(p))
    outs = []
    while decode.has_unfinished():
        outs += [o for o in decode.step() if o.finished]
    assert outs[0].request_id == new and outs[0].output_token_ids == ref
    assert outs[0].num_cached_tokens == 21


def test_import_rejects_foreign_or_malformed_kv(tiny_weights):
    engine = make_engine(tiny_weights)
    shape = (2, *engine.pool.block_shape)
    good = RequestKV(list(range(9)), 8, 4, engine.fingerprint, torch.zeros(shape))
    with pytest.raises(InputError, match="computed by model"):
        import_request(engine, RequestKV(good.token_ids, 8, 4, "other:1", good.data), GREEDY)
    with pytest.raises(InputError, match="block size"):
        import_request(engine, RequestKV(good.token_ids, 8, 8, engine.fingerprint, good.data),
                       GREEDY)
    with pytest.raises(InputError, match="last token"):
        import_request(engine, RequestKV(good.token_ids, 9, 4, engine.fingerprint, good.data),
                       GREEDY)
    with pytest.raises(InputError, match="buffer shape"):
        import_request(engine, RequestKV(good.token_ids, 8, 4, engine.fingerprint,
                                         torch.zeros(1, *shape[1:])), GREEDY)
    assert engine.allocator.num_free == engine.allocator.num_blocks
    assert not engine.has_unfinished()


def test_failed_import_changes_nothing(tiny_weights):
    engine = make_engine(tiny_weights)
    shape = (2, *engine.pool.block_shape)
    kv = RequestKV(list(range(9)), 8, 4, engine.fingerprint, torch.zeros(shape))
    rid = import_request(engine, kv, GREEDY, request_id="a")
    free = engine.allocator.num_free
    assert free == engine.allocator.num_blocks - 2
    with pytest.raises(InputError, match="request id 'a' is already in use"):
        import_request(engine, kv, GREEDY, request_id="a")
    with pytest.raises(InputError, match="params must be a SamplingParams"):
        import_request(engine, kv, "greedy", request_id="b")  # type: ignore[arg-type]
    assert engine.allocator.num_free == free and engine.get_sequence("b") is None
    small = make_engine(tiny_weights, num_blocks=3)
    import_request(small, kv, GREEDY, request_id="x")
    with pytest.raises(EngineError, match="KV cache has 1 free blocks, the imported request "
                                          "needs 2"):
        import_request(small, kv, GREEDY, request_id="c")
    assert small.allocator.num_free == 1 and small.get_sequence("c") is None
    assert [o.request_id for _ in range(20) for o in engine.step() if o.finished] == [rid]
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_prefix_blocks_move_between_engines(tiny_weights):
    p = prompts(1, seed=12, lo=26, hi=27)[0]
    ref = make_engine(tiny_weights).generate([p], GREEDY)[0].output_token_ids
    a = make_engine(tiny_weights)
    a.generate([p], GREEDY)
    keys, data = export_prefix(a, p)
    assert keys == a.block_keys(p)[:6] and data.shape[0] == 6
    b = make_engine(tiny_weights)
    assert import_prefix(b, p, data, a.fingerprint) == 6
    assert import_prefix(b, p, data, a.fingerprint) == 0
    out = b.generate([p], GREEDY)[0]
    assert out.num_cached_tokens == 24 and out.output_token_ids == ref


def test_prefix_import_keeps_present_blocks_and_refuses_when_full(tiny_weights):
    p = prompts(1, seed=12, lo=26, hi=27)[0]
    a = make_engine(tiny_weights)
    a.generate([p], GREEDY)
    _, data = export_prefix(a, p)
    b = make_engine(tiny_weights, num_blocks=7)  # room for exactly 6 cached + 1
    assert import_prefix(b, p, data[:2], a.fingerprint) == 2
    present = [b.allocator.lookup(k, p[i * 4:(i + 1) * 4]) for i, k in
               enumerate(b.block_keys(p)[:2])]
    # a second import adds only the 4 missing blocks and keeps the present ones
    assert import_prefix(b, p, data, a.fingerprint) == 4
    assert [b.allocator.lookup(k, p[i * 4:(i + 1) * 4]) for i, k in
            enumerate(b.block_keys(p)[:2])] == present
    assert b.allocator.num_cached == 6 and b.allocator.num_free == 7
    c = make_engine(tiny_weights, num_blocks=7)
    assert import_prefix(c, p, data[:2], a.fingerprint) == 2
    blocker = c.allocator.allocate_many(3)  # 4 free, 2 of them the cached prefix
    # before the fix the 4th missing block evicted the present first block
    with pytest.raises(EngineError, match="KV cache has 2 free blocks, the prefix needs 4"):
        import_prefix(c, p, data, a.fingerprint)
    assert c.allocator.num_cached == 2 and c.allocator.num_free == 4
    assert import_prefix(c, p, data[:2], a.fingerprint) == 0  # both still cached
    c.allocator.release_all(blocker)


def test_layer_streamer_ships_every_layer_during_prefill(tiny_weights):
    p = prompts(1, seed=13, lo=18, hi=19)[0]
    ref = make_engine(tiny_weights).generate([p], GREEDY)[0].output_token_ids
    prefill = make_engine(tiny_weights, max_batch_tokens=8, max_num_seqs=4)  # 3 chunks
    got: dict[tuple[int, int], torch.Tensor] = {}
    calls: list[int] = []

    def sink(rid, layer, blocks, kv):
        calls.append(layer)
        for j, b in enumerate(blocks):
            got[(layer, b)] = kv[:, j].clone()

    streamer = LayerStreamer(prefill, sink)
    rid = prefill.add_request(p, GREEDY)
    streamer.watch(rid)
    while prefill.get_sequence(rid).num_computed < len(p):
        prefill.step()
    streamer.close()
    assert calls == [0, 1] * 3
    seq = prefill.get_sequence(rid)
    blocks = seq.blocks[:5]
    data = torch.stack([torch.stack([got[(layer, b)] for layer in range(2)]) for b in blocks])
    kv = RequestKV(seq.all_ids, len(p), 4, prefill.fingerprint, data)
    decode = make_engine(tiny_weights)
    import_request(decode, kv, GREEDY, prompt_len=len(p))
    out = [o for _ in range(12) for o in decode.step() if o.finished]
    assert out[0].output_token_ids == ref
