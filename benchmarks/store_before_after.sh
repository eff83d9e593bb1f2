#!/usr/bin/env bash
# Before/after of a store change in one invocation: the store at git revision BEFORE (exported to
# a temp dir, first on PYTHONPATH for the bench and the processes it starts) and the working
# tree run the same `yuebing bench store` cells alternately, ROUNDS times (the order flips every
# round), so both see the same machine load. Prints each cell's median ops/s and p50 over rounds,
# after/before, and flags a cell more than 5 % slower; writes OUT/{before,after}_N.json.
#
#   bash benchmarks/store_before_after.sh BEFORE [OUT]   (default OUT ./store-before-after)
# Env: ROUNDS (3), ARGS (bench arguments; default: the metadata ops + 64 KiB and 1 MiB values).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
BEFORE="${1:?usage: store_before_after.sh BEFORE_REV [OUT]}"
OUT="$(mkdir -p "${2:-./store-before-after}" && cd "${2:-./store-before-after}" && pwd)"
ROUNDS="${ROUNDS:-3}"
ARGS="${ARGS:---sizes 64KiB,1MiB --pairs single,batch --runs 1 --target-bytes 64MiB --time-cap 2 --warm-bytes 128MiB --dram 512MiB --meta-ops 2000}"
PY="${PY:-$REPO/.venv/bin/python}"
SRC="$(mktemp -d)"
trap 'rm -rf "$SRC"' EXIT
git -C "$REPO" archive "$BEFORE" src | tar -x -C "$SRC"
# the C copy extension is built in place (not in git): both sides get the same build
C_SRC=src/yuebing/transfer/_streamcopy.c
if cmp -s "$SRC/$C_SRC" "$REPO/$C_SRC"; then
  cp "$REPO"/src/yuebing/transfer/_streamcopy*.so "$SRC/src/yuebing/transfer/" 2>/dev/null || true
fi
run() {  # which round
  local src="$REPO/src"; [ "$1" = before ] && src="$SRC/src"
  # shellcheck disable=SC2086
  PYTHONPATH="$src" "$PY" -m yuebing.cli.main bench store --json $ARGS >"$OUT/$1_$2.json"
}
echo "# before=$BEFORE ($(git -C "$REPO" rev-parse --short "$BEFORE")) after=working tree; rounds=$ROUNDS"
echo "# yuebing bench store --json $ARGS"
for r in $(seq 1 "$ROUNDS"); do
  echo "# round $r/$ROUNDS, load $(cut -d' ' -f1-3 /proc/loadavg)"
  if [ $((r % 2)) = 1 ]; then run before "$r"; run after "$r"; else run after "$r"; run before "$r"; fi
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" - "$OUT" "$ROUNDS" <<'PYEOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
cells = {}
for which in ("before", "after"):
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/{which}_{r}.json")):
            key = (row["path"], row["op"], row["size_bytes"], row["batch"])
            cells.setdefault(key, {}).setdefault(which, []).append(row)
print(f"{'cell':38} {'ops/s before':>12} {'after':>9} {'x':>5} {'p50 us before':>13} {'after':>7}")
ratios = []
for key, d in sorted(cells.items()):
    b, a = d.get("before", []), d.get("after", [])
    if not b or not a:
        continue
    med = lambda rows, f: statistics.median(r[f] for r in rows)
    ob, oa = med(b, "ops_per_s"), med(a, "ops_per_s")
    x = oa / ob if ob else float("nan")
    ratios.append(x)
    flag = "  <-- >5 % slower" if x < 0.95 else ""
    name = "/".join(map(str, key))
    print(f"{name:38} {ob:12.0f} {oa:9.0f} {x:5.2f} {med(b, 'p50_us'):13.0f} "
          f"{med(a, 'p50_us'):7.0f}{flag}")
if ratios:
    print(f"# {len(ratios)} cells: geomean after/before {statistics.geometric_mean(ratios):.3f}, "
          f"min {min(ratios):.2f}, max {max(ratios):.2f}")
PYEOF
