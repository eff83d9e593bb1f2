"""Engine hot path before/after, side by side in one process: oneDNN-packed matmul weights
(``packed_weights=True``, the default) vs plain ``F.linear`` (``packed_weights=False``).

Both engines share the loaded weights and run the same dtype / attention / thread count. Decode
steps of the two engines are interleaved (A, B, A, B, ...) at each batch size and prefills
alternate too, so load from other processes hits both alike; times are process CPU time (and
wall) medians. Writes JSON, prints a table, and plots a PNG.

    .venv/bin/python benchmarks/engine_hotpath.py --threads 1 \
        --out reports/engine_hotpath.json --plot docs/img/engine_hotpath.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.profile import _Tokens, interleaved_decode, time_prefill
from yuebing.engine.weights import load_weights

LABELS = ("plain", "packed")


def _engines(ns: argparse.Namespace) -> dict[str, LLMEngine]:
    weights = load_weights(ns.model, 0)
    out = {}
    for label in LABELS:
        cfg = EngineConfig(model=ns.model, dtype=ns.dtype, attention=ns.attention,
                           threads=ns.threads, max_num_seqs=max(ns.batches),
                           max_batch_tokens=max(ns.prefill_lens + [max(ns.batches)]),
                           packed_weights=label == "packed", batch_invariant=False)
        out[label] = eng = LLMEngine(cfg, weights=weights)
        eng.warmup()
    return out



def prefill(engines: dict[str, LLMEngine], n: int, repeats: int,
            tokens: _Tokens) -> dict[str, dict[str, float]]:
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in engines}
    for _ in range(repeats):
        for k, e in engines.items():
            t = time_prefill(e, n, 0, tokens)
            samples[k].append((t.wall, t.cpu))
    return {k: {"wall_tok_s": n / statistics.median(s[0] for s in v),
                "cpu_tok_s": n / statistics.median(s[1] for s in v)} for k, v in samples.items()}


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    batches = list(report["decode"])
    lens = list(report["prefill"])
    for i, label in enumerate(LABELS):
        axes[0].bar([j + 0.4 * i for j in range(len(batches))],
                    [report["decode"][b][label]["cpu_ms"] for b in batches], 0.4, label=label)
        axes[1].bar([j + 0.4 * i for j in range(len(lens))],
                    [report["prefill"][n][label]["cpu_tok_s"] for n in lens], 0.4, label=label)
    axes[0].set_xticks([j + 0.2 for j in range(len(batches))], batches)
    axes[0].set(xlabel="decode batch", ylabel="ms per step (process CPU)", title="decode step")
    axes[1].set_xticks([j + 0.2 for j in range(len(lens))], lens)
    axes[1].set(xlabel="prompt tokens", ylabel="tokens/s (process CPU)", title="prefill")
    for ax in axes:
        ax.legend()
    fig.suptitle(f"engine hot path: plain F.linear vs oneDNN-packed weights "
                 f"({report['dtype']}, {report['threads']} thread(s))")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention", default="grouped")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--prefill-lens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[512, 2048])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--plot", default=None, help="write a PNG here")
    ns = p.parse_args()
    from rich.progress import track

    engines = _engines(ns)
    tokens = _Tokens(engines["plain"].model_config.vocab_size, seed=1)
    report: dict = {"model": ns.model, "dtype": ns.dtype, "attention": ns.attention,
                    "threads": torch.get_num_threads(), "prompt_len": ns.prompt_len,
                    "decode": {}, "prefill": {}}
    work = [("decode", b) for b in ns.batches] + [("prefill", n) for n in ns.prefill_lens]
    for kind, size in track(work, description="plain vs packed"):
        if kind == "decode":
            report["decode"][size] = interleaved_decode(engines, size, ns.prompt_len, ns.steps, tokens)
        else:
            report["prefill"][size] = prefill(engines, size, ns.repeats, tokens)
    print("| measure | plain F.linear | packed | speed-up |\n|---|---|---|---|")
    for b, r in report["decode"].items():
        a, c = r["plain"]["cpu_ms"], r["packed"]["cpu_ms"]
        print(f"| decode b={b} ms/step CPU (wall) | {a:.1f} ({r['plain']['wall_ms']:.1f}) | "
              f"{c:.1f} ({r['packed']['wall_ms']:.1f}) | {a / c:.2f}× |")
    for n, r in report["prefill"].items():
        a, c = r["plain"]["cpu_tok_s"], r["packed"]["cpu_tok_s"]
        print(f"| prefill {n} tok/s CPU (wall) | {a:.0f} ({r['plain']['wall_tok_s']:.0f}) | "
              f"{c:.0f} ({r['packed']['wall_tok_s']:.0f}) | {c / a:.2f}× |")
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(report, indent=1), encoding="utf-8")
    if ns.plot:
        _plot(report, ns.plot)


if __name__ == "__main__":
    main()
