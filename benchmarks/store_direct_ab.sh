#!/usr/bin/env bash
# Same-host store path, A/B in one invocation: the client's direct shared-memory copy (default)
# vs every byte through the transfer engine (--no-direct), interleaved per size and run so both
# see the same machine load. Prints a markdown table (median GB/s of the rounds, ratio).
#
#   bash benchmarks/store_direct_ab.sh [OUTDIR]        (default ./storedirect-out)
#
# Env: SIZES (1MiB,4MiB,16MiB), ROUNDS (2), PAIRS (zc,zcbatch), RUNS (2, per bench call).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
OUT="${1:-./storedirect-out}"
SIZES="${SIZES:-1MiB,4MiB,16MiB}"
ROUNDS="${ROUNDS:-2}"
PAIRS="${PAIRS:-zc,zcbatch}"
RUNS="${RUNS:-2}"
mkdir -p "$OUT"
for R in $(seq 1 "$ROUNDS"); do
  for S in ${SIZES//,/ }; do
    for MODE in direct engine; do
      FLAG=(); [[ $MODE == engine ]] && FLAG=(--no-direct)
      echo "# round $R [$S] $MODE" >&2
      "$REPO/.venv/bin/yuebing" bench store --paths same_host --sizes "$S" --pairs "$PAIRS" \
        --runs "$RUNS" --skip-meta --no-checksum --warm-bytes 256MiB "${FLAG[@]}" --json \
        --out "$OUT/$MODE-$S-$R.json" >/dev/null
    done
  done
done
"$REPO/.venv/bin/python" - "$OUT" <<'PY'
import json, statistics, sys
from collections import defaultdict
from pathlib import Path
cells = defaultdict(list)
for f in sorted(Path(sys.argv[1]).glob("*.json")):
    mode = f.name.split("-")[0]
    for r in json.loads(f.read_text()):
        cells[(r["op"], r["size_bytes"], mode)].append(r["gbps"])
print("| op | size | direct GB/s | engine GB/s | ratio |\n|---|---|---|---|---|")
for op, size in sorted({(o, s) for o, s, _ in cells}, key=lambda k: (k[1], k[0])):
    d, e = (statistics.median(cells[(op, size, m)]) for m in ("direct", "engine"))
    print(f"| {op} | {size >> 20} MiB | {d:.2f} | {e:.2f} | {d / e:.2f}x |")
PY
