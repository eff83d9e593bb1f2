"""Typed identifiers. `NewType`s cost nothing at run time but keep mypy honest about which
integer or string is which."""

from typing import NewType

BlockHash = NewType("BlockHash", int)
"""64-bit chained hash of a full KV block (see `yuebing.core.hashing`)."""

RequestId = NewType("RequestId", str)
InstanceId = NewType("InstanceId", str)
"""Name of a prefill or decode instance, e.g. ``"p0"`` / ``"d3"``."""

SegmentName = NewType("SegmentName", str)
"""Cluster-unique name of a registered memory segment (transfer engine / store)."""

NodeId = NewType("NodeId", str)
