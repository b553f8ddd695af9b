# Sourced by the launch recipes beside it. Every variable below can be set in the environment; flags given
# to a recipe are passed on to the training script after these (the last occurrence of a flag wins).
# Relative paths are taken from the directory you run the recipe in.

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

MODEL=${MODEL:-embedded:SmolLM2-135M-Instruct}        # an HF hub name or a local model directory
DATA=${DATA:-$REPO/examples/data/alpaca_sample.json}   # Alpaca-format .json/.jsonl, or an HF hub dataset
OUTPUT_DIR=${OUTPUT_DIR:-output}
GLOBAL_BATCH=${GLOBAL_BATCH:-32}  # examples per optimizer step, whatever the number of GPUs
PER_DEVICE=${PER_DEVICE:-8}       # the most examples a GPU takes at once

TRAIN_FLAGS=(
  --model_name_or_path "$MODEL" --data_path "$DATA" --output_dir "$OUTPUT_DIR"
  --layers "8;19" --position "f1+l1" --rank 4 --num_train_epochs 2 --learning_rate 4e-3
  --logging_steps 10 --save_strategy steps --save_steps 100
)

# plan_batch <processes in all>: sets BATCH_FLAGS, a per-device batch and gradient accumulation whose
# product with the process count is GLOBAL_BATCH. Equal global batches give the same model on any number of
# GPUs; the per-device batch is lowered when there are more GPUs than GLOBAL_BATCH / PER_DEVICE.
plan_batch() {
  local processes=$1 per_device=$PER_DEVICE
  if ((per_device * processes > GLOBAL_BATCH)); then
    per_device=$((GLOBAL_BATCH / processes))
  fi
  if ((per_device < 1 || GLOBAL_BATCH % (per_device * processes))); then
    echo "error: GLOBAL_BATCH=$GLOBAL_BATCH cannot be split evenly over $processes processes with at most" \
         "PER_DEVICE=$PER_DEVICE each; make GLOBAL_BATCH a multiple of the process count" >&2
    exit 2
  fi
  BATCH_FLAGS=(--per_device_train_batch_size "$per_device"
               --gradient_accumulation_steps $((GLOBAL_BATCH / (per_device * processes))))
}

# GPUs this process may use (at least 1: a CPU-only machine runs one process).
gpu_count() {
  python -c "import torch; print(max(torch.cuda.device_count(), 1))"
}
