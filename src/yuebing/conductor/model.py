"""What the Conductor needs of the model: its tokenizer, chat template and shape — not its weights.

`load_model_info(spec)` is called once by `build_conductor` with the same model spec the
instances load (``smollm2``, a ``.gguf`` file, a Hugging Face directory, ``dummy[:...]``). It
reads only metadata (the GGUF header and vocabulary, ``config.json``/``tokenizer.json``), so
the Conductor starts in about a second and holds no tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from yuebing.core.errors import InputError
from yuebing.engine.config import ModelConfig
from yuebing.engine.tokenizer import Tokenizer, tokenizer_from_source
from yuebing.engine.weights import (
    BUNDLED,
    _gguf_config,
    _hf_config,
    bundled_model_path,
    parse_dummy_spec,
)


@dataclass(frozen=True)
class ModelInfo:
    spec: str
    config: ModelConfig
    tokenizer: Tokenizer | None
    """None for dummy models (prompts must be token ids)."""

    @property
    def kv_bytes_per_token(self) -> int:
        return self.config.kv_bytes_per_token


def load_model_info(spec: str) -> ModelInfo:
    """Tokenizer and shape of model ``spec`` (see the module docstring)."""
    if spec == "dummy" or spec.startswith("dummy:"):
        return ModelInfo(spec, parse_dummy_spec(spec), None)
    path = bundled_model_path() if spec == BUNDLED else Path(spec)
    if path.is_dir():
        try:
            raw = json.loads((path / "config.json").read_text())
            cfg = _hf_config(raw, path)
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise InputError(f"{path}/config.json: cannot read the model config ({e})") from None
        tok = tokenizer_from_source(path) if (path / "tokenizer.json").is_file() else None
        return ModelInfo(spec, cfg, tok)
    if not path.is_file():
        raise InputError(f"model {spec!r} not found: give smollm2, a .gguf file, a Hugging Face "
                         "directory, or dummy[:...]")
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise InputError(f"{path}: not a readable GGUF file ({e})") from None
    return ModelInfo(spec, _gguf_config(reader, path), tokenizer_from_source(reader))
