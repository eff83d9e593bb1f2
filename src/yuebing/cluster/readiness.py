"""Readiness checks of role processes, polled by the supervisor until they pass.

The supervisor's thread calls a check's `poll` every ~50 ms while the role starts; it returns
None (not ready yet) or a dict of what the role reported (e.g. the store master's address or an
instance's `Hello`), which the plan uses to start the roles that depend on it. A check must not
block for long: each probe has a short timeout. Checks: `ReadyFile` (the role's
``--ready-file``, written atomically by rename), `HttpOk`, `HttpJson`, `InstancePing` and
`AllOf` (every check passes; their dicts are merged).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

Info = dict[str, Any]


class Readiness(ABC):
    """How the supervisor tells that a role serves."""

    @abstractmethod
    def poll(self, previous: Info) -> Info | None:
        """None while not ready; else what the role reported. ``previous`` is what earlier
        checks of an `AllOf` found (e.g. an address read from the ready file)."""

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Forget the last result before the role is (re)started (e.g. delete a ready file)."""


class ReadyFile(Readiness):
    """Ready once ``path`` holds a JSON object (deleted by `reset`, before each start)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def reset(self) -> None:
        self.path.unlink(missing_ok=True)

    def poll(self, previous: Info) -> Info | None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):  # absent, or caught mid-write by a non-atomic writer
            return None
        return data if isinstance(data, dict) else None


class HttpOk(Readiness):
    """Ready once GET ``url`` (or ``url_from(previous)``) answers 200."""

    def __init__(self, url: str = "", url_from: Callable[[Info], str] | None = None,
                 timeout_s: float = 1.0) -> None:
        if not url and url_from is None:
            raise ValueError("HttpOk needs a url or url_from")
        self.url = url
        self.url_from = url_from
        self.timeout_s = timeout_s

    def poll(self, previous: Info) -> Info | None:
        url = self.url or (self.url_from(previous) if self.url_from else "")
        if not url:
            return None
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as r:  # noqa: S310
                return {"health_url": url} if r.status == 200 else None
        except (OSError, urllib.error.URLError, ValueError):
            return None


class HttpJson(Readiness):
    """Ready once GET ``url`` answers 200 with a JSON body that ``accept`` takes (e.g. the
    Conductor's ``/health`` listing every instance of the host in its view)."""

    def __init__(self, url: str, accept: Callable[[Any], bool], timeout_s: float = 1.0) -> None:
        self.url = url
        self.accept = accept
        self.timeout_s = timeout_s

    def poll(self, previous: Info) -> Info | None:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as r:  # noqa: S310
                if r.status != 200:
                    return None
                body = json.loads(r.read())
        except (OSError, urllib.error.URLError, ValueError):
            return None
        return {"health_url": self.url, "health": body} if self.accept(body) else None


class InstancePing(Readiness):
    """Ready once the instance's control server (address from the ready file's
    ``control_address``, or ``address``) answers `Ping`."""

    def __init__(self, address: str = "", timeout_s: float = 1.0) -> None:
        self.address = address
        self.timeout_s = timeout_s

    def poll(self, previous: Info) -> Info | None:
        address = self.address or str(previous.get("control_address", ""))
        if not address:
            return None
        return {"control_address": address} if _ping(address, self.timeout_s) else None


def _ping(address: str, timeout_s: float) -> bool:
    import zmq.asyncio

    from yuebing.core.errors import YuebingError
    from yuebing.instance.client import InstanceClient

    async def go() -> bool:
        ctx = zmq.asyncio.Context()
        client = InstanceClient(address, timeout_s=timeout_s, ctx=ctx)
        try:
            await client.ping(timeout_s)
            return True
        except (YuebingError, OSError):  # unavailable, or refusing (shutting down)
            return False
        finally:
            await client.close()
            ctx.term()

    return asyncio.run(go())


class AllOf(Readiness):
    """Every check in order; each sees the merged result of those before it."""

    def __init__(self, *checks: Readiness) -> None:
        if not checks:
            raise ValueError("AllOf needs at least one check")
        self.checks = checks

    def reset(self) -> None:
        for c in self.checks:
            c.reset()

    def poll(self, previous: Info) -> Info | None:
        merged: Info = dict(previous)
        for c in self.checks:
            got = c.poll(merged)
            if got is None:
                return None
            merged.update(got)
        return merged
