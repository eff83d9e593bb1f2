"""Shared pieces of the hypothesis fuzz tests (store RPC, instance control sockets)."""

from __future__ import annotations

from typing import Any

import msgspec


def plain(v: Any, int_max: int) -> Any:
    """``v`` as msgpack can carry it: ints clipped to [-2**63, ``int_max``], structs as tagged
    dicts, what msgpack has no form for (hypothesis' placeholders) as None."""
    if isinstance(v, bool) or v is None or isinstance(v, float | str | bytes):
        return v
    if isinstance(v, int):
        return max(-(2**63), min(int(v), int_max))
    if isinstance(v, msgspec.Struct):
        tag = type(v).__struct_config__.tag
        return {**({"type": tag} if isinstance(tag, str) else {}),
                **{k: plain(x, int_max) for k, x in msgspec.structs.asdict(v).items()}}
    if isinstance(v, list | tuple | set | frozenset):
        return [plain(x, int_max) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x, int_max) for k, x in v.items()}
    return None
