import argparse
from dataclasses import dataclass, field

import pytest

from yuebing.core.config import add_config_args, config_from_args, parse_size, require
from yuebing.core.errors import ConfigError
from yuebing.core.registry import Registry
from yuebing.protocol import Message, ProtocolError, decode, encode, register_message


def test_parse_size() -> None:
    assert parse_size("4GiB") == 4 * 1024**3
    assert parse_size("64KiB") == 65536
    assert parse_size("1e6") == 1_000_000
    assert parse_size("512") == 512
    with pytest.raises(ConfigError, match="cannot parse size"):
        parse_size("4 parsecs")
    with pytest.raises(ConfigError, match="size '1e400' is too large"):
        parse_size("1e400")
    with pytest.raises(ConfigError, match="size '0.5' is not a whole number"):
        parse_size("0.5")


@dataclass(frozen=True)
class _Cfg:
    lanes: int = field(default=4, metadata={"help": "TCP lanes"})
    seg: int = field(default=1024, metadata={"help": "segment", "size": True})
    fast: bool = False
    name: str = "x"
    ports: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        require(self.lanes >= 1, f"lanes must be >= 1, got {self.lanes}")


def test_config_cli_roundtrip_and_validation() -> None:
    p = argparse.ArgumentParser()
    add_config_args(p, _Cfg)
    cfg = config_from_args(_Cfg, p.parse_args(["--lanes", "8", "--seg", "2MiB", "--fast"]))
    assert cfg == _Cfg(lanes=8, seg=2 * 1024**2, fast=True, name="x")
    assert config_from_args(_Cfg, p.parse_args(["--ports", "5,7,"])).ports == (5, 7)
    with pytest.raises(SystemExit):
        p.parse_args(["--ports", "5,x"])
    with pytest.raises(ConfigError, match="lanes must be >= 1"):
        config_from_args(_Cfg, p.parse_args(["--lanes", "0"]))


def test_registry_unknown_name_lists_known() -> None:
    r: Registry[int] = Registry("policy")
    r.add("a", 1)
    assert r.get("a") == 1
    with pytest.raises(ConfigError, match="unknown policy 'b'; known: a"):
        r.get("b")
    with pytest.raises(ValueError):
        r.add("a", 2)


@register_message
class _Ping(Message, tag="test.ping"):
    seq: int
    payload: bytes = b""


def test_codec_roundtrip_and_errors() -> None:
    msg = _Ping(seq=3, payload=b"ab")
    assert decode(encode(msg)) == msg
    assert decode(encode(msg), _Ping) == msg
    with pytest.raises(ProtocolError, match="malformed"):
        decode(b"\x00garbage")
    with pytest.raises(ProtocolError, match="version 99"):
        decode(encode(_Ping(seq=1, v=99)))
