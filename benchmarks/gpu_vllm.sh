#!/usr/bin/env bash
# The side-by-side of benchmarks/vllm_overload.py on a GPU: vanilla vLLM against vLLM with tidegate's plugin
# (TidegateAsyncScheduler, since vLLM's CUDA build schedules asynchronously) on a ~1B model, within 10 minutes.
#
#   benchmarks/gpu_vllm.sh MODEL_DIR [OUT_DIR]
#
# MODEL_DIR: a local Hugging Face folder of a ~1B Llama-style model, or `llama-1b` (built from a config with random
# weights, engine/bench/vllm/model.py; nothing is downloaded). Needs a python
# with vLLM's CUDA build and tidegate installed (pip install --no-deps -e . beside it): VLLM_PYTHON, default
# python3. The plugin refuses a vLLM version other than those in engine/vllm/version.py, in one line.
# Budget: capacity ramp ~1.5 min, 3 loads x 2 arms x (start-up ~40 s + 45 s of arrivals + drain), the
# --max-num-queued-reqs arm at 1.5x only.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: benchmarks/gpu_vllm.sh MODEL_DIR [OUT_DIR]}
OUT=${2:-bench-out/gpu-vllm}
PY=${VLLM_PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { echo "no GPU here" >&2; exit 2; }
"$PY" -c "from tidegate.engine.vllm.version import check_vllm_version; check_vllm_version()" \
    || { echo "vLLM with tidegate's plugin does not import with $PY" >&2; exit 2; }
exec "$PY" benchmarks/vllm_overload.py --model "$MODEL" --vllm-python "$PY" --out "$OUT" \
    --arm "tidegate=--scheduler-cls tidegate.engine.vllm.scheduler.TidegateAsyncScheduler \
--middleware tidegate.engine.vllm.middleware.AdmissionMiddleware \
--additional-config '{\"tidegate\": {\"controller\": \"slo-flow\", \"profile\": \"h200-llama3-8b\", \"step_log\": \"{step_log}\"}}'" \
    --vllm-args "--dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.85" \
    --capacity-clients 64,128,256,512 --capacity-s 15 --capacity-warmup-s 4 \
    --duration-s 45 --queued-loads 1.5 --load-processes 8
