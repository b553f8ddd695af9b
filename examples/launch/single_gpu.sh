#!/usr/bin/env bash
# One GPU (or the CPU when there is none).
#
#   examples/launch/single_gpu.sh
#   MODEL=meta-llama/Llama-3.2-1B DATA=alpaca_data.json OUTPUT_DIR=runs/1gpu examples/launch/single_gpu.sh --bf16
set -euo pipefail
source "$(dirname "$0")/common.sh"

plan_batch 1
python "$REPO/train.py" "${TRAIN_FLAGS[@]}" "${BATCH_FLAGS[@]}" "$@"
