"""The native flash prefill kernel of this checkout vs a baseline build of its source, in one
process, on the same chunks: per-call ms of each, interleaved, medians of paired ratios.

The baseline's ``flash_prefill.cpp`` (with its headers, from ``--baseline DIR``) is compiled with
its namespace renamed (``-Dyuebing=yuebing_base``) into a small pybind module, so both builds live
in one process and each pair of calls (order alternating) sees the same load. Shapes default to
SmolLM2-135M (9 query heads, 3 kv heads, head_dim 64), bf16, one chunk of ``new`` tokens on top of
``cached`` ones in a shuffled paged pool; the outputs of the two builds are compared too.

    mkdir /tmp/b && git archive BASE src/yuebing/engine/csrc | tar -xC /tmp/b --strip-components=4
    .venv/bin/python benchmarks/flash_ab.py --baseline /tmp/b --cases 0+512,0+2048,0+8192
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils import cpp_extension

from yuebing.engine import native

_BIND = """
#include <torch/extension.h>
#include "common.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("flash", &yuebing::flash_prefill_attention);
  m.def("flash_amx", &yuebing::flash_prefill_attention_amx);
}
"""


def load_baseline(src: Path) -> Any:
    """The baseline's flash kernels as a Python module (``flash``, ``flash_amx``)."""
    h = hashlib.sha256(_BIND.encode() + " ".join(native.cflags()).encode())
    for name in ("common.h", "vec.h", "flash_prefill.cpp"):
        h.update(name.encode() + ((src / name).read_bytes() if (src / name).exists() else b""))
    build = native.cache_dir().parent / "flash_ab" / h.hexdigest()[:16]  # reused by later runs
    build.mkdir(parents=True, exist_ok=True)
    files = {n: (src / n).read_bytes() for n in ("common.h", "vec.h", "flash_prefill.cpp")
             if (src / n).exists()}
    files["bind.cpp"] = _BIND.encode()
    for name, data in files.items():  # rewritten only when missing: ninja goes by mtimes
        if not (build / name).exists() or (build / name).read_bytes() != data:
            (build / name).write_bytes(data)
    return cpp_extension.load(
        name="yuebing_flash_base", sources=[str(build / "flash_prefill.cpp"), str(build / "bind.cpp")],
        extra_cflags=[*native.cflags(), "-Dyuebing=yuebing_base"], extra_ldflags=list(native.LDFLAGS),
        extra_include_paths=[str(build)], build_directory=str(build), verbose=False)


def case(new: int, cached: int, ns: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """q, k_cache, v_cache, block_table of one chunk (random bf16, blocks of 16 shuffled)."""
    ctx, bs = new + cached, 16
    nb = -(-ctx // bs)
    g = torch.Generator().manual_seed(ctx)
    kc = torch.randn(nb + 4, ns.kv_heads, bs, ns.head_dim, generator=g).to(torch.bfloat16)
    vc = torch.randn(nb + 4, ns.kv_heads, bs, ns.head_dim, generator=g).to(torch.bfloat16)
    table = torch.randperm(nb + 4, generator=g)[:nb].contiguous()
    q = (torch.randn(new, ns.heads, ns.head_dim, generator=g) * ns.q_scale).to(torch.bfloat16)
    return q, kc, vc, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="directory with the baseline's csrc sources")
    ap.add_argument("--cases", default="0+512,0+2048,0+8192", help="cached+new, comma-separated")
    ap.add_argument("--op", default="flash_amx", choices=("flash", "flash_amx"))
    ap.add_argument("--rounds", type=int, default=15, help="pairs of calls per case")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--q-scale", type=float, default=1.0, help="query scale (peakier softmax)")
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                    help="cpu: the process's CPU time (robust to preemption on a busy host; with "
                    "--threads 1 it is the work itself)")
    ap.add_argument("--json", help="write the results here")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    if not (res := native.load()).ok:
        raise SystemExit(res.error)
    base = getattr(load_baseline(Path(ns.baseline)), ns.op)
    cur = getattr(torch.ops.yuebing, f"flash_prefill_attention{'_amx' if ns.op == 'flash_amx' else ''}")
    clock = time.perf_counter if ns.clock == "wall" else time.process_time
    rows = []
    print(f"{ns.op}, {ns.threads} threads, {ns.clock} clock | case | baseline ms | current ms | speed-up "
          "(median of paired ratios) [quartiles] | max |Δ| |")
    for spec in ns.cases.split(","):
        cached, new = (int(x) for x in spec.split("+"))
        q, kc, vc, table = case(new, cached, ns)
        args = (q, kc, vc, table, new + cached, ns.head_dim ** -0.5)
        diff = (base(*args).float() - cur(*args).float()).abs().max().item()
        times: dict[str, list[float]] = {"base": [], "cur": []}
        for r in range(ns.rounds + 1):
            order = (("base", base), ("cur", cur)) if r % 2 else (("cur", cur), ("base", base))
            for name, fn in order:
                t0 = clock()
                fn(*args)
                if r:  # round 0 warms up
                    times[name].append(clock() - t0)
        ratios = sorted(b / c for b, c in zip(times["base"], times["cur"], strict=True))
        qs = statistics.quantiles(ratios, n=4)
        row = {"case": spec, "base_ms": statistics.median(times["base"]) * 1e3,
               "cur_ms": statistics.median(times["cur"]) * 1e3,
               "speedup": statistics.median(ratios), "q1": qs[0], "q3": qs[2], "max_abs_diff": diff}
        rows.append(row)
        print(f"| {spec} | {row['base_ms']:.2f} | {row['cur_ms']:.2f} | {row['speedup']:.3f} "
              f"[{qs[0]:.3f}–{qs[2]:.3f}] | {diff:.3g} |")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"op": ns.op, "threads": ns.threads, "clock": ns.clock,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
