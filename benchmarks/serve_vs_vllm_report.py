"""Summary of a `benchmarks/serve_vs_vllm.sh OUTDIR` run: one JSON object and two plots.

Called by serve_vs_vllm.sh once every system has been swept (or by hand on an OUTDIR, plus the
OUTDIRs of later runs that swept more rates of the same systems). Reads each
``OUTDIR/<system>.json`` (the report of ``yuebing bench serve --sweep-rates ... --json``)
and, for the systems under the Conductor, its access log (``logs/<system>/conductor.log``, one line
per request with the per-request breakdown: queue, prefix load, prefill, transfer, decode wait),
and writes

- ``summary.json``: ``{"systems": {name: {"max_rate", "capacity", "sweep": [...],
  "breakdown": {...}}}, "ratio_max_rate_vs_vllm", "ratio_coupled_vs_vllm",
  "ratio_1p1d_vs_coupled", "ratio_vllm_1p1d_vs_vllm", "ratio_1p1d_vs_vllm_1p1d"}`` (issue 31:
  vLLM 1P1D under the Conductor over one coupled vLLM; yuebing's 1P1D over it) and for each
  ratio a ``..._above`` bound (where the first system
  met the 90 % target and the second met it at no swept rate: the ratio is more than the
  first's max rate over the second's lowest swept rate; else null); ``capacity`` is the
  attainment per TBT threshold (ms) at the system's max rate (at its lowest rate when no rate
  meets the target); each sweep row has the rate, attainment, TTFT/TBT p50/p90 and the
  completed/rejected/error counts;
- ``attainment_vs_rate.png`` (every system, TTFT <= 10 s and TBT <= the SLO_TBT, the 90 % target
  dashed) and ``capacity_vs_tbt.png`` (attainment over TBT thresholds at each system's max
  rate);

and prints the JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

from yuebing.conductor.stats import parse_log_line

log = logging.getLogger("serve_vs_vllm_report")

SYSTEMS = ("yuebing_1p1d", "yuebing_coupled", "vllm_cpu", "vllm_1p1d")
_FIELDS = ("prompt", "cached", "out", "ttft", "tbt", "queue", "prefix_load", "prefill",
           "transfer", "decode_wait")
"""The access line's fields averaged per rate (times in ms)."""
_COUNTS = {"prompt", "cached", "out"}


def access_breakdown(conductor_log: Path, completed: list[int],
                     rates: list[float]) -> dict[str, Any]:
    """Mean/p90 of each breakdown field per swept rate, from the Conductor's access log.

    The runs of a sweep do not overlap, so the successful lines come in run order: the k-th
    block of ``completed[k]`` lines belongs to ``rates[k]`` (a request dropped by a run cut
    short may still end at the server: the split is then approximate, which the ``lines``
    count shows).
    """
    rows = []
    for line in conductor_log.read_text(errors="replace").splitlines():
        fields = parse_log_line(line)
        if fields is not None and fields["status"] == 200 and "decode_wait" in fields:
            rows.append({k: float(fields[k]) * (1.0 if k in _COUNTS else 1e3) for k in _FIELDS})
    out: dict[str, Any] = {}
    starts = [sum(completed[:k]) for k in range(len(completed))]
    for k, rate in enumerate(rates):
        chunk = rows[starts[k]:starts[k] + completed[k]]
        if not chunk:
            continue
        stats: dict[str, Any] = {"lines": len(chunk)}
        for f in _FIELDS:
            vals = sorted(r[f] for r in chunk)
            stats[f] = {"mean": round(statistics.fmean(vals), 1),
                        "p90": round(vals[min(len(vals) - 1, int(0.9 * len(vals)))], 1)}
        out[str(rate)] = stats
    return out


def system_summary(rep: dict[str, Any]) -> dict[str, Any]:
    """Max rate, capacity at it, the TBT SLO that decided, and one row per swept rate of one
    system's `merged_report` (rows by rising rate whatever order the sweep ran in;
    ``cut_short`` where a run ended once it missed the target for certain: its attainment is
    then the bound it could not exceed)."""
    sweep = sorted(rep["sweep"], key=lambda s: s["rate"])
    rows = [{"rate": s["rate"], "attainment": s["summary"]["attainment"],
             "ttft_p50_s": s["summary"]["ttft_s"].get("p50"),
             "ttft_p90_s": s["summary"]["ttft_s"].get("p90"),
             "tbt_p50_s": s["summary"]["tbt_s"].get("p50"),
             "tbt_p90_s": s["summary"]["tbt_s"].get("p90"),
             "completed": s["summary"]["completed"], "rejected": s["summary"]["rejected"],
             "errors": s["summary"]["errors"], "capacity": s["summary"]["capacity"],
             "send_lag_max_s": (s["summary"].get("send_lag_s") or {}).get("max"),
             "cut_short": s["summary"].get("cut_short")}
            for s in sweep]
    best = rep.get("max_rate")
    at = next((r for r in rows if r["rate"] == best), rows[0] if rows else None)
    return {"max_rate": best, "capacity": at["capacity"] if at else {},
            "capacity_at_rate": at["rate"] if at else None,
            "slo_tbt_s": rep["slo_tbt_s"], "sweep": rows}


def answered_attainment(row: dict[str, Any]) -> float:
    """A cut-short run's attainment among the requests it answered before the cut."""
    cut = row["cut_short"]
    return (cut["answered"] - cut["missed"]) / cut["answered"] if cut["answered"] else 0.0


def plot(out: Path, systems: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tbt_ms = 1e3 * next(iter(systems.values()), {}).get("slo_tbt_s", 0.1)
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, s) in enumerate(systems.items()):
        line, = ax.plot([r["rate"] for r in s["sweep"]], [r["attainment"] for r in s["sweep"]],
                        ls=("-", "--", ":", "-.")[i % 4], label=name)
        for cut, marker in ((False, "o"), (True, "v")):  # ▼: a run cut short, "at most"
            pts = [r for r in s["sweep"] if bool(r.get("cut_short")) == cut]
            # cut runs share their bound (0.897 of 300): each later system's ▼ is drawn
            # smaller, so that the ones beneath stay visible
            ax.plot([r["rate"] for r in pts], [r["attainment"] for r in pts], ls="none",
                    marker=marker, ms=max(11 - 2.5 * i, 4) if cut else 6,
                    color=line.get_color())
            if cut:  # ○: the same runs' attainment among the requests they answered
                ax.plot([r["rate"] for r in pts], [answered_attainment(r) for r in pts],
                        ls="none", marker="o", mfc="none", color=line.get_color())
    if any(r.get("cut_short") for s in systems.values() for r in s["sweep"]):
        ax.plot([], [], ls="none", marker="v", color="gray",
                label="cut short: attainment at most this")
        ax.plot([], [], ls="none", marker="o", mfc="none", color="gray",
                label="cut short: attainment of those answered")
    ax.axhline(0.9, ls="--", c="gray")
    ax.set(xlabel="request rate (req/s, Poisson)",
           ylabel=f"SLO attainment (TTFT≤10 s, TBT≤{tbt_ms:g} ms)",
           ylim=(0, 1.02), title="SmolLM2-135M, 2 cores, conversation trace")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "attainment_vs_rate.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in systems.items():
        cap = s["capacity"]
        xs = sorted(cap, key=int)
        ax.plot([int(x) for x in xs], [cap[x] for x in xs], marker="o",
                label=f"{name} @ {s['capacity_at_rate']} req/s" + (
                    " (cut short: at most)" if any(r.get("cut_short") for r in s["sweep"]
                                                   if r["rate"] == s["capacity_at_rate"])
                    else ""))
    ax.axhline(0.9, ls="--", c="gray")
    ax.set(xlabel="TBT SLO (ms), TTFT ≤ 10 s", ylabel="SLO attainment", ylim=(0, 1.02))
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "capacity_vs_tbt.png", dpi=120)
    plt.close(fig)


def merged_report(name: str, dirs: list[Path]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``name``'s bench reports from ``dirs`` (one sweep continued over several runs of this
    script) as one: every swept rate, ``max_rate`` recomputed over all of them; and the
    access-log breakdown per rate. None when no dir has the system."""
    sweep: list[dict[str, Any]] = []
    breakdown: dict[str, Any] = {}
    target, tbt = 0.9, 0.1
    for d in dirs:
        path = d / f"{name}.json"
        if not path.is_file():
            continue
        rep = json.loads(path.read_text())
        target = rep.get("target_attainment", target)
        slo = rep.get("config", {}).get("slo_tbt", [0.1])[0]
        if sweep and slo != tbt:
            raise SystemExit(f"{path}: decided at TBT <= {slo} s, an earlier dir at {tbt} s")
        tbt = slo
        ran = rep["sweep"]  # in the order the runs were made
        clash = {r["rate"] for r in ran} & {r["rate"] for r in sweep}
        if clash:
            raise SystemExit(f"{path}: rate(s) {sorted(clash)} also swept in an earlier dir")
        sweep += ran
        clog = d / "logs" / name / "conductor.log"
        if clog.is_file():
            breakdown.update(access_breakdown(
                clog, [int(r["summary"]["completed"]) for r in ran], [r["rate"] for r in ran]))
    if not sweep:
        return None
    passed = [r["rate"] for r in sweep if r["summary"]["attainment"] >= target]
    return {"sweep": sweep, "max_rate": max(passed) if passed else None,
            "slo_tbt_s": tbt}, breakdown


def summarize(out: Path, more: list[Path] | None = None) -> dict[str, Any]:
    """The summary object of ``out`` (and of ``more`` dirs whose sweeps continue its own)."""
    systems: dict[str, dict[str, Any]] = {}
    for name in SYSTEMS:
        found = merged_report(name, [out, *(more or [])])
        if found is None:
            continue
        rep, breakdown = found
        s = system_summary(rep)
        if breakdown:
            s["breakdown_ms"] = breakdown
        systems[name] = s
    if not systems:
        raise SystemExit(f"{out}: no <system>.json reports")

    def ratio(a: str, b: str) -> float | None:
        x = systems.get(a, {}).get("max_rate")
        y = systems.get(b, {}).get("max_rate")
        return round(x / y, 3) if x and y else None

    def above(a: str, b: str) -> float | None:
        """Where ``a`` met the target and ``b`` missed it at every swept rate, ``b``'s max rate
        is below its lowest swept rate, so the ratio is more than ``a``'s max rate over it."""
        x = systems.get(a, {}).get("max_rate")
        if not x or b not in systems or systems[b].get("max_rate"):
            return None
        return round(x / min(r["rate"] for r in systems[b]["sweep"]), 3)

    pairs = {"ratio_max_rate_vs_vllm": ("yuebing_1p1d", "vllm_cpu"),
             "ratio_coupled_vs_vllm": ("yuebing_coupled", "vllm_cpu"),
             "ratio_1p1d_vs_coupled": ("yuebing_1p1d", "yuebing_coupled"),
             "ratio_vllm_1p1d_vs_vllm": ("vllm_1p1d", "vllm_cpu"),
             "ratio_1p1d_vs_vllm_1p1d": ("yuebing_1p1d", "vllm_1p1d")}
    out: dict[str, Any] = {"systems": systems}
    for key, (a, b) in pairs.items():
        out[key] = ratio(a, b)
        out[f"{key}_above"] = above(a, b)
    return out


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir", type=Path, help="the run's OUTDIR (summary and plots go here)")
    p.add_argument("more", nargs="*", type=Path,
                   help="OUTDIRs of later runs that swept other rates of the same systems (e.g. "
                        "SYSTEMS=yuebing_1p1d RATES=0.15): their rates join OUTDIR's")
    ns = p.parse_args()
    result = summarize(ns.outdir, ns.more)
    (ns.outdir / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    try:
        plot(ns.outdir, result["systems"])
    except Exception as e:  # a plot failure must not lose the numbers
        log.warning("plots not written: %s", e)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
