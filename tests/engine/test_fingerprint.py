"""The KV fingerprint names the KV bytes: weights' content, dtype and block geometry.

Two checkpoints that differ only in content (same names, same sizes) must never share KV, and
KV of unknown origin is refused."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_factories import build_hf_model, make_engine, prompts

from yuebing.core.errors import InputError
from yuebing.engine.kv_transfer import export_prefix, import_prefix
from yuebing.engine.weights import load_weights

GREEDY_TOKENS = 4


def _perturbed_copy(src, dst):
    """Same files, same sizes, one weight changed in place."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    f = sorted(dst.glob("*.safetensors"))[0]
    tensors = load_file(str(f))
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


def test_equal_names_and_sizes_but_other_weights_get_other_fingerprints(tmp_path):
    a = build_hf_model(tmp_path / "a" / "model")
    b = _perturbed_copy(a, tmp_path / "b" / "model")
    assert [f.stat().st_size for f in sorted(a.iterdir())] == \
        [f.stat().st_size for f in sorted(b.iterdir())]
    wa, wb = load_weights(str(a)), load_weights(str(b))
    assert wa.fingerprint != wb.fingerprint
    ea = make_engine(wa, model=str(a))
    eb = make_engine(wb, model=str(b))
    assert ea.fingerprint != eb.fingerprint
    p = prompts(1, vocab=wa.config.vocab_size, seed=2, lo=26, hi=27)[0]
    ea.generate([p])
    _, data = export_prefix(ea, p)
    with pytest.raises(InputError, match="KV was computed by model"):
        import_prefix(eb, p, data, ea.fingerprint)
    assert eb.allocator.num_cached == 0
    # the same content in another directory shares KV
    c = shutil.copytree(a, tmp_path / "c" / "model")
    assert load_weights(str(c)).fingerprint == wa.fingerprint


def test_dtype_and_block_size_change_the_kv_fingerprint(tiny_weights):
    base = make_engine(tiny_weights)
    assert make_engine(tiny_weights).fingerprint == base.fingerprint
    assert make_engine(tiny_weights, dtype="bfloat16").fingerprint != base.fingerprint
    assert make_engine(tiny_weights, block_size=8).fingerprint != base.fingerprint
    assert make_engine(tiny_weights, batch_invariant=True,
                       attention="auto").fingerprint != base.fingerprint


@pytest.mark.parametrize("fingerprint", [None, ""])
def test_import_prefix_without_fingerprint_is_refused(tiny_weights, fingerprint):
    a, b = make_engine(tiny_weights), make_engine(tiny_weights)
    p = prompts(1, seed=12, lo=26, hi=27)[0]
    a.generate([p])
    _, data = export_prefix(a, p)
    with pytest.raises(InputError, match="KV of unknown origin is refused"):
        import_prefix(b, p, data, fingerprint)  # type: ignore[arg-type]
    assert b.allocator.num_cached == 0 and torch.count_nonzero(b.pool.data) == 0
