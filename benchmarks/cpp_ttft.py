"""TTFT of one long prompt on one prefill instance vs a pipeline group of stages (issue 27).

Starts a decode instance, one whole-model prefill instance and ``--stages`` stage instances
(``--layers`` equal shares, ``--cpp-group bench``), each with ``--threads`` threads and the same
pinned attention kernels (`PINNED`), all on this host; answers a short warm-up prompt on each path (not timed), then one ``--tokens``-token prompt
of random ids, greedy, ``--max-tokens`` tokens, first through the single instance, then through
the group (a different prompt each time: nothing cached). TTFT is from the submit to the first
token's event at the client (the instances' own clocks are not used). Prints JSON with
`yuebing bench instance`-style keys: both TTFTs, their ratio, whether the two outputs (each
against the other path's on the same prompt) are equal, the load average before and after, the
single instance's engine signature (``engine``: cpp_sim_vs_live.py checks the profile's against it).

Usage:  PYTHONPATH=src .venv/bin/python benchmarks/cpp_ttft.py [--tokens 4096] [--stages 2]
        [--threads 1] [--model smollm2] [--max-tokens 8] [--step-trace-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from yuebing.instance.client import InstanceClient
from yuebing.ops.procs import ReadyProcess, stop_all, yuebing_argv
from yuebing.protocol.instance import EventKind, Sampling, StagePlan, SubmitTask, TaskMode


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


PINNED = ("--attention", "paged", "--prefill-attention", "sdpa")
"""Every process runs the same attention kernels: chosen by timing at start (the default), two
processes on a loaded machine may pick different ones, and their bits (so greedy tokens after a
while) differ whatever the path."""


def start(role: str, model: str, threads: int, *extra: str) -> ReadyProcess:
    return ReadyProcess(yuebing_argv(["serve", role, "--model", model, "--threads",
                                      str(threads), "--no-startup-profile", "--no-lend-cores",
                                      *PINNED, *extra]), name=role, timeout_s=600)


def trace_flags(args: argparse.Namespace, name: str) -> tuple[str, ...]:
    """``--step-trace-dir`` for an instance (its file: ``DIR/<instance id>.steps.jsonl``)."""
    return ("--step-trace-dir", args.step_trace_dir, "--instance-id", name) \
        if args.step_trace_dir else ()


async def run_one(prefills: list[tuple[InstanceClient, str]], d: InstanceClient, rid: str,
                  ids: list[int], sampling: Sampling) -> tuple[float, list[int]]:
    """(TTFT seconds, every token) of one request through ``prefills`` (one instance, or a
    group's stages with their segments) and the decode."""
    r = await d.reserve(rid, ids, sampling, timeout_s=900)
    n = len(prefills)
    t0 = time.perf_counter()
    for i, (c, _) in enumerate(prefills):
        plan = None if n == 1 else StagePlan(
            index=i, count=n, next_segment=prefills[i + 1][1] if i + 1 < n else "")
        await c.submit(SubmitTask(seq=0, request_id=rid, token_ids=ids, sampling=sampling,
                                  mode=TaskMode.PREFILL, decode=r.target, stage=plan))
    tokens: list[int] = []
    ttft = 0.0
    async for ev in prefills[-1][0].events(rid):
        if ev.kind == EventKind.ERROR:
            raise RuntimeError(ev.error)
        if ev.token_ids and not tokens:
            ttft = time.perf_counter() - t0
        tokens += ev.token_ids
    for c, _ in prefills[:-1]:
        async for ev in c.events(rid):
            if ev.kind == EventKind.ERROR:
                raise RuntimeError(ev.error)
    async for ev in d.events(rid):
        if ev.kind == EventKind.ERROR:
            raise RuntimeError(ev.error)
        tokens += ev.token_ids
    return ttft, tokens


async def bench(args: argparse.Namespace, procs: dict[str, ReadyProcess]) -> dict[str, object]:
    clients = {k: InstanceClient(p.info["control_address"]) for k, p in procs.items()}
    for c in clients.values():
        await c.subscribe()
    stages = [(clients[f"stage{i}"], str(procs[f"stage{i}"].info["stage_segment"]))
              for i in range(args.stages)]
    single = [(clients["single"], "")]
    d = clients["decode"]
    sampling = Sampling(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rng = random.Random(27)
    vocab = int(args.vocab)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]
    for path, name in ((single, "w1"), (stages, "w2")):  # warm-up, not timed
        await run_one(path, d, name, prompt(64), sampling)
    p1, p2 = prompt(args.tokens), prompt(args.tokens)
    t_single, out_single = await run_one(single, d, "s1", p1, sampling)
    t_group, out_group = await run_one(stages, d, "g2", p2, sampling)
    # the same prompts the other way round: greedy outputs must agree per prompt
    _, out_group_p1 = await run_one(stages, d, "g1", p1, sampling)
    _, out_single_p2 = await run_one(single, d, "s2", p2, sampling)
    for c in clients.values():
        await c.close()
    return {"tokens": args.tokens, "stages": args.stages, "threads": args.threads,
            "model": args.model, "ttft_single_s": round(t_single, 3),
            "ttft_group_s": round(t_group, 3), "group_over_single": round(t_group / t_single, 3),
            "same_tokens": out_single == out_group_p1 and out_group == out_single_p2,
            "tokens_single_group": [[out_single, out_group_p1], [out_single_p2, out_group]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--layers", type=int, default=30, help="the model's layer count")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--step-trace-dir", default="",
                    help="each instance writes its engine steps to DIR/<name>.steps.jsonl "
                         "(single, stage0, ...): cpp_sim_vs_live.py --live-steps sets each "
                         "chunk's time beside the profile's")
    args = ap.parse_args()
    k, n = args.stages, args.layers
    procs: dict[str, ReadyProcess] = {}
    try:
        procs["decode"] = start("decode", args.model, args.threads)
        procs["single"] = start("prefill", args.model, args.threads,
                                *trace_flags(args, "single"))
        for i in range(k):
            procs[f"stage{i}"] = start("prefill", args.model, args.threads, "--layers",
                                       f"{n * i // k}:{n * (i + 1) // k}", "--cpp-group", "bench",
                                       *trace_flags(args, f"stage{i}"))
        before = loadavg()
        out = asyncio.run(bench(args, procs))
        out.update(loadavg_before=before, loadavg_after=loadavg(), attention={
            k: f"{p.info['engine']['attention']}/{p.info['engine']['prefill_attention']}"
            for k, p in procs.items()}, engine=procs["single"].info["engine"])
        print(json.dumps(out, indent=2))
    finally:
        stop_all(procs.values())


if __name__ == "__main__":
    main()
