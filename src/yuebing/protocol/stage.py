"""Messages between the stages of a chunked pipeline parallel prefill group (issue 27).

They travel as transfer-engine notifications (topic ``STAGE_TOPIC``); the rows themselves
never do: stage k copies a chunk's boundary rows into its own registered ``stage`` segment
and sends `StageRows`; stage k+1 READs them through the transfer engine (a copy on one host,
TCP across), feeds its engine and answers `StageTaken`, so stage k reuses the range.
`StageDone` follows a request's last rows once stage k's KV reached the decode (or failed).
Used by `yuebing.instance.stagelink`.
"""

from __future__ import annotations

from yuebing.protocol.codec import Message, register_message

STAGE_TOPIC = "yuebing.stage"


@register_message
class StageRows(Message, tag="stage.rows"):
    """Rows ``[start, start + rows)`` of a request's boundary: ``nbytes`` at ``offset`` of
    ``segment`` hold the residual rows, then the MLP-output rows, each ``[rows, hidden]``."""

    request_id: str
    start: int
    rows: int
    hidden: int
    dtype: str
    segment: str
    offset: int
    nbytes: int
    lease: int


@register_message
class StageTaken(Message, tag="stage.taken"):
    """The receiver has read the rows of ``lease``: the sender may reuse the range."""

    lease: int


@register_message
class StageDone(Message, tag="stage.done"):
    """Every row of the request was sent and this stage's (and every earlier stage's) KV
    reached the decode; ``ok`` False: the group's prefill failed here or before."""

    request_id: str
    ok: bool = True
    error: str = ""
