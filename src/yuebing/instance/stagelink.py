"""`StageLink`: boundary rows between the stages of a pipeline group, through the transfer engine.

A stage copies each prompt chunk's boundary rows (`RequestOutput.boundary`) into a range of its
own registered ``stage`` segment (shared memory) and notifies the next stage (`StageRows`); the
next stage READs the range through its transfer engine (a copy on one host, TCP across), answers
`StageTaken` (the range is free again) and hands the rows to its role. One sender thread and one
receiver thread keep a request's chunks, and the `StageDone` after them, in order. Built by
`stage.StageRole`; callbacks run on the receiver thread (or the sender's, for send failures).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from yuebing.engine import runtime
from yuebing.instance.staging import Staging
from yuebing.protocol import ProtocolError, decode, encode
from yuebing.protocol.stage import STAGE_TOPIC, StageDone, StageRows, StageTaken
from yuebing.transfer.engine import TransferEngine
from yuebing.transfer.types import Notification, OpCode, TransferRequest

log = logging.getLogger(__name__)

RowsCallback = Callable[[str, int, torch.Tensor, torch.Tensor], None]
"""(request id, first position, residual rows, MLP-output rows) that arrived."""
DoneCallback = Callable[[str, bool, str], None]
"""(request id, ok, error): the previous stage's `StageDone`, or this link's failure."""


@dataclass
class _Send:
    request_id: str
    segment: str
    start: int = 0
    residual: torch.Tensor | None = None
    x: torch.Tensor | None = None
    done: StageDone | None = None


class StageLink:
    """See the module docstring. ``on_rows`` / ``on_done`` receive what the previous stage
    sent; ``on_failed(request_id, error)`` a failure to send this stage's rows."""

    def __init__(self, transfer: TransferEngine, out_bytes: int, timeout_s: float,
                 on_rows: RowsCallback, on_done: DoneCallback,
                 on_failed: Callable[[str, str], None]) -> None:
        self.transfer = transfer
        self.timeout_s = timeout_s
        self.on_rows, self.on_done, self.on_failed = on_rows, on_done, on_failed
        seg = transfer.register_segment("stage", size=out_bytes)
        self.segment = transfer.segment_name("stage")
        """What the previous stage notifies (`Hello.stage_segment`)."""
        self.out = Staging(torch.frombuffer(seg.view, dtype=torch.uint8))
        self._freed = threading.Condition()
        self._failed: set[str] = set()
        self._sends: queue.Queue[_Send | None] = queue.Queue()
        self._recvs: queue.Queue[StageRows | StageDone | None] = queue.Queue()
        transfer.on_notify(self._notified)
        self._threads = [threading.Thread(target=f, name=n, daemon=True) for f, n in
                         ((self._send_loop, "stage-send"), (self._recv_loop, "stage-recv"))]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ sending (any thread)

    def send_rows(self, request_id: str, segment: str, start: int, residual: torch.Tensor,
                  x: torch.Tensor) -> None:
        """Queue a chunk's rows for the stage owning ``segment`` (not blocking)."""
        self._sends.put(_Send(request_id, segment, start, residual, x))

    def send_done(self, request_id: str, segment: str, ok: bool, error: str = "") -> None:
        """Queue the request's `StageDone` after its rows (not blocking)."""
        self._sends.put(_Send(request_id, segment,
                              done=StageDone(request_id=request_id, ok=ok, error=error)))

    def close(self) -> None:
        self._sends.put(None)
        self._recvs.put(None)

    def _send_loop(self) -> None:
        runtime.release_openmp_pool()  # its copies run here alone, beside the driver's pool
        while (item := self._sends.get()) is not None:
            rid = item.request_id
            try:
                if item.done is not None:
                    done = item.done
                    if rid in self._failed and done.ok:
                        done = StageDone(request_id=rid, ok=False, error="sending rows failed")
                    self._failed.discard(rid)
                    self._notify(item.segment, encode(done))
                elif rid not in self._failed:
                    self._send(item)
            except Exception as e:
                if rid not in self._failed:
                    self._failed.add(rid)
                    log.warning("%s: sending to the next stage failed: %s", rid, e)
                    self.on_failed(rid, f"the next pipeline stage is unreachable: {e}")

    def _send(self, item: _Send) -> None:
        assert item.residual is not None and item.x is not None
        res = item.residual.contiguous().view(torch.uint8).reshape(-1)
        x = item.x.contiguous().view(torch.uint8).reshape(-1)
        n = res.numel() + x.numel()
        end = time.monotonic() + self.timeout_s
        with self._freed:
            while (got := self.out.take(n)) is None:
                if time.monotonic() >= end:
                    raise TimeoutError(f"no room for {n} bytes of rows in {self.timeout_s} s "
                                       f"(the next stage reads none)")
                self._freed.wait(0.05)
        lease, view = got
        view[:res.numel()].copy_(res)
        view[res.numel():].copy_(x)
        rows, hidden = item.residual.shape
        msg = StageRows(request_id=item.request_id, start=item.start, rows=rows, hidden=hidden,
                        dtype=str(item.residual.dtype).removeprefix("torch."),
                        segment=self.segment, offset=lease - 1, nbytes=n, lease=lease)
        try:
            self._notify(item.segment, encode(msg))
        except Exception:
            self._give(lease)
            raise

    def _notify(self, segment: str, payload: bytes) -> None:
        self.transfer.notify(segment, STAGE_TOPIC, payload, timeout_s=self.timeout_s)

    def _give(self, lease: int) -> None:
        with self._freed:
            self.out.give(lease)
            self._freed.notify_all()

    # ------------------------------------------------------------------ receiving

    def _notified(self, n: Notification) -> None:
        """Transfer-engine thread: a stage message (rows and dones queued in order)."""
        if n.topic != STAGE_TOPIC:
            log.warning("ignored a notification on topic %r", n.topic)
            return
        try:
            msg = decode(n.payload)
        except ProtocolError as e:
            log.warning("bad stage message from %s: %s", n.sender, e)
            return
        if isinstance(msg, StageTaken):
            self._give(msg.lease)
        elif isinstance(msg, StageRows | StageDone):
            self._recvs.put(msg)

    def _recv_loop(self) -> None:
        runtime.release_openmp_pool()
        while (msg := self._recvs.get()) is not None:
            if isinstance(msg, StageDone):
                self.on_done(msg.request_id, msg.ok, msg.error)
                continue
            try:
                residual, x = self._read(msg)
            except Exception as e:
                log.warning("%s: reading rows from the previous stage failed: %s",
                            msg.request_id, e)
                self.on_done(msg.request_id, False, f"reading the previous stage's rows "
                             f"failed: {e}")
                continue
            self.on_rows(msg.request_id, msg.start, residual, x)

    def _read(self, msg: StageRows) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = getattr(torch, msg.dtype, None)
        if not isinstance(dtype, torch.dtype) or msg.rows < 1 or msg.hidden < 1 or \
                msg.nbytes != 2 * msg.rows * msg.hidden * dtype.itemsize:
            raise ValueError(f"malformed rows: {msg.rows} x {msg.hidden} {msg.dtype} in "
                             f"{msg.nbytes} bytes")
        buf = torch.empty(msg.nbytes, dtype=torch.uint8)
        try:
            self.transfer.transfer([TransferRequest(OpCode.READ, buf.numpy(), msg.segment,
                                                    msg.offset, msg.nbytes)],
                                   timeout_s=self.timeout_s)
        finally:
            try:
                self._notify(msg.segment, encode(StageTaken(lease=msg.lease)))
            except Exception as e:  # the sender is gone: nothing to free there
                log.info("StageTaken to %s failed: %s", msg.segment, e)
        half = msg.nbytes // 2
        shape = (msg.rows, msg.hidden)
        return buf[:half].view(dtype).reshape(shape), buf[half:].view(dtype).reshape(shape)
