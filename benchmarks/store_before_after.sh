#!/usr/bin/env bash
# Before/after of a change on a store put's or get's path, side by side in one invocation: the
# package at git revision BEFORE (exported to a temp dir, first on PYTHONPATH for the bench and
# the master and node it starts) and the working tree, running the same `yuebing bench store`
# alternately ROUNDS times (the order swapped every other round) so both see the same machine
# load. Prints per cell the median over rounds of GB/s (metadata and 4 KiB cells: k ops/s), of the rounds'
# after/before ratios, and of `vs_raw` (with --raw: the ratio to a raw socket RPC of the value
# in the same run), and writes OUT/before_N.json, after_N.json.
#
#   bash benchmarks/store_before_after.sh BEFORE [OUT]   (default OUT ./store-before-after)
# Env: ROUNDS (7), ARGS (bench arguments; default: remote put/get of 1 and 4 MiB vs the raw RPC),
#      PY (the interpreter; default: the repository's .venv).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
BEFORE="${1:?usage: store_before_after.sh BEFORE_REV [OUT]}"
OUT="$(mkdir -p "${2:-./store-before-after}" && cd "${2:-./store-before-after}" && pwd)"
ROUNDS="${ROUNDS:-7}"
ARGS="${ARGS:---paths remote_tcp --pairs single --sizes 1MiB,4MiB --runs 1 --no-checksum --skip-meta --raw}"
PY="${PY:-$REPO/.venv/bin/python}"
SRC="$(mktemp -d)"
trap 'rm -rf "$SRC"' EXIT
git -C "$REPO" archive "$BEFORE" src | tar -x -C "$SRC"
C_SRC=src/yuebing/transfer/_streamcopy.c  # the same build where its source is the same
if [ -f "$SRC/$C_SRC" ] && cmp -s "$SRC/$C_SRC" "$REPO/$C_SRC"; then
  cp "$REPO"/src/yuebing/transfer/_streamcopy*.so "$SRC/src/yuebing/transfer/" 2>/dev/null || true
fi
echo "# before=$BEFORE ($(git -C "$REPO" rev-parse --short "$BEFORE")) after=working tree; rounds=$ROUNDS"
echo "# yuebing bench store --json $ARGS"
run() {  # which round; a failed run is reported (its log kept) and left out of the medians
  local src="$REPO/src"
  [ "$1" = before ] && src="$SRC/src"
  # shellcheck disable=SC2086
  PYTHONPATH="$src" "$PY" -m yuebing.cli.main bench store --json $ARGS >"$OUT/$1_$2.json" \
    2>"$OUT/$1_$2.log" || { echo "# $1 round $2 failed: see $OUT/$1_$2.log"; rm -f "$OUT/$1_$2.json"; }
}
for r in $(seq 1 "$ROUNDS"); do
  echo "# round $r/$ROUNDS, load $(cut -d' ' -f1-3 /proc/loadavg)"
  if [ $((r % 2)) = 1 ]; then run before "$r"; run after "$r"; else run after "$r"; run before "$r"; fi
done
"$PY" - "$OUT" "$ROUNDS" <<'PYEOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
cells = {}
for which in ("before", "after"):
    for r in range(1, rounds + 1):
        try:
            rows = json.load(open(f"{out}/{which}_{r}.json"))
        except FileNotFoundError:  # a failed run
            continue
        for row in rows:
            key = (row["path"], row["op"], row["size_bytes"], row["batch"])
            cells.setdefault(key, {}).setdefault(which, {})[r] = row
# a data cell's rate is GB/s, a metadata or 4 KiB cell's k ops/s; "x" is the median of the
# rounds' after/before ratios (each round ran both, back to back)
print(f"{'cell':44} {'rate before':>11} {'after':>7} {'x':>5}  {'vs_raw before':>13} {'after':>7}")
for key, d in sorted(cells.items()):
    b, a = d.get("before", {}), d.get("after", {})
    if not b or not a:
        continue
    unit = "gbps" if key[2] > 4096 else "ops_per_s"
    rate = lambda row: (row.get(unit) or 0.0) / (1 if unit == "gbps" else 1000)
    med = lambda rows, f: statistics.median(r.get(f, 0.0) or 0.0 for r in rows.values())
    rb, ra = statistics.median(map(rate, b.values())), statistics.median(map(rate, a.values()))
    per = [rate(a[r]) / rate(b[r]) for r in b if r in a and rate(b[r])]
    x = statistics.median(per) if per else 0.0
    vr = f"{med(b, 'vs_raw'):13.2f} {med(a, 'vs_raw'):7.2f}" if "vs_raw" in next(iter(b.values())) else ""
    name = "/".join(map(str, key)) + ("" if unit == "gbps" else " (k ops/s)")
    print(f"{name:44} {rb:11.2f} {ra:7.2f} {x:5.2f}  {vr}")
PYEOF
