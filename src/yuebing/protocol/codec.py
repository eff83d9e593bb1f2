"""msgspec codec for the tagged message structs of every process boundary (`yuebing.protocol`).

A message is declared once, e.g. ``@register_message class PutStart(Message,
tag="store.put_start")``; the sender calls ``encode(msg)``, the receiver ``decode(buf)`` (any
registered type) or ``decode(buf, PutStart)`` (exactly that type).
"""

from __future__ import annotations

from typing import Any, TypeVar, Union

import msgspec

from yuebing.core.errors import InputError

PROTOCOL_VERSION = 1

M = TypeVar("M", bound="Message")


class ProtocolError(InputError):
    """A frame that is not a valid message of a known type and version."""


class Message(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=False):
    """Base of all wire messages. ``v`` is the protocol version the sender speaks."""

    v: int = PROTOCOL_VERSION


_registry: dict[str, type[Message]] = {}
_union_decoder: msgspec.msgpack.Decoder[Any] | None = None
_typed_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}
_encoder = msgspec.msgpack.Encoder()


def register_message(cls: type[M]) -> type[M]:
    """Class decorator making ``cls`` decodable by `decode` without naming its type."""
    global _union_decoder
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str):
        raise TypeError(f"{cls.__name__} must be declared with tag='...'")
    if tag in _registry and _registry[tag] is not cls:
        raise ValueError(f"message tag {tag!r} registered twice")
    _registry[tag] = cls
    _union_decoder = None
    return cls


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def _check_version(msg: Message) -> None:
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.v} not supported (speak {PROTOCOL_VERSION})")


def decode(buf: bytes | memoryview, expect: type[M] | None = None) -> M | Message:
    """Decode one frame. With ``expect``, anything else is a `ProtocolError`."""
    global _union_decoder
    try:
        if expect is not None:
            dec = _typed_decoders.get(expect)
            if dec is None:
                dec = _typed_decoders[expect] = msgspec.msgpack.Decoder(expect)
            msg = dec.decode(buf)
        else:
            if _union_decoder is None:
                if not _registry:
                    raise ProtocolError("no message types registered")
                types_ = tuple(_registry.values())
                _union_decoder = msgspec.msgpack.Decoder(Union[types_])  # noqa: UP007
            msg = _union_decoder.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"malformed message: {e}") from None
    _check_version(msg)
    return msg
