#!/usr/bin/env bash
# Side by side, in one invocation: the original Mooncake Transfer Engine (its C++
# transfer_engine_bench over TCP, driven by ../shared/peers/run_transfer_engine_bench.sh, which
# installs the PyPI wheel on first use and runs under `unshare -n` on loopback) and
# `yuebing bench transfer` (TCP and shared memory, two processes), alternating ROUNDS times so
# both see the same machine load. Prints a comparison table with ratios and writes
#   OUT/compare.md, OUT/compare.json, OUT/img/*.png (our bandwidth vs size and vs lanes).
#
#   bash benchmarks/transfer_vs_mooncake.sh [OUT]      (default ./transfer-vs-mooncake)
# Env: ROUNDS (3), DURATION (whole seconds per cell, 1), SIZES ("64KiB,1MiB,4MiB,16MiB"),
#      LANES ("1,2,4,8"), PEERS (path to shared/peers), YUEBING (the yuebing command).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
OUT="$(mkdir -p "${1:-./transfer-vs-mooncake}" && cd "${1:-./transfer-vs-mooncake}" && pwd)"
ROUNDS="${ROUNDS:-3}"
DURATION="${DURATION:-1}"
SIZES="${SIZES:-64KiB,1MiB,4MiB,16MiB}"
LANES="${LANES:-1,2,4,8}"
PEERS="${PEERS:-$REPO/../shared/peers}"
YUEBING="${YUEBING:-$REPO/.venv/bin/yuebing}"
PY="${PY:-$REPO/.venv/bin/python}"

bytes_list() {  # 64KiB,1MiB -> "65536 1048576"
  "$PY" -c 'import sys; from yuebing.core.config import parse_size_list as p; print(" ".join(map(str, p(sys.argv[1]))))' "$1"
}
BLOCKS="$(bytes_list "$SIZES")"
echo "# transfer_vs_mooncake: rounds=$ROUNDS duration=${DURATION}s sizes=$SIZES lanes=$LANES out=$OUT"
echo "# load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$ROUNDS"); do
  echo "# round $r/$ROUNDS: mooncake transfer_engine_bench (tcp)"
  RUNS=1 DURATION="$DURATION" BLOCKS="$BLOCKS" BATCHES=16 THREADS="1 2" OPS="write read" \
    EXTRA_CFGS="65536:128:2:write 65536:128:2:read" \
    bash "$PEERS/run_transfer_engine_bench.sh" "$OUT/mooncake_$r" >"$OUT/mooncake_$r.log" 2>&1
  echo "# round $r/$ROUNDS: yuebing bench transfer (tcp, shm)"
  "$YUEBING" bench transfer --json --sizes "$SIZES" --lanes "$LANES" --batch 16 \
    --small-batch 128 --duration "$DURATION" >"$OUT/yuebing_$r.json"
  echo "# load after round $r: $(cut -d' ' -f1-3 /proc/loadavg)"
done
"$PY" "$HERE/transfer_compare.py" "$OUT"
