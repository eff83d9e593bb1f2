"""Test helpers for real ``yuebing serve`` runs: start one, wait for its banner, list its
process tree, send OpenAI requests with the standard library, check that nothing is left."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

YUEBING = [sys.executable, "-m", "yuebing.cli.main"]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, grandchildren, ...)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if fields[0] != "Z":
                parent[int(entry)] = int(fields[1])
    out: set[int] = set()
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        frontier.extend(kids)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def shm_files_of(pids: Sequence[int] | set[int]) -> list[str]:
    """Segment files in /dev/shm created by any of ``pids``."""
    names = [f"yuebing-tx-{p}-" for p in pids]
    return [e for e in os.listdir("/dev/shm") if any(e.startswith(n) for n in names)]


class Serve:
    """A ``yuebing serve`` (or any long-running command) whose output is read by a thread;
    `wait_for` returns the first output line containing a text."""

    def __init__(self, args: Sequence[str], prefix: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([*prefix, *YUEBING, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, text: str, timeout_s: float = 600.0) -> str:
        end = time.monotonic() + timeout_s
        while True:
            try:
                line = self._q.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {text!r} within {timeout_s}s; output:\n"
                                     + "\n".join(self.lines[-60:])) from None
            if line is None:
                raise AssertionError(f"exited ({self.proc.wait()}) before {text!r}; output:\n"
                                     + "\n".join(self.lines[-60:]))
            if text in line:
                return line

    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self, sig: int, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def post(url: str, body: dict, timeout_s: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310
        return json.loads(r.read())


def stream(url: str, body: dict, timeout_s: float = 120.0) -> Iterator[dict]:
    """The JSON chunks of an SSE response (``data: [DONE]`` ends it)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def chat(base_url: str, content: str, max_tokens: int = 8, **extra: object) -> dict:
    return post(base_url + "/v1/chat/completions",
                {"model": "smollm2-135m-instruct", "max_tokens": max_tokens, "temperature": 0,
                 "messages": [{"role": "user", "content": content}], **extra})


def log_dir_of(serve: Serve) -> Path:
    line = next(x for x in serve.lines if "logs in " in x)
    return Path(line.split("logs in ", 1)[1].split(";")[0].strip())


def procs_mentioning(text: str) -> list[int]:
    """Live pids whose command line contains ``text`` (e.g. a test's log directory, which
    every role's ``--ready-file`` names): survivors that left the process tree."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            if text in cmd and alive(int(entry)):
                out.append(int(entry))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""
