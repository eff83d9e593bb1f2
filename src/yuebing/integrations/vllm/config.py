"""`VllmConnectorConfig`: the settings of `YuebingConnector`, read from vLLM's
``--kv-transfer-config`` ``kv_connector_extra_config`` (`from_extra`: unknown keys and bad values
are refused with what to change). Both halves of the connector (`scheduler`, `worker`) read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from yuebing.core.config import require
from yuebing.core.errors import ConfigError


@dataclass(frozen=True)
class VllmConnectorConfig:
    master: str = field(default="tcp://127.0.0.1:50151", metadata={
        "help": "the yuebing store master's RPC address(es), comma-separated"})
    store_block_tokens: int = field(default=256, metadata={
        "help": "tokens per store object: a multiple of vLLM's --block-size, and the same as "
                "the Conductor's and the other instances' for their keys to meet"})
    model_id: str = field(default="", metadata={
        "help": "the model's name in the KV fingerprint ('' = vLLM's served model name)"})
    expect_model: str = field(default="", metadata={
        "help": "the model the Conductor expects: another one is refused at start, naming both"})
    expect_block_size: int = field(default=0, metadata={
        "help": "the vLLM --block-size the Conductor expects (0 = any)"})
    load: bool = field(default=True, metadata={"help": "load prefix KV from the store"})
    save: bool = field(default=True, metadata={"help": "save new full store blocks"})
    load_timeout_s: float = field(default=2.0, metadata={
        "help": "each store call of a load (lookup, read) gives up after this long and the "
                "prefix is computed instead"})
    save_timeout_s: float = field(default=15.0, metadata={
        "help": "a save's store calls give up after this long (the save is dropped)"})
    max_pending_save_bytes: int = field(default=256 << 20, metadata={
        "help": "copies of blocks waiting for their put hold at most this much memory; a save "
                "beyond it is dropped (a later miss, never a stall)"})
    lend_threads: int = field(default=0, metadata={
        "help": "lend cores: each step runs with this many OpenMP threads (the instance's "
                "own) plus the host's cores no other instance claims, through the host's core "
                "ledger; vLLM's OpenMP pool must span lend_cores (0 = no lending)"})
    lend_cores: int = field(default=0, metadata={
        "help": "with lend_threads: the cores the host's instances share, vLLM's OpenMP "
                "threads (0 = the worker's CPU affinity)"})

    def __post_init__(self) -> None:
        require(bool(self.master), "master (the store master's address) is required")
        require(self.store_block_tokens > 0, f"store_block_tokens must be > 0, got "
                f"{self.store_block_tokens}")
        require(self.expect_block_size >= 0, "expect_block_size must be >= 0")
        require(self.load_timeout_s > 0 and self.save_timeout_s > 0,
                "load_timeout_s and save_timeout_s must be > 0")
        require(self.max_pending_save_bytes >= 0, "max_pending_save_bytes must be >= 0")
        require(self.lend_threads >= 0 and self.lend_cores >= 0,
                f"lend_threads and lend_cores must be >= 0, got {self.lend_threads} and "
                f"{self.lend_cores}")
        require(not self.lend_cores or self.lend_threads <= self.lend_cores,
                f"lend_threads {self.lend_threads} (the instance's own threads) is more than "
                f"lend_cores {self.lend_cores} (the cores shared)")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> VllmConnectorConfig:
        """The config from ``kv_connector_extra_config``; other keys there are refused."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise ConfigError(f"unknown yuebing connector setting(s) {', '.join(unknown)} in "
                              f"kv_connector_extra_config; known: {', '.join(fields)}")
        values: dict[str, Any] = {}
        for name, value in extra.items():
            kind: type = type(fields[name].default)
            if kind is bool and not isinstance(value, bool):
                raise ConfigError(f"{name} must be true or false, got {value!r}")
            try:
                values[name] = kind(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{name} must be a {kind.__name__}, got {value!r}") from None
        return cls(**values)
