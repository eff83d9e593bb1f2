#!/usr/bin/env bash
# Side-by-side: yuebing store vs the original Mooncake Store (PyPI wheel, ../shared/peers/),
# same sizes and methodology, interleaved per value size (original, then ours) in one
# invocation so both see the same machine load; then a comparison report with plots.
#
#   bash benchmarks/store_vs_mooncake.sh [OUTDIR]     (default ./storebench-out)
#
# Env: SIZES (64KiB,1MiB,4MiB,16MiB), RUNS (3), ROUNDS (1), PEERS (../shared/peers),
#      IMG (docs/img), YB_ARGS (extra flags for yuebing bench store, e.g. --no-checksum: the
#      original has none).
# ROUNDS > 1 repeats the whole interleaved comparison into OUTDIR/r1, r2, ...; the report takes
# each cell's median over the rounds on each side (drifts of machine load between the two
# systems' turns then cancel out instead of deciding a ratio) and shows the per-round range.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
OUT="${1:-./storebench-out}"
SIZES="${SIZES:-64KiB,1MiB,4MiB,16MiB}"
RUNS="${RUNS:-3}"
PEERS="${PEERS:-$REPO/../shared/peers}"
IMG="${IMG:-$REPO/docs/img}"
ROUNDS="${ROUNDS:-1}"
for ((R = 1; R <= ROUNDS; R++)); do
  DIR="$OUT"; [[ $ROUNDS -gt 1 ]] && DIR="$OUT/r$R"
  first=1
  for S in ${SIZES//,/ }; do
    mkdir -p "$DIR/$S/mc"
    echo "# [round $R/$ROUNDS, $S] original: run_mooncake_store.sh (single_memcpy, remote_tcp)" >&2
    RUNS="$RUNS" SIZES="$S" MC_VARIANTS="single_memcpy remote_tcp" SEGMENT=2GiB \
      bash "$PEERS/run_mooncake_store.sh" "$DIR/$S/mc" >"$DIR/$S/mc.log" 2>&1
    META=(--skip-meta); [[ $first == 1 ]] && META=(); first=0
    echo "# [round $R/$ROUNDS, $S] yuebing bench store --sizes $S --runs $RUNS ${META[*]:-} --json" >&2
    # shellcheck disable=SC2086
    "$REPO/.venv/bin/yuebing" bench store --sizes "$S" --runs "$RUNS" "${META[@]}" ${YB_ARGS:-} \
      --json --out "$DIR/$S/yuebing_store.json" >/dev/null
  done
done
"$REPO/.venv/bin/python" "$HERE/store_compare.py" "$OUT" --img "$IMG"
