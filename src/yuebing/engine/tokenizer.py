"""Tokenizer and chat template from the model files.

Built once per engine from the loader's tokenizer source: a GGUF file carries its vocabulary,
BPE merges, special tokens and Jinja chat template in its metadata, from which a
`tokenizers.Tokenizer` is assembled; a Hugging Face directory carries ``tokenizer.json`` and
``tokenizer_config.json``. The engine calls `encode` / `apply_chat_template` on requests and an
`IncrementalDetokenizer` per request turns streamed token ids into text pieces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from yuebing.core.errors import InputError

# llama.cpp pre-tokenizer regexes for GGUF ``tokenizer.ggml.pre`` names
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                 r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL_TOKEN_TYPES = (3, 4)  # llama.cpp CONTROL and USER_DEFINED


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()


class Tokenizer:
    """Text ↔ token ids, special tokens, and the model's chat template."""

    def __init__(self, tok: Any, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, add_bos: bool) -> None:
        self._tok = tok
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = None if bos_token is None else tok.token_to_id(bos_token)
        self.add_bos = add_bos and self.bos_token_id is not None
        self._template: Any = None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; BOS is prepended when the model asks for it (never twice)."""
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_special and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level BPE piece may be part of a UTF-8
        character); its decoded text's UTF-8 for a vocabulary that is not byte-level."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return self.decode([token_id], skip_special=False).encode("utf-8")

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ({role, content}) with the model's Jinja chat template."""
        if not self.chat_template:
            raise InputError("this model has no chat template; send a raw prompt instead")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
                    m.get("content"), str):
                raise InputError(f"chat message {m!r} needs string 'role' and 'content'")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            if self._template is None:
                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                env.globals["raise_exception"] = _raise_template_error  # as HF templates expect
                self._template = env.from_string(self.chat_template)
            return str(self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or ""))
        except TemplateError as e:
            raise InputError(f"the model's chat template failed on these messages "
                             f"({type(e).__name__}: {e}); send a raw prompt instead") from None

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat prompt (template text already holds the special tokens)."""
        return self.encode(self.apply_chat_template(messages), add_special=False)


def _raise_template_error(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def tokenizer_from_source(source: Any) -> Tokenizer | None:
    """Build a `Tokenizer` from a GGUF reader or a HF directory; None for dummy models."""
    if source is None:
        return None
    if isinstance(source, Path):
        return _from_hf_dir(source)
    return _from_gguf(source)


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _from_gguf(reader: Any) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kind = _gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise InputError(f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE "
                         "'gpt2' only); use the Hugging Face directory of this model instead")
    tokens: list[str] = _gguf_field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _gguf_field(reader, "tokenizer.ggml.merges", [])]
    types = _gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                 ignore_merges=False))
    pre = _gguf_field(reader, "tokenizer.ggml.pre", "default")
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(
        pre, _GPT2_SPLIT)
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    if pre == "smollm":  # llama.cpp: digits are split one by one before the GPT-2 regex
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True)
                            if ty in _CONTROL_TOKEN_TYPES])

    def name(key: str) -> str | None:
        idx = _gguf_field(reader, key)
        return None if idx is None or not 0 <= int(idx) < len(tokens) else tokens[int(idx)]

    # like transformers' GGUF loader, byte-level BPE vocabularies get no automatic BOS (llama.cpp
    # would add it for SmolLM2, where BOS is <|im_start|>; the chat template adds its own)
    return Tokenizer(tok, _gguf_field(reader, "tokenizer.chat_template"),
                     name("tokenizer.ggml.bos_token_id"), name("tokenizer.ggml.eos_token_id"),
                     add_bos=False)


def _from_hf_dir(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # the tokenizers library raises a bare Exception on bad files
        raise InputError(f"{path}/tokenizer.json: cannot load tokenizer ({e})") from None
    cfg: dict[str, Any] = {}
    cfg_path = path / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"{cfg_path}: invalid JSON ({e})") from None
    template = cfg.get("chat_template")
    tpl_file = path / "chat_template.jinja"
    if template is None and tpl_file.is_file():
        template = tpl_file.read_text()

    def token(key: str) -> str | None:
        value = cfg.get(key)
        return value.get("content") if isinstance(value, dict) else value

    return Tokenizer(tok, template if isinstance(template, str) else None, token("bos_token"),
                     token("eos_token"), bool(cfg.get("add_bos_token", False)))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-4:])
        self._prefix = len(self._ids)
        self._read = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the newly completed text (maybe empty)."""
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        full = self._tok.decode(self._ids[self._prefix:])
        if full.endswith("\ufffd") or len(full) <= len(prefix_text):
            return ""
        delta = full[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
