"""`LearnedState`: what the Conductor learned online for admission, kept per configuration.

`Conductor` calls `switch` with the cluster's configuration (`configuration`) whenever its
membership changes, `note` after each finished request, `close` at shutdown. The TBT tail's
ratios, the decode durations and the prefill scale (each learner's ``snapshot``) live in one
JSON file per configuration (model, instances, machine, predictors, decode selector) under
``--learned-dir``, named by its hash and recording it, so a fresh Conductor on it starts from
them (and one switching back, from what it held in memory). A file that records another
configuration, or does not parse, is refused with a warning that says why, and everything is
learned afresh. Written atomically (temporary file, fsync, rename) by a thread of its own, never
on the event loop, at most once per ``--learned-save-s`` and at a configuration change and
shutdown.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from yuebing.conductor.calibration import difference
from yuebing.core.choices import choice_key, machine_parts

log = logging.getLogger(__name__)

VERSION = 2
"""Part of every configuration: a new layout or meaning of the learned state makes old files
unused (2: the tail's ratios per the step of the batch decoded in, `StepLedger`)."""


class Learner(Protocol):
    """One thing learned online (`TbtTail`, `DecodeDurations`, `Calibration`)."""

    def snapshot(self) -> dict[str, Any] | None:
        """What to keep (None: nothing learned, or learning is off)."""

    def restore(self, kept: Mapping[str, Any]) -> str:
        """Take ``kept`` (a ``snapshot``) in place of what was learned, returning what it now
        holds for the log; raises ValueError, changing nothing, on a malformed one."""

    def reset(self) -> None:
        """Forget what was learned (back to the flags)."""


def configuration(fingerprint: str, instances: list[tuple[str, Mapping[str, str]]],
                  predictors: str, decode_selector: str) -> dict[str, Any]:
    """The configuration learned state is kept for: the model's KV fingerprint, each serving
    instance's role and engine configuration (as its `Hello` reports it; how many of each), this
    machine (`machine_parts`), the predictors the ratios and scale are relative to, and the
    decode selector, which shapes the batches the tail's ratios were taken in."""
    return {"version": VERSION, "machine": machine_parts(), "model": fingerprint,
            "instances": sorted(f"{role}: " + ", ".join(f"{k}={v}" for k, v in sorted(e.items()))
                                for role, e in instances),
            "predictors": predictors, "decode_selector": decode_selector}


def _flat(parts: Mapping[str, Any]) -> dict[str, str]:
    return {k: json.dumps(v, sort_keys=True, default=str) for k, v in parts.items()}


class LearnedState:
    """The file of the current configuration and when it was last written."""

    def __init__(self, directory: Path | None, learners: Mapping[str, Learner],
                 save_every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        """None: nothing is kept (``--no-persist-learned``)."""
        self.learners = dict(learners)
        self.save_every_s = save_every_s
        self.clock = clock
        self.parts: dict[str, Any] | None = None
        self.path: Path | None = None
        self.loaded = ""
        """What the current file gave ('' = nothing: learned here)."""
        self.dirty = False
        self.saved_at = 0.0
        self.saves = 0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="learned-state")
        """Writes one file at a time, in order, off the caller's (event loop) thread."""
        self.closed = False
        self._memory: dict[str, dict[str, Any]] = {}
        """What was learned on each configuration this process left (by `choice_key`)."""

    def switch(self, parts: dict[str, Any]) -> None:
        """The cluster now runs ``parts``: keep what was learned on the previous configuration
        (in memory, and in its file), then start from this one's: what this process learned on
        it before (fresher than its file, whose write may still be queued), else its file, else
        afresh."""
        if parts == self.parts or self.closed:
            return
        if self.parts is not None:
            self._memory[choice_key(self.parts)] = self._snapshot()
            self._save()
            for learner in self.learners.values():
                learner.reset()
        self.parts, self.loaded, self.dirty, self.saved_at = parts, "", False, self.clock()
        self.path = None if self.directory is None else \
            self.directory / f"{choice_key(parts)}.json"
        held = self._memory.get(choice_key(parts))
        if held:
            self._restore(held, "this process's earlier run of it")
        elif self.path is not None:
            self._load(self.path, parts)

    def _load(self, path: Path, parts: dict[str, Any]) -> None:
        try:
            text = path.read_text()
        except FileNotFoundError:
            log.info("learned state: none kept for this configuration yet (%s); learning", path)
            return
        except (OSError, ValueError) as e:  # ValueError: not UTF-8
            log.warning("learned state %s refused: unreadable (%s); learning afresh", path, e)
            return
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or not isinstance(doc.get("parts"), dict) \
                    or not isinstance(doc.get("learned"), dict):
                raise ValueError("not an object with 'parts' and 'learned'")
        except ValueError as e:
            log.warning("learned state %s refused: corrupt (%s); learning afresh", path, e)
            return
        if doc["parts"] != parts:
            log.warning("learned state %s refused: it was learned on another configuration "
                        "(%s); learning afresh", path,
                        difference(_flat(doc["parts"]), _flat(parts)))
            return
        self._restore(doc["learned"], str(path))

    def _restore(self, learned: Mapping[str, Any], source: str) -> None:
        held: list[str] = []
        try:
            for name, learner in self.learners.items():
                kept = learned.get(name)
                if kept is not None:
                    if not isinstance(kept, dict):
                        raise ValueError(f"{name}: not an object")
                    held.append(f"{name} {learner.restore(kept)}")
        except ValueError as e:
            for learner in self.learners.values():
                learner.reset()
            log.warning("learned state %s refused: corrupt (%s); learning afresh", source, e)
            return
        self.loaded = "; ".join(held) or "nothing learned"
        log.info("learned state from %s: %s", source, self.loaded)

    def _snapshot(self) -> dict[str, Any]:
        return {name: s for name, learner in self.learners.items()
                if (s := learner.snapshot()) is not None}

    def note(self) -> None:
        """Something may have been learned: write it when the last write is old enough."""
        self.dirty = True
        if self.clock() - self.saved_at >= self.save_every_s:
            self._save()

    def wait(self) -> None:
        """Until the writes asked for so far are done (at once after `close`)."""
        if not self.closed:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Shutdown: write what was learned since the last write (and wait for the writes);
        nothing is switched or written after it."""
        if self.closed:
            return
        self._save()
        self.closed = True
        self._writer.shutdown(wait=True)

    def _save(self) -> None:
        if not self.dirty or self.closed or self.path is None or self.parts is None:
            return
        learned = self._snapshot()
        self.dirty, self.saved_at = False, self.clock()
        if learned:
            self._writer.submit(self._write, self.path, {"parts": self.parts, "learned": learned})

    def _write(self, path: Path, doc: dict[str, Any]) -> None:
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(doc, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            log.warning("learned state not kept (%s)", e)
            return
        self.saves += 1

    def state(self) -> dict[str, object]:
        """For ``/health``: the file, what it gave at start, how often it was written."""
        return {"file": str(self.path) if self.path else None, "loaded": self.loaded or None,
                "saves": self.saves, "save_every_s": self.save_every_s}
