"""`InstanceRole`: what a serving role adds to its host (`base.Instance`) — the seam the host
calls for control requests, engine outputs, reservations and sweeps. The roles are siblings:
`coupled.CoupledRole`, `prefill.PrefillRole` (which composes a `CoupledRole` for its prompts'
prefix loading and COUPLED tasks), `stage.StageRole` (a prefill of layers ``A:B``, composing a
`PrefillRole`) and `decode.DecodeRole`. `run.build_instance` picks one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from yuebing.engine.engine import LLMEngine
from yuebing.engine.sequence import RequestOutput
from yuebing.instance.control import Refused
from yuebing.protocol import Message
from yuebing.protocol.instance import ErrorCode, FetchPrefix, Reserve, Role, SubmitTask

if TYPE_CHECKING:
    from yuebing.instance.base import Instance, Task


class InstanceRole:
    """One role on its host ``inst``. Every method is called by the host on the control loop
    unless it says otherwise; the defaults refuse what the role does not take."""

    kind: ClassVar[Role]
    uses_store: ClassVar[bool] = True
    """Open store clients (``--store-master``) for prefix loads and saves."""
    exposes_pool: ClassVar[bool] = False
    """Register the KV pool as a transfer segment (decode: prefills write into it)."""

    def __init__(self, inst: Instance) -> None:
        self.inst = inst

    @property
    def stage_segment(self) -> str:
        """A pipeline stage's segment for the previous stage's rows (`Hello`); '' otherwise."""
        return ""

    async def on_submit(self, ident: bytes, msg: SubmitTask) -> Message:
        """A `SubmitTask` from the connection ``ident`` (checked new, prompt valid): the
        reply; the task's events follow through the host."""
        raise Refused(ErrorCode.BAD_REQUEST, f"a {self.kind.label} instance takes no tasks")

    async def on_reserve(self, ident: bytes, msg: Reserve) -> Message:
        """A `Reserve` (decode): the reply naming the reserved blocks."""
        raise Refused(ErrorCode.BAD_REQUEST,
                      f"a {self.kind.label} instance takes no reservations")

    async def on_fetch_prefix(self, msg: FetchPrefix) -> Message:
        """Another instance asks for this one's cached prefix (the roles that prefill)."""
        raise Refused(ErrorCode.BAD_REQUEST, f"a {self.kind.label} instance serves no prefixes")

    async def on_cancel(self, request_id: str) -> bool:
        """End the request (a `Cancel`, or its connection is gone); returns whether it was
        known. Default: forget the task and abort it in the engine."""
        task = self.inst.tasks.pop(request_id, None)
        await self.inst.driver.run(lambda e: e.abort(request_id))
        return task is not None

    def on_output(self, task: Task, out: RequestOutput, step_start: float) -> None:
        """One engine output of a live ``task`` (default: stream it as events)."""
        self.inst.stream_output(task, out)

    def on_output_driver(self, engine: LLMEngine, task: Task, out: RequestOutput) -> None:
        """Driver thread, right after the step that produced ``out`` (its KV still intact)."""

    def reserved_blocks(self) -> int:
        """KV blocks held for requests whose KV has not arrived (load reports)."""
        return 0

    def sweep(self) -> None:
        """Twice a second: expire what has a deadline (decode reservations)."""

    async def close(self) -> None:
        """The host is stopping (before its driver and connector close)."""
