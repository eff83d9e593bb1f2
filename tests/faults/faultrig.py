"""A yuebing cluster of real processes for fault injection, and the load that runs against
it (issue 16, "Fault-injection suite").

`Rig` starts, at addresses fixed for its whole life, a store master, a store node, one prefill
and one decode instance or more (``--model dummy:preset=tiny``) and the Conductor — the roles
`yuebing serve` starts, but each one held by the test, so that the test can ``kill -9`` one,
``SIGSTOP``/``SIGCONT`` it, and restart it at the same address as an operator (or the
supervisor) would. All on 127.0.0.1 by default; `Place` puts a role elsewhere (another
network namespace: ``netns.py``); with an etcd the cluster depends on it for the store
master's election and discovery. Only the processes it started are ever signalled.

`Load` is a small client loop: ``workers`` threads send streamed greedy ``/v1/completions``
requests (token-id prompts from `PROMPTS`, temperature 0, ``ignore_eos``, fixed
``max_tokens``) to the Conductor, each with a deadline, and record how every request ended
(`Outcome`). The fault tests (through ``faultcheck.py``) and the soak (``test_soak.py``) use
them.
"""

from __future__ import annotations

import contextlib
import enum
import http.client
import json
import os
import signal
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli_procs import CliProc
from yuebing.ops import ports

MODEL = "dummy:preset=tiny"
MAX_TOKENS = 16
PROMPTS: list[list[int]] = [[(7 * i + j) % 400 + 1 for j in range(300 + 70 * i)]
                            for i in range(6)]
"""Token-id prompts of 300 ... 650 tokens (one or two 256-token store blocks each)."""

ROLES = ("store-master", "store-node", "prefill-0", "decode-0", "conductor")


def free_port() -> int:
    """A port on 127.0.0.1 outside the ephemeral range, free a moment ago (`yuebing.ops.ports`)."""
    return ports.free_port("127.0.0.1")


def _host_id(flag: str, place: Place) -> tuple[str, ...]:
    return (flag, place.host_id) if place.host_id else ()


def get_json(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - 127.0.0.1
        return json.loads(r.read())


@dataclass(frozen=True)
class Place:
    """Where a role runs: the address it binds and advertises, the command prefix that puts
    its process there (e.g. ``ip netns exec NS``) and the transfer engine's host identity
    ('' = this machine's; another value makes same-machine peers move KV over TCP)."""

    ip: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()
    host_id: str = ""


class Rig:
    """The roles, each a `CliProc` restarted with the same arguments (same ports).

    ``prefill``/``decode`` instances are named ``prefill-0``, ``prefill-1``, ... With ``etcd``
    (its URL) the cluster depends on it as ``yuebing serve --etcd`` does: the store master
    serves only while it holds its leader lease there, the instances publish themselves and
    the Conductor finds them there (no ``--instances``). ``place`` says where each role runs
    (default: all on 127.0.0.1); the store's admin HTTP and its event feed bind the store
    master's address, the Conductor's HTTP API stays on the test's 127.0.0.1."""

    def __init__(self, conductor_args: tuple[str, ...] = (), timeout_s: float = 180.0, *,
                 prefill: int = 1, decode: int = 1, etcd: str = "",
                 place: Callable[[str], Place] = lambda role: Place()) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="yb-faults-"))
        self.timeout_s = timeout_s
        self.place = place
        self.instances = ([f"prefill-{i}" for i in range(prefill)]
                          + [f"decode-{i}" for i in range(decode)])
        self.roles = ("store-master", "store-node", *self.instances, "conductor")
        p = {k: free_port() for k in ("rpc", "events", "admin", "http", *self.instances)}
        ip = {r: place(r).ip for r in self.roles}
        self.master = master = f"tcp://{ip['store-master']}:{p['rpc']}"
        self.store_admin = f"http://{ip['store-master']}:{p['admin']}"
        self.url = f"http://127.0.0.1:{p['http']}"
        self.cluster = f"faults{os.getpid()}"
        """The cluster's name in etcd."""
        find = (("--etcd", etcd, "--cluster", self.cluster) if etcd else ())
        # batch-invariant: outputs under faults are compared with a reference run's
        inst = ("--model", MODEL, "--store-master", master, "--report-hz", "10",
                "--kv-cache-bytes", "16MiB", "--staging-bytes", "16MiB", "--batch-invariant",
                "--no-startup-profile", *find)
        self.args: dict[str, list[str]] = {
            "store-master": ["store", "master", "--rpc-address", master, "--events-address",
                             f"tcp://{ip['store-master']}:{p['events']}", "--admin-host",
                             ip["store-master"], "--admin-port", str(p["admin"]), *find],
            "store-node": ["store", "node", "--master", master, "--dram", "64MiB",
                           "--heartbeat-s", "0.5", "--tx-host", ip["store-node"],
                           *_host_id("--tx-host-id", place("store-node"))],
            "conductor": ["serve", "conductor", "--model", MODEL, "--port", str(p["http"]),
                          *(find or ("--instances", ",".join(
                              f"tcp://{ip[n]}:{p[n]}" for n in self.instances))),
                          "--store-events", f"tcp://{ip['store-master']}:{p['events']}",
                          "--store-admin", self.store_admin, "--heartbeat-timeout-s", "3",
                          *conductor_args],
        }
        self._inst = inst
        for n in self.instances:
            self._instance_args(n, p[n])
        self.procs: dict[str, CliProc] = {}
        self.starts: dict[str, int] = {}
        try:
            for role in self.roles:
                self.start(role)
            self.wait_joined()
        except BaseException:
            self.stop()
            raise

    def _instance_args(self, name: str, port: int) -> None:
        ip = self.place(name).ip
        self.args[name] = ["serve", name.split("-")[0], "--instance-id", name, "--host", ip,
                           "--control-port", str(port), *_host_id("--host-id", self.place(name)),
                           *self._inst]

    def add_instance(self, role: str) -> str:
        """Start one more ``role`` instance (the next free name; only the Conductor of a rig
        with ``etcd`` finds it) and wait until it is ready. Returns its name."""
        name = next(f"{role}-{i}" for i in range(100) if f"{role}-{i}" not in self.args)
        self._instance_args(name, free_port())
        self.instances.append(name)
        self.roles = (*self.roles[:-1], name, self.roles[-1])
        self.start(name)
        return name

    def remove_instance(self, name: str) -> None:
        """Stop (SIGTERM) an instance for good: it leaves discovery and the Conductor."""
        self.procs.pop(name).stop()
        self.instances.remove(name)
        self.roles = tuple(r for r in self.roles if r != name)

    def start(self, role: str) -> CliProc:
        """Start (or restart) ``role`` with its fixed arguments; blocks until it is ready."""
        n = self.starts[role] = self.starts.get(role, 0) + 1
        self.procs[role] = CliProc(["-v", *self.args[role]], name=f"{role}.{n}",
                                   workdir=self.dir, timeout_s=self.timeout_s, stop_s=15.0,
                                   log_tail=6000, prefix=self.place(role).prefix)
        return self.procs[role]

    def pid(self, role: str) -> int:
        return self.procs[role].proc.pid

    def kill(self, role: str) -> None:
        self.procs[role].kill()

    def signal(self, role: str, sig: int) -> None:
        if self.procs[role].proc.poll() is None:
            os.kill(self.pid(role), sig)

    def health(self) -> dict[str, Any]:
        return get_json(self.url + "/health")

    def store_usage(self) -> dict[str, float]:
        return get_json(self.store_admin + "/usage")

    def wait_joined(self, timeout_s: float = 60.0) -> None:
        """Until the Conductor's view holds every instance with load reports from its
        current process (a restarted one's reports carry its new incarnation)."""
        end = time.monotonic() + timeout_s
        want = {n: self.procs[n].info["incarnation"] for n in self.instances}
        while True:
            with contextlib.suppress(OSError, ValueError):
                h = self.health()
                if h["ready"] and {n: v["incarnation"] for n, v in h["load"].items()} == want:
                    return
            if time.monotonic() > end:
                raise RuntimeError(f"instances did not join in {timeout_s}s\n"
                                   + self.procs["conductor"].log())
            time.sleep(0.2)

    def levels(self) -> dict[str, Any]:
        """What must return to its baseline once the load is gone: per instance free and
        reserved KV blocks and running requests, requests in flight at the Conductor, the
        store's objects and pending puts. (The store's used bytes also count its clients'
        reserve-ahead regions, which come and go: `store_accounting`.)"""
        h = self.health()
        u = self.store_usage()
        out: dict[str, Any] = {"inflight": h["inflight"]}
        for name, load in sorted(h["load"].items()):
            out[f"{name}.free_blocks"] = load["free_blocks"]
            out[f"{name}.reserved_blocks"] = load.get("reserved_blocks", 0)
            out[f"{name}.running"] = load["running"]
        for k in ("objects", "pending"):
            out[f"store.{k}"] = u.get(k)
        return out

    def store_accounting(self) -> tuple[float, int, int]:
        """The store's allocated DRAM bytes, its objects and its reserve-ahead reservations
        (every object and reservation of this workload has one size: a 256-token block)."""
        u = self.store_usage()
        return float(u["dram_used"]), int(u["objects"]), int(u["reservations"])

    def logs(self) -> str:
        return "\n".join(f"=== {r}\n{p.log()}" for r, p in self.procs.items())

    def stop(self) -> None:
        for role in reversed(self.procs):
            p = self.procs.get(role)
            if p is not None:
                with contextlib.suppress(ProcessLookupError):
                    self.signal(role, signal.SIGCONT)  # a stopped process cannot stop
                p.stop()
        from yuebing.transfer.liveness import sweep_dead_segments

        sweep_dead_segments()


class Outcome(enum.IntEnum):
    OK = 0
    ERROR_STATUS = 1  # an HTTP error status with an OpenAI error body
    ERROR_EVENT = 2  # an SSE error event, then [DONE]
    CONN_ERROR = 3  # refused / reset before any byte of a response
    CUT = 4  # the stream ended without [DONE] (the server's process died)
    HANG = 5  # no end within the deadline


@dataclass(frozen=True)
class Result:
    prompt: int
    start: float
    end: float
    outcome: Outcome
    tokens: tuple[int, ...] = ()
    detail: str = ""


def one_request(url: str, prompt: int, deadline_s: float) -> Result:
    """One streamed greedy completion of ``PROMPTS[prompt]``; never raises, never outlives
    ``deadline_s`` by more than one socket read (bounded by the same deadline)."""
    t0 = time.monotonic()
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=deadline_s)
    body = {"model": MODEL, "prompt": PROMPTS[prompt], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}

    def done(o: Outcome, tokens: tuple[int, ...] = (), detail: str = "") -> Result:
        conn.close()
        end = time.monotonic()
        if end - t0 > deadline_s:
            o, detail = Outcome.HANG, f"{o.name} after {end - t0:.1f}s: {detail}"
        return Result(prompt, t0, end, o, tokens, detail[:300])

    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
    except TimeoutError as e:
        return done(Outcome.HANG, detail=str(e))
    except OSError as e:
        return done(Outcome.CONN_ERROR, detail=repr(e))
    if resp.status != 200:
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            return done(Outcome.CUT, detail=repr(e))
        return done(Outcome.ERROR_STATUS, detail=f"{resp.status} {raw[:200]!r}")
    tokens: list[int] = []
    error = ""
    try:
        for raw_line in resp:
            line = raw_line.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                if error:
                    return done(Outcome.ERROR_EVENT, detail=error)
                return done(Outcome.OK, tuple(tokens))
            chunk = json.loads(data)
            if "error" in chunk:
                error = json.dumps(chunk["error"])
                continue
            tokens.extend(chunk["choices"][0]["token_ids"])
    except TimeoutError as e:
        return done(Outcome.HANG, detail=str(e))
    except (OSError, http.client.HTTPException, ValueError) as e:
        return done(Outcome.CUT, detail=repr(e))
    return done(Outcome.CUT, detail="stream closed without [DONE]")


class Load:
    """``workers`` threads, each sending `one_request` after another (prompts round-robin)
    until `stop`; `results` holds every request's `Result`."""

    def __init__(self, url: str, workers: int = 3, deadline_s: float = 30.0) -> None:
        self.url = url
        self.deadline_s = deadline_s
        self.results: list[Result] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True)
                         for w in range(workers)]
        for t in self._threads:
            t.start()

    def _run(self, w: int) -> None:
        i = w
        while not self._stop.is_set():
            r = one_request(self.url, i % len(PROMPTS), self.deadline_s)
            self.results.append(r)
            i += 1
            if r.outcome != Outcome.OK:
                time.sleep(0.2)  # a client's pause before it retries a failed request

    def stop(self) -> list[Result]:
        """Stop sending; wait for the requests in flight (each ends by its deadline)."""
        self._stop.set()
        for t in self._threads:
            t.join(self.deadline_s + 5.0)
        assert not any(t.is_alive() for t in self._threads), "a client outlived its deadline"
        return list(self.results)


def reference(url: str, deadline_s: float = 30.0) -> dict[int, tuple[int, ...]]:
    """The greedy output of every prompt, one request at a time (all must succeed)."""
    out: dict[int, tuple[int, ...]] = {}
    for i in range(len(PROMPTS)):
        r = one_request(url, i, deadline_s)
        assert r.outcome == Outcome.OK and len(r.tokens) == MAX_TOKENS, r
        out[i] = r.tokens
    return out


def first_success(url: str, since: float, timeout_s: float) -> float:
    """Seconds from ``since`` until a fresh request succeeds (probing every 0.2 s)."""
    end = time.monotonic() + timeout_s
    while True:
        r = one_request(url, 0, 10.0)
        if r.outcome == Outcome.OK:
            return r.end - since
        assert time.monotonic() < end, f"not served again within {timeout_s}s: {r}"
        time.sleep(0.2)


def wait_levels(rig: Rig, want: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Poll `Rig.levels` until it equals ``want``; returns the last levels seen."""
    end = time.monotonic() + timeout_s
    got: dict[str, Any] = {}
    while time.monotonic() < end:
        with contextlib.suppress(OSError, ValueError, KeyError):
            got = rig.levels()
            if got == want:
                return got
        time.sleep(0.25)
    return got
