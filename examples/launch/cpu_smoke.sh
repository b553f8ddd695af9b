#!/usr/bin/env bash
# A CPU-only check of a setup, a few minutes on a laptop: trains a few steps with 1 process and with 2
# (gloo), then prints both runs' answers side by side; they are the same model, so the answers match.
#
#   examples/launch/cpu_smoke.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"
export CUDA_VISIBLE_DEVICES=""

SMOKE_FLAGS=(--max_steps "${MAX_STEPS:-4}" --num_sample_answers 0 --save_strategy no --overwrite_output_dir)
ACCUMULATION_1=$(accumulation 1)
ACCUMULATION_2=$(accumulation 2)
python train.py "${TRAIN_FLAGS[@]}" --output_dir "$OUTPUT_DIR/one-process" \
  --gradient_accumulation_steps "$ACCUMULATION_1" "${SMOKE_FLAGS[@]}" "$@"
torchrun --standalone --nproc_per_node 2 train_multigpu.py "${TRAIN_FLAGS[@]}" --output_dir "$OUTPUT_DIR/two-processes" \
  --gradient_accumulation_steps "$ACCUMULATION_2" "${SMOKE_FLAGS[@]}" "$@"
python examples/generate.py --reft_dir "$OUTPUT_DIR/one-process" --compare "$OUTPUT_DIR/two-processes" \
  --instruction "Name three primary colors." --max_new_tokens 32
