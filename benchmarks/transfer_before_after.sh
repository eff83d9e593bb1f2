#!/usr/bin/env bash
# Before/after of a transfer-engine change, side by side in one invocation: the transfer package
# at git revision BEFORE (exported to a temp dir and put first on PYTHONPATH, for both bench
# processes) and the working tree, running the same `yuebing bench transfer` cells alternately
# ROUNDS times so both see the same machine load. Prints GB/s and CPU µs per request (initiator
# and target) per cell, the median over rounds, and writes OUT/before_N.json, OUT/after_N.json.
#
#   bash benchmarks/transfer_before_after.sh BEFORE [OUT]   (default OUT ./transfer-before-after)
# Env: ROUNDS (3), ARGS (bench arguments; default: 64 KiB requests in batches of 128, tcp+shm,
#      4 lanes, 2 s per cell).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
BEFORE="${1:?usage: transfer_before_after.sh BEFORE_REV [OUT]}"
OUT="$(mkdir -p "${2:-./transfer-before-after}" && cd "${2:-./transfer-before-after}" && pwd)"
ROUNDS="${ROUNDS:-3}"
ARGS="${ARGS:---sizes 64KiB --batch 128 --small-batch 0 --lanes 4 --duration 2 --no-memcpy}"
PY="$REPO/.venv/bin/python"
SRC="$(mktemp -d)"
trap 'rm -rf "$SRC"' EXIT
git -C "$REPO" archive "$BEFORE" src | tar -x -C "$SRC"
# the C extension is built in place (not in git): give BEFORE the same build when its source
# is the same, so both sides copy with the same primitive
C_SRC=src/yuebing/transfer/_streamcopy.c
if [ -f "$SRC/$C_SRC" ] && cmp -s "$SRC/$C_SRC" "$REPO/$C_SRC"; then
  cp "$REPO"/src/yuebing/transfer/_streamcopy*.so "$SRC/src/yuebing/transfer/" 2>/dev/null || true
fi
echo "# before=$BEFORE ($(git -C "$REPO" rev-parse --short "$BEFORE")) after=working tree; rounds=$ROUNDS"
echo "# yuebing bench transfer --json $ARGS"
for r in $(seq 1 "$ROUNDS"); do
  echo "# round $r/$ROUNDS, load $(cut -d' ' -f1-3 /proc/loadavg)"
  # shellcheck disable=SC2086
  PYTHONPATH="$SRC/src" "$PY" -m yuebing.cli.main bench transfer --json $ARGS >"$OUT/before_$r.json"
  # shellcheck disable=SC2086
  "$PY" -m yuebing.cli.main bench transfer --json $ARGS >"$OUT/after_$r.json"
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" - "$OUT" "$ROUNDS" <<'PYEOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
cells = {}
for which in ("before", "after"):
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/{which}_{r}.json")):
            key = (row["transport"], row["op"], row["size_bytes"], row["batch"], row["lanes"])
            cells.setdefault(key, {}).setdefault(which, []).append(row)
print(f"{'cell':34} {'GB/s before':>11} {'after':>7} {'x':>5}  {'CPU us/req before (init+target)':>31} {'after':>15}")
for key, d in sorted(cells.items()):
    med = lambda rows, f: statistics.median(r.get(f, 0.0) for r in rows)
    b, a = d.get("before", []), d.get("after", [])
    if not b or not a:
        continue
    gb, ga = med(b, "gbps"), med(a, "gbps")
    cb = f"{med(b, 'cpu_us_initiator'):.1f}+{med(b, 'cpu_us_target'):.1f}"
    ca = f"{med(a, 'cpu_us_initiator'):.1f}+{med(a, 'cpu_us_target'):.1f}"
    name = "/".join(map(str, key))
    print(f"{name:34} {gb:11.2f} {ga:7.2f} {ga / gb:5.2f}  {cb:>31} {ca:>15}")
PYEOF
