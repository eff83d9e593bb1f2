#!/usr/bin/env bash
# Side-by-side: yuebing store vs the original Mooncake Store (PyPI wheel, ../shared/peers/),
# same sizes and methodology, one after the other in one invocation, then a comparison report.
#
#   bash benchmarks/store_vs_mooncake.sh [OUTDIR]     (default ./storebench-out)
#
# Env: SIZES (64KiB,1MiB,4MiB,16MiB), RUNS (3), PEERS (../shared/peers).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
OUT="${1:-./storebench-out}"
SIZES="${SIZES:-64KiB,1MiB,4MiB,16MiB}"
RUNS="${RUNS:-3}"
PEERS="${PEERS:-$REPO/../shared/peers}"
mkdir -p "$OUT/mc"
echo "# yuebing bench store --sizes $SIZES --runs $RUNS" >&2
"$REPO/.venv/bin/yuebing" bench store --sizes "$SIZES" --runs "$RUNS" --json \
  --out "$OUT/yuebing_store.json" >/dev/null
echo "# original: run_mooncake_store.sh (single_memcpy, remote_tcp)" >&2
RUNS="$RUNS" SIZES="$SIZES" MC_VARIANTS="single_memcpy remote_tcp" SEGMENT=2GiB \
  bash "$PEERS/run_mooncake_store.sh" "$OUT/mc" >&2
"$REPO/.venv/bin/python" "$HERE/store_compare.py" "$OUT" --img "$REPO/docs/img"
