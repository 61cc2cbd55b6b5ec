#!/usr/bin/env bash
# The GPU paths on one CUDA machine, in at most 8 minutes (GPU_CHECK_BUDGET_S, default 480: an overall deadline,
# and `timeout` on every step): `reload` and `nccl` weight updates with their served-weight probes, FP8 against
# BF16 served log-probs (and the share of tokens the trainer's truncated importance weight caps), one
# Megatron-core PPO step (training/megatron/check.py), and one-GPU PPO iterations of the Hugging Face trainer in
# float32, micro-batches, bf16 autocast and a LoRA adapter (training/trainer_check.py). Details: bench/gpu_check.py.
#
#   bash bench/gpu_check.sh
#
# Without a CUDA device it prints "skipped: no CUDA device (...)" and {"skipped": ...}, and exits 0.
# With one, it uses (or builds: ./run.sh setup with TIDAL_ENGINE_FLAVOR=cuda) the CUDA engine environment; if
# that cannot be built (no network, no wheel), it says why and exits 2. The last line is always one JSON object.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUDGET=${GPU_CHECK_BUDGET_S:-480}
START=$(date +%s)
DEADLINE=$((START + BUDGET))

left() { echo $((DEADLINE - $(date +%s))); }
json_str() { printf '%s' "$1" | head -c 600 | sed 's/\\/\\\\/g; s/"/\\"/g' | tr '\n\t' '  '; }
skip() {
  echo "skipped: no CUDA device ($1)"
  printf '{"skipped": "no CUDA device: %s"}\n' "$(json_str "$1")"
  exit 0
}
fail() {  # fail CODE MESSAGE
  echo "gpu check failed: $2" >&2
  printf '{"failed": "%s", "seconds": %s}\n' "$(json_str "$2")" "$(($(date +%s) - START))"
  exit "$1"
}

# 1. A CUDA device, seen by the driver.
command -v nvidia-smi >/dev/null 2>&1 || skip "nvidia-smi not found"
GPU_LIST=$(timeout 20 nvidia-smi -L 2>&1) || skip "nvidia-smi -L failed: $(echo "$GPU_LIST" | tail -n 1)"
GPUS=$(printf '%s\n' "$GPU_LIST" | grep -c '^GPU ' || true)
[ "$GPUS" -ge 1 ] || skip "nvidia-smi -L lists no GPU"
echo "[gpu check] $GPUS GPU(s): $(printf '%s\n' "$GPU_LIST" | head -n 2 | tr '\n' ';')"

# 2. Both environments, the engine one CUDA (built once, cached by ./run.sh; needs the network the first time).
SETUP_S=$(( $(left) - 300 ))  # keep ~5 minutes for the measurements
[ "$SETUP_S" -ge 10 ] || fail 2 "budget of ${BUDGET}s leaves no time to set up; raise GPU_CHECK_BUDGET_S"
SETUP_LOG=$(mktemp)
if ! TIDAL_ENGINE_FLAVOR=cuda timeout "$SETUP_S" "$ROOT/run.sh" setup >"$SETUP_LOG" 2>&1; then
  fail 2 "the CUDA engine environment could not be set up within ${SETUP_S}s (./run.sh setup with TIDAL_ENGINE_FLAVOR=cuda; no network or no vLLM CUDA wheel for this machine?): $(tail -n 3 "$SETUP_LOG")"
fi
ENGINE_PY="$ROOT/.engine-venv/bin/python"
FLAVOR=$(timeout 60 "$ENGINE_PY" -c "import importlib.metadata as m; m.version('vllm'); print('cuda')" 2>&1) \
  || fail 2 "the engine environment has no CUDA vLLM: $FLAVOR"
CUDA=$(timeout 90 "$ENGINE_PY" -c "import torch; print(torch.cuda.is_available(), torch.cuda.device_count(), torch.version.cuda)" 2>&1) \
  || fail 2 "torch does not import in the engine environment: $(echo "$CUDA" | tail -n 1)"
case "$CUDA" in True*) ;; *) skip "torch.cuda is unavailable in the engine environment ($CUDA): driver too old for its CUDA build?" ;; esac
echo "[gpu check] engine environment ready: torch.cuda $CUDA ($(( $(date +%s) - START ))s)"

# 3. The measurements, bounded by what is left of the budget.
WORK=$(mktemp -d)
rm -f "$SETUP_LOG"
echo "[gpu check] scratch and engine logs: $WORK"
RUN_S=$(( $(left) - 5 ))
[ "$RUN_S" -ge 60 ] || fail 3 "only ${RUN_S}s left after setup; rerun now that the environments exist"
cd "$ROOT" && timeout --kill-after=10 "$RUN_S" "$ROOT/.venv/bin/python" -m bench.gpu_check \
  --deadline "$((DEADLINE - 10))" --work "$WORK" --gpus "$GPUS"
rc=$?
[ $rc -eq 124 ] || [ $rc -eq 137 ] && fail 3 "the measurements ran past the budget (${BUDGET}s); engine logs in $WORK/logs"
exit $rc
