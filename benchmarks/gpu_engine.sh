#!/usr/bin/env bash
# tidegate's own engine on a GPU, within 8 minutes: (c) of benchmarks/real_engine.py (continuous batching against
# model.generate's static batches on a ~1B Llama, and the step time outside the forward), then the twin check on
# the same device with a profile fitted on the trace's next requests around it (twin-check --fit-around).
#
#   benchmarks/gpu_engine.sh [OUT_DIR]
#
# Needs a python with tidegate's dependencies (PYTHON, default python3). The model is the `llama-1b` shape of
# engine/bench/vllm/model.py (random weights, built into bench-out/models, nothing downloaded). Every part has
# its own time limit and writes its output as it goes, so a part that fails or runs long leaves the others.
# Overridable for a smoke run on a CPU: SHAPE (llama-1b), DEVICE (cuda), FIRST (300 requests), RATE_SCALE (1.5).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out/gpu-engine}
PY=${PYTHON:-python3}
SHAPE=${SHAPE:-llama-1b}
DEVICE=${DEVICE:-cuda}
FIRST=${FIRST:-300}
RATE_SCALE=${RATE_SCALE:-1.5}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt" \
        || { echo "no GPU here" >&2; exit 2; }
fi
"$PY" -c "import torch, transformers, tidegate; print('torch', torch.__version__, 'transformers', \
transformers.__version__)" | tee "$OUT/versions.txt" || { echo "tidegate does not import with $PY" >&2; exit 2; }

if [ "$DEVICE" = cuda ]; then
    echo "== (c) continuous against static batching, ~1.1B Llama, bf16"
    timeout 150 "$PY" benchmarks/real_engine.py --only c 2>&1 | tee "$OUT/real_engine.txt"
fi

echo "== the $SHAPE model folder"
MODEL=$(timeout 90 "$PY" -c "from pathlib import Path; from tidegate.engine.bench.vllm.model import model_folder; \
print(model_folder('$SHAPE', Path('bench-out/models')))") || { echo "could not build the $SHAPE folder" >&2; exit 1; }
echo "$MODEL"

echo "== twin check on $DEVICE: splitwise_conv's first $FIRST requests at their own lengths, ${RATE_SCALE}x speed"
timeout 320 "$PY" -m tidegate twin-check --model "$MODEL" --device "$DEVICE" --trace splitwise_conv \
    --first "$FIRST" --length-scale 1 --rate-scale "$RATE_SCALE" --fit-around --out "$OUT/twin" \
    > "$OUT/twin.txt" 2> >(tee "$OUT/twin.log" >&2)
cat "$OUT/twin.txt"
