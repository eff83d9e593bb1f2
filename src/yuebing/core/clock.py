"""Clocks. Live services use `WallClock`; the simulator uses `VirtualClock`. Pure policies never
read a clock: callers pass ``now_s`` in the view snapshot."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod


class Clock(ABC):
    """Source of the current time in seconds."""

    @abstractmethod
    def now(self) -> float:
        """Seconds since an arbitrary fixed origin; never decreases."""


class WallClock(Clock):
    """Monotonic wall time (``time.monotonic``)."""

    def now(self) -> float:
        return time.monotonic()


class VirtualClock(Clock):
    """Simulated time advanced explicitly by the event loop."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"virtual clock cannot go back from {self._now} to {t}")
        self._now = t
