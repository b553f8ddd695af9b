#!/usr/bin/env bash
# A CPU-only check of a setup, a few minutes on a laptop: trains a few steps with 1 process and with 2
# (gloo), then prints both runs' answers side by side; they are the same model, so the answers match.
#
#   examples/launch/cpu_smoke.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"
export CUDA_VISIBLE_DEVICES=""

SMOKE_FLAGS=(--max_steps "${MAX_STEPS:-4}" --num_sample_answers 0 --save_strategy no --overwrite_output_dir)
plan_batch 1
python "$REPO/train.py" "${TRAIN_FLAGS[@]}" "${BATCH_FLAGS[@]}" --output_dir "$OUTPUT_DIR/one-process" \
  "${SMOKE_FLAGS[@]}" "$@"
plan_batch 2
torchrun --standalone --nproc_per_node 2 "$REPO/train_multigpu.py" "${TRAIN_FLAGS[@]}" "${BATCH_FLAGS[@]}" \
  --output_dir "$OUTPUT_DIR/two-processes" "${SMOKE_FLAGS[@]}" "$@"
python "$REPO/examples/generate.py" --reft_dir "$OUTPUT_DIR/one-process" --compare "$OUTPUT_DIR/two-processes" \
  --instruction "Name three primary colors." --max_new_tokens 32
