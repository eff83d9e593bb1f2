"""Native CPU kernels vs the torch path, side by side in one process (decode steps).

Variants share the loaded weights, dtype and thread count:

- ``torch``   — ``kernels=torch``, grouped-matmul decode attention (the path before the kernels);
- ``ops``     — ``kernels=native`` (fused RMSNorm/add, RoPE+KV write, SiLU·mul), grouped attention;
- ``native``  — ``kernels=native`` and the native paged decode attention.

At each batch size every variant gets the same number of decoding requests (prompt
``--prompt-len`` tokens), then their decode steps are interleaved (A, B, C, A, B, C, ...) so load
from other processes hits all alike; wall-time and process-CPU medians per step. Writes JSON,
prints a Markdown table, and plots a PNG. Run under the shared bench lock:

    flock /tmp/yb-bench.lock .venv/bin/python benchmarks/engine_kernels.py --threads 2 \
        --out reports/engine_kernels.json --plot docs/img/engine_kernels.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.profile import _Tokens, interleaved_decode
from yuebing.engine.weights import load_weights

VARIANTS = {"torch": ("torch", "grouped"), "ops": ("native", "grouped"),
            "native": ("native", "paged")}


def _engines(ns: argparse.Namespace) -> dict[str, LLMEngine]:
    weights = load_weights(ns.model, 0)
    out = {}
    for label in ns.variants:
        kernels, attention = VARIANTS[label]
        cfg = EngineConfig(model=ns.model, dtype=ns.dtype, attention=attention,
                           prefill_attention="grouped", kernels=kernels, threads=ns.threads,
                           batch_invariant=False,
                           max_num_seqs=max(ns.batches), max_batch_tokens=2048,
                           num_blocks=max(ns.batches) * (ns.prompt_len + ns.steps + 32) // 16 + 64)
        out[label] = eng = LLMEngine(cfg, weights=weights)
        eng.warmup()
    return out



def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(report["decode"])
    labels = list(report["variants"])
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, label in enumerate(labels):
        ax.bar([j + width * i for j in range(len(batches))],
               [report["decode"][b][label]["wall_ms"] for b in batches], width, label=label)
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(batches))], batches)
    ax.set(xlabel="decode batch", ylabel="ms per step (wall, median)",
           title=f"decode step: torch ops vs native kernels ({report['dtype']}, "
                 f"{report['threads']} threads, prompt {report['prompt_len']})")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(report: dict) -> str:
    labels = report["variants"]
    lines = ["| decode batch | " + " | ".join(f"{v} ms/step" for v in labels) +
             " | torch/native |", "|---" * (len(labels) + 2) + "|"]
    for b, r in report["decode"].items():
        cells = " | ".join(f"{r[v]['wall_ms']:.1f}" for v in labels)
        ratio = (f"{r['torch']['wall_ms'] / r[labels[-1]]['wall_ms']:.2f}×"
                 if "torch" in r and labels[-1] != "torch" else "")
        lines.append(f"| {b} | {cells} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--plot", default=None, help="write a PNG here")
    ns = p.parse_args()
    unknown = [v for v in ns.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    from rich.progress import track

    engines = _engines(ns)
    tokens = _Tokens(next(iter(engines.values())).model_config.vocab_size, seed=1)
    report: dict = {"model": ns.model, "dtype": ns.dtype, "threads": torch.get_num_threads(),
                    "prompt_len": ns.prompt_len, "steps": ns.steps, "variants": ns.variants,
                    "load_avg": list(__import__("os").getloadavg()), "decode": {}}
    for b in track(ns.batches, description="decode steps"):
        report["decode"][b] = interleaved_decode(engines, b, ns.prompt_len, ns.steps, tokens)
    print(_table(report))
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(report, indent=1), encoding="utf-8")
    if ns.plot:
        _plot(report, ns.plot)


if __name__ == "__main__":
    main()
