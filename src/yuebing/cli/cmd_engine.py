"""``yuebing generate``, ``yuebing profile`` and ``yuebing bench engine``: the inference engine
from the command line (engine flags are generated from `EngineConfig`)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from yuebing.cli.main import Command
from yuebing.core.config import add_config_args, config_from_args
from yuebing.core.errors import InputError


def _int_list(text: str, least: int = 0) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"expected integers >= {least}, got {text!r}")
    return values


def _pos_list(text: str) -> list[int]:
    return _int_list(text, least=1)


def _engine_config(ns: argparse.Namespace, **base: Any) -> Any:
    from yuebing.engine.config import EngineConfig

    return config_from_args(EngineConfig, ns, **base)


# ------------------------------------------------------------------------------- generate

def _add_generate(p: argparse.ArgumentParser) -> None:
    from yuebing.engine.config import EngineConfig

    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print timing to stderr")
    add_config_args(p, EngineConfig)


def _run_generate(ns: argparse.Namespace) -> int:
    import time

    from yuebing.engine.engine import LLMEngine
    from yuebing.engine.sampling import SamplingParams

    if ns.max_tokens < 1:
        raise InputError(f"--max-tokens must be >= 1 (a generate that produces nothing is a "
                         f"mistake), got {ns.max_tokens}")
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                            top_p=ns.top_p, top_k=ns.top_k, seed=ns.sample_seed,
                            stop=tuple(ns.stop))
    engine = LLMEngine(_engine_config(ns, num_blocks=0, kv_cache_bytes=256 << 20))
    t0 = time.perf_counter()
    first = None
    out = None
    for out in engine.stream(ns.prompt, params, chat=ns.chat):
        first = first or time.perf_counter()
        sys.stdout.write(out.text_delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if ns.stats and out is not None and first is not None:
        n = len(out.output_token_ids)
        dt = time.perf_counter() - first
        print(f"[{out.num_prompt_tokens} prompt tokens, {n} generated, "
              f"TTFT {1e3 * (first - t0):.0f} ms, "
              f"{(n - 1) / dt if n > 1 and dt > 0 else 0:.1f} tok/s, "
              f"finish={out.finish_reason}]", file=sys.stderr)
    return 0


# -------------------------------------------------------------------------------- profile

def _add_profile(p: argparse.ArgumentParser) -> None:
    from yuebing.engine.config import EngineConfig

    p.add_argument("--out", default="predictors.json", help="predictor file to write")
    p.add_argument("--samples", default=None, help="also write the raw samples JSON here")
    p.add_argument("--new-tokens", type=_pos_list, default=[16, 64, 256, 1024])
    p.add_argument("--cached-tokens", type=_int_list, default=[0, 256, 1024])
    p.add_argument("--batches", type=_pos_list, default=[1, 4, 16, 32])
    p.add_argument("--contexts", type=_pos_list, default=[256, 1024, 4096])
    p.add_argument("--long-prompt", type=int, default=0,
                   help="also time each chunk of a prompt of this many tokens as the engine "
                        "prefills it (chunk, tokens before it): the samples a long or CPP "
                        "prefill is timed with, e.g. the longest prompt served (0: off)")
    p.add_argument("--repeats", type=int, default=3,
                   help="measurements per grid point (the median is kept)")
    p.add_argument("--decode-degree", type=int, default=1, choices=(1, 2, 3),
                   help="degree of the decode step polynomial in (batch, context tokens); "
                        "2 or 3 follow a grid of 4+ batches x 4+ contexts more closely")
    p.add_argument("--interference", action="store_true",
                   help="also time decode steps alone vs beside a neighbour process prefilling "
                        "continuously, and prefill alone vs beside a neighbour decoding (same "
                        "engine config, as colocated live instances run); the slowdown factors "
                        "go into the --samples file (needed), read by the simulator's "
                        "--colocated mode")
    p.add_argument("--interference-decode", type=_pair_list, default=[(1, 1024), (4, 4096)],
                   help="decode points batch:context,... timed for --interference")
    p.add_argument("--interference-prefill", type=_pair_list, default=[(512, 0), (1024, 512)],
                   help="prefill points new:cached,... timed for --interference")
    p.add_argument("--interference-repeats", type=int, default=6,
                   help="alternating alone / shared rounds of --interference")
    add_config_args(p, EngineConfig)


def _pair_list(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        a, sep, b = item.partition(":")
        if not (sep and a.isdigit() and b.isdigit()) or int(a) < 1:
            raise argparse.ArgumentTypeError(f"expected A:B,... with integers A >= 1, B >= 0, "
                                             f"got {item!r}")
        out.append((int(a), int(b)))
    if not out:
        raise argparse.ArgumentTypeError("expected at least one A:B pair")
    return out


def _run_profile(ns: argparse.Namespace) -> int:
    from rich.progress import Progress

    from yuebing.conductor.policy.predictors import (
        DecodePredictor,
        Predictors,
        PrefillPredictor,
        TransferPredictor,
        save_predictors,
    )
    from yuebing.engine.engine import LLMEngine
    from yuebing.engine.interference import measure_interference
    from yuebing.engine.profile import profile_engine

    if ns.repeats < 1:
        raise InputError("--repeats must be >= 1")
    if ns.long_prompt < 0:
        raise InputError(f"--long-prompt must be >= 0, got {ns.long_prompt}")
    if ns.interference and not ns.samples:
        raise InputError("--interference writes its factors into the samples file: give "
                         "--samples PATH")
    grid = {(b, c) for b in ns.batches for c in ns.contexts if b <= c}
    for axis, values in (("batches", {b for b, _ in grid}), ("contexts", {c for _, c in grid})):
        if len(values) <= ns.decode_degree:
            raise InputError(f"--decode-degree {ns.decode_degree} needs at least "
                             f"{ns.decode_degree + 1} distinct --{axis} on the decode grid, got "
                             f"{sorted(values)}")
    batches = [*ns.batches, *(b for b, _ in ns.interference_decode)]
    # the step budget stays as given: it chunks long prompts, and instances run with it
    engine = LLMEngine(_engine_config(ns, max_num_seqs=max(batches)))
    total = len(ns.new_tokens) * len(ns.cached_tokens) + len(ns.batches) * len(ns.contexts) \
        + bool(ns.long_prompt)
    with Progress(transient=True) as bar:
        task = bar.add_task("profiling", total=total)

        def progress(label: str) -> None:
            bar.update(task, advance=1, description=label)

        samples = profile_engine(engine, ns.new_tokens, ns.cached_tokens, ns.batches,
                                 ns.contexts, ns.repeats, progress, ns.long_prompt)
        if ns.interference:
            samples.interference = measure_interference(
                engine, ns.interference_decode, ns.interference_prefill,
                ns.interference_repeats, progress)
    if ns.samples:
        Path(ns.samples).write_bytes(samples.to_json())
    prefill = PrefillPredictor.fit([(s.new_tokens, s.cached_tokens, s.seconds)
                                    for s in samples.prefill])
    decode = DecodePredictor.fit([(s.batch, s.context_tokens, s.seconds)
                                  for s in samples.decode], ns.decode_degree)
    source = f"yuebing profile: {samples.model} on {samples.device} ({samples.dtype}, " \
             f"{samples.threads} threads)"
    save_predictors(Predictors(prefill, decode, TransferPredictor(), source,
                               engine.signature()), ns.out)
    print(f"wrote {ns.out} ({len(samples.prefill)} prefill, {len(samples.decode)} decode samples)")
    for name, errors in (
            ("prefill", [prefill.predict(s.new_tokens, s.cached_tokens) / s.seconds - 1
                         for s in samples.prefill]),
            ("decode", [decode.predict(s.batch, s.context_tokens) / s.seconds - 1
                        for s in samples.decode])):
        worst = max(errors, key=abs)
        print(f"{name} fit vs its samples: mean |error| {statistics.fmean(map(abs, errors)):.1%}, "
              f"worst {worst:+.1%}")
    if samples.interference is not None:
        print(f"interference: decode x{samples.interference.decode_factor:.3f} beside a "
              f"prefill, prefill x{samples.interference.prefill_factor:.3f} beside a decode "
              f"(in {ns.samples})")
    return 0


# ---------------------------------------------------------------------------- bench engine

def _add_bench(p: argparse.ArgumentParser) -> None:
    from yuebing.engine.config import EngineConfig

    p.add_argument("--batches", type=_pos_list, default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per decoding sequence")
    p.add_argument("--prefill-lens", type=_pos_list, default=[512, 2048])
    p.add_argument("--variants",
                   default="bfloat16:invariant,bfloat16:auto,bfloat16:grouped,float32:grouped",
                   help="comma-separated dtype:attention[:threads] variants measured side by "
                        "side (threads default: --threads); attention 'invariant' is "
                        "batch-invariant mode, any other turns it off")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", default=None, help="write a PNG of decode step times here")
    add_config_args(p, EngineConfig)


def _run_bench(ns: argparse.Namespace) -> int:
    from dataclasses import asdict

    from rich.progress import Progress

    from yuebing.engine.bench import run_variant
    from yuebing.engine.weights import load_weights

    if ns.prompt_len < 1:
        raise InputError(f"--prompt-len must be >= 1, got {ns.prompt_len}")
    variants = _parse_variants(ns.variants)
    base = _engine_config(ns, batch_invariant=False)  # each variant says (attention invariant)
    weights = load_weights(base.model, base.weights_seed)
    results = []
    with Progress(transient=True, disable=ns.json) as bar:
        task = bar.add_task("bench", total=None)
        for variant in variants:
            results.append(run_variant(weights, base, variant, ns.batches, ns.prompt_len,
                                       ns.prefill_lens,
                                       lambda s: bar.update(task, description=s)))
    report = {"model": base.model, "threads": base.threads or "all",
              "prompt_len": ns.prompt_len, "variants": [asdict(r) for r in results]}
    if ns.plot:
        _plot(results, ns.batches, ns.plot)
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(results, ns.batches, ns.prefill_lens)
    return 0


def _parse_variants(text: str) -> list[tuple[str, str, int]]:
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].isdigit()):
            raise InputError(f"--variants items look like bfloat16:grouped or float32:sdpa:2, "
                             f"got {item!r}")
        out.append((parts[0], parts[1], int(parts[2]) if len(parts) == 3 else 0))
    if not out:
        raise InputError("--variants is empty")
    return out


def _print_table(results: list, batches: list[int], prefill_lens: list[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="yuebing engine")
    t.add_column("variant")
    for b in batches:
        t.add_column(f"decode b={b} ms wall/cpu")
    for n in prefill_lens:
        t.add_column(f"prefill {n} tok/s wall/cpu")
    t.add_column("paged/contig attn ms (b=max)")
    t.add_column("export/import GB/s (64 blk)")
    for r in results:
        bmax = max(batches)
        pg = r.paging[bmax]
        t.add_row(f"{r.dtype}/{r.attention}/{r.threads}t",
                  *[f"{r.decode_ms[b]:.1f}/{r.decode_cpu_ms[b]:.1f}" for b in batches],
                  *[f"{r.prefill_tok_s[n]:.0f}/{r.prefill_cpu_tok_s[n]:.0f}"
                    for n in prefill_lens],
                  f"{pg['paged_ms']:.1f}/{pg['contiguous_ms']:.1f} of {pg['step_ms']:.1f}",
                  f"{r.transfer.get('export_64_GBps', 0):.2f}/"
                  f"{r.transfer.get('import_64_GBps', 0):.2f}")
    Console().print(t)


def _plot(results: list, batches: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(1, len(results))
    for ax, attr, title in ((axes[0], "decode_ms", "wall"), (axes[1], "decode_cpu_ms", "process CPU")):
        for i, r in enumerate(results):
            ax.bar([j + i * width for j in range(len(batches))],
                   [getattr(r, attr)[b] for b in batches], width,
                   label=f"{r.dtype}/{r.attention}/{r.threads}t")
        ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(batches))],
                      [str(b) for b in batches])
        ax.set_xlabel("decode batch size")
        ax.set_ylabel(f"ms per decode step ({title} time)")
        ax.set_title(f"decode step, {title} time")
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


COMMANDS = [
    Command(("generate",), "generate text for one prompt, streaming tokens", _add_generate,
            _run_generate),
    Command(("profile",), "profile the engine and write the predictor file", _add_profile,
            _run_profile),
    Command(("bench", "engine"), "benchmark the inference engine (decode, prefill, paging, "
            "KV export/import)", _add_bench, _run_bench),
]
