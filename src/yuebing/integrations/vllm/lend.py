"""`StepThreads`: a vLLM worker's steps borrow the idle cores of the host's other instances.

`YuebingConnector`'s worker half calls `begin` first in each vLLM step (`handle_preemptions`,
before the attention metadata, which holds the thread count) and `end` when vLLM clears the
step's connector metadata (after the forward and the saves). `begin` takes the threads of the
host's `CoreLedger` (``instance/cores.py``, as yuebing's own instances with ``--lend-cores``)
and sets the step's OpenMP threads; `end` sets back the instance's own and keeps its claim.
vLLM says nothing when it runs out of work, so a claim that no step renews within
`IDLE_AFTER_S` is dropped by a timer thread: the instance is then idle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from yuebing.instance.cores import CoreLedger

log = logging.getLogger(__name__)

IDLE_AFTER_S = 0.03
"""A worker with no step this long after its last is idle (its claim dropped). vLLM's gap
between two steps (scheduler, outputs) is a few ms; a longer one only lends early."""


class StepThreads:
    """One worker's place in the host's core ledger; see the module docstring."""

    def __init__(self, ledger: CoreLedger, set_threads: Callable[[int], None],
                 idle_after_s: float = IDLE_AFTER_S) -> None:
        self.ledger = ledger
        self._set = set_threads
        self.idle_after_s = idle_after_s
        self._cv = threading.Condition()
        self._in_step = False
        self._ended = 0.0
        self._claimed = False
        self._stop = False
        self._borrowed = False
        self.threads_now = 0
        """The OpenMP threads last set (0: none yet; the first step sets them, in vLLM's
        forward thread, whose OpenMP setting it is)."""
        self._timer = threading.Thread(target=self._idle_loop, name="yuebing-vllm-lend",
                                       daemon=True)
        self._timer.start()

    def _use(self, n: int) -> None:
        if n != self.threads_now:
            self._set(n)
            self.threads_now = n

    def begin(self) -> int:
        """Before a step: the threads it runs with (its own, plus every core no one claims;
        waits while borrowers' steps leave no room for its own)."""
        with self._cv:
            self._in_step = True
            self._claimed = True
            n = self.ledger.acquire()
            if n > self.ledger.threads and not self._borrowed:
                self._borrowed = True
                log.info("core lending: a step runs with %d threads (%d own, of %d cores)", n,
                         self.ledger.threads, self.ledger.cores)
            self._use(n)
            return n

    def end(self) -> None:
        """After a step's forward: own threads again (vLLM computes the logits after it), the
        claim kept until `IDLE_AFTER_S` passes without a step."""
        with self._cv:
            if not self._in_step:
                return
            self._use(self.ledger.threads)
            self.ledger.release(idle=False)
            self._in_step = False
            self._ended = time.monotonic()
            self._cv.notify()

    def _idle_loop(self) -> None:
        with self._cv:
            while not self._stop:
                if self._claimed and not self._in_step:
                    left = self._ended + self.idle_after_s - time.monotonic()
                    if left <= 0:
                        self.ledger.release(idle=True)
                        self._claimed = False
                        continue
                    self._cv.wait(left)
                else:
                    self._cv.wait()

    def close(self) -> None:
        """Stop the timer and give the ledger slot back."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._timer.join(5.0)
        self.ledger.close()
