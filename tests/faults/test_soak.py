"""Soak (issue 16): ``yuebing serve`` (store master + node, one prefill, one decode, the
Conductor; ``--model dummy:preset=tiny``) serves a slice of the released conversation trace
(`yuebing bench serve`, prompts synthesized from its ``hash_ids`` so that shared prefixes are
shared), replayed closed-loop round after round (2 in flight; 8 during the warm-up) for
``$YUEBING_SOAK_S`` seconds (120 by default; the 30-minute variant sets 1800). Every process
of the cluster is sampled from /proc after each round: resident memory, open files, threads,
and the bytes of /dev/shm its shared-memory segments occupy. After the warm-up (the first
quarter, at least one whole round), every sample stays within 5 % of the warm-up level (a
count of threads or files within max(5 %, 1)); every round's requests all succeed. Slow: two
minutes of load do not fit the CI budget of the fast set.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from faultrig import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from serve_util import Serve, descendants  # noqa: E402

YUEBING = [sys.executable, "-m", "yuebing.cli.main"]
TOLERANCE = 0.05
CONCURRENCY = 2
WARM_CONCURRENCY = 8


@dataclass(frozen=True)
class Sample:
    rss: int
    files: int
    threads: int
    shm: int


def sample(pid: int) -> Sample | None:
    """One process's levels, or None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        files = len(os.listdir(f"/proc/{pid}/fd"))
        maps = Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss = int(fields["VmRSS"].split()[0]) * 1024
    threads = int(fields["Threads"])
    shm = 0
    for path in {ln.split(None, 5)[5] for ln in maps.splitlines()
                 if len(ln.split(None, 5)) == 6 and ln.split(None, 5)[5].startswith("/dev/shm/")}:
        try:
            shm += os.stat(path.removesuffix(" (deleted)")).st_blocks * 512
        except FileNotFoundError:
            continue
    return Sample(rss, files, threads, shm)


def out_of_band(level: Sample, s: Sample) -> list[str]:
    """What of ``s`` is more than 5 % (counts: max(5 %, 1)) away from ``level``."""
    bad = []
    for name in ("rss", "shm", "files", "threads"):
        want, got = getattr(level, name), getattr(s, name)
        slack = TOLERANCE * want if name in ("rss", "shm") else max(TOLERANCE * want, 1)
        if abs(got - want) > slack:
            bad.append(f"{name} {want} -> {got}")
    return bad


def _bench(url: str, trace: Path, limit: int, records: Path, concurrency: int) -> list[dict]:
    """One round: the trace's first ``limit`` requests, closed loop; returns
    the per-request records."""
    records.unlink(missing_ok=True)
    cmd = [*YUEBING, "bench", "serve", str(trace), "--endpoint", url, "--json",
           "--no-progress", "--limit", str(limit), "--concurrency", str(concurrency), "--block-tokens", "32",
           "--max-input", "900", "--max-output", "16", "--prompt-low", "1", "--prompt-high",
           "512", "--timeout-s", "60", "--records", str(records)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in records.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak_levels_stay_flat(tmp_path: Path, conversation_trace: Path) -> None:
    duration = float(os.environ.get("YUEBING_SOAK_S", "120"))
    port = free_port()
    serve = Serve(["serve", "--port", str(port), "--log-dir", str(tmp_path), "--model",
                   "dummy:preset=tiny", "--prefill", "1", "--decode", "1", "--store-dram", "64MiB",
                   "--kv-cache-bytes", "16MiB",
                   "--staging-bytes", "16MiB", "--heartbeat-timeout-s", "10"])
    url = f"http://127.0.0.1:{port}"
    try:
        serve.wait_for("Ctrl-C stops every process.")
        pids = sorted(descendants(serve.proc.pid) | {serve.proc.pid})
        start = time.monotonic()
        warm_until = start + max(duration / 4, 1.0)
        level: dict[int, Sample] = {}
        last: dict[int, Sample] = {}
        rounds = 0
        while time.monotonic() - start < duration or rounds < 2:
            warming = time.monotonic() < warm_until or rounds == 0
            # warm-up at a higher load, so that thread pools that grow on demand (the
            # default executor: up to min(32, CPUs + 4) threads) reach their steady size
            recs = _bench(url, conversation_trace, 40, tmp_path / "records.jsonl",
                          WARM_CONCURRENCY if warming else CONCURRENCY)
            rounds += 1
            failed = [r for r in recs
                      if r["status"] != "ok" or r["output_tokens"] != r["max_tokens"]]
            assert len(recs) == 40 and not failed, failed[:3]
            now = {p: sample(p) for p in pids}
            gone = [p for p, s in now.items() if s is None]
            assert not gone, f"processes {gone} died; {serve.output()[-3000:]}"
            if warming:
                level = {p: s for p, s in now.items() if s is not None}
                continue
            drift = {p: out_of_band(level[p], s) for p, s in now.items() if s is not None}
            assert not any(drift.values()), (rounds, {p: d for p, d in drift.items() if d})
            last = {p: s for p, s in now.items() if s is not None}
        _report(duration, rounds, {_role(p): (level[p], last.get(p, level[p])) for p in level})
    except BaseException:
        serve.kill()
        raise
    assert serve.stop(signal.SIGINT, timeout_s=120) == 0, serve.output()[-3000:]


def _role(pid: int) -> str:
    """A cluster process's role, from its command line."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    if "--instance-id" in args:
        return args[args.index("--instance-id") + 1]
    for a, b in zip(args, args[1:], strict=False):
        if (a, b) in (("store", "master"), ("store", "node"), ("serve", "conductor")):
            return f"{a}-{b}"
    return f"supervisor-{pid}" if "serve" in args else f"pid-{pid}"


def _report(duration: float, rounds: int, levels: dict[str, tuple[Sample, Sample]]) -> None:
    """With ``$YUEBING_SOAK_REPORT``: the warm-up and final levels of every process, as JSON
    (for docs/reliability.md)."""
    path = os.environ.get("YUEBING_SOAK_REPORT")
    if path:
        Path(path).write_text(json.dumps({"duration_s": duration, "rounds": rounds, "levels": {
            role: {"warm": vars(a), "end": vars(b)} for role, (a, b) in levels.items()}},
            indent=1))
