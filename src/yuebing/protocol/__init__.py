"""Wire messages: typed, tagged, versioned msgspec structs and one codec.

Every message class subclasses `Message` (declared with ``tag="..."``) and is registered with
`register_message`. `encode` / `decode` are the only way bytes cross a process boundary; a
malformed or unknown frame raises `ProtocolError` and never a half-built object."""

from yuebing.protocol.codec import (
    PROTOCOL_VERSION,
    Message,
    ProtocolError,
    decode,
    encode,
    register_message,
)

__all__ = ["PROTOCOL_VERSION", "Message", "ProtocolError", "decode", "encode", "register_message"]
