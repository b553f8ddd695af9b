# Sourced by the launch recipes beside it. Every variable below can be set in the environment; flags given
# to a recipe are passed on to the training script after these (the last occurrence of a flag wins).
#
# The global batch (PER_DEVICE x processes x accumulation) is kept at GLOBAL_BATCH on any number of GPUs,
# so every recipe trains the model single_gpu.sh trains.

cd "$(dirname "${BASH_SOURCE[0]}")/../.."  # the repository root

MODEL=${MODEL:-embedded:SmolLM2-135M-Instruct}  # an HF hub name or a local model directory
DATA=${DATA:-examples/data/alpaca_sample.json}   # Alpaca-format .json/.jsonl, or an HF hub dataset
OUTPUT_DIR=${OUTPUT_DIR:-output}
GLOBAL_BATCH=${GLOBAL_BATCH:-32}
PER_DEVICE=${PER_DEVICE:-8}

TRAIN_FLAGS=(
  --model_name_or_path "$MODEL" --data_path "$DATA" --output_dir "$OUTPUT_DIR"
  --layers "8;19" --position "f1+l1" --rank 4
  --per_device_train_batch_size "$PER_DEVICE" --num_train_epochs 2 --learning_rate 4e-3
  --logging_steps 10 --save_strategy steps --save_steps 100
)

# Usage: ACCUMULATION=$(accumulation <processes in all>)
accumulation() {
  local per_step=$((PER_DEVICE * $1))
  if ((GLOBAL_BATCH % per_step)); then
    echo "GLOBAL_BATCH=$GLOBAL_BATCH is not a multiple of PER_DEVICE=$PER_DEVICE x $1 processes;" \
         "set GLOBAL_BATCH or PER_DEVICE" >&2
    return 2
  fi
  echo $((GLOBAL_BATCH / per_step))
}

# GPUs this process may use (at least 1: a CPU-only machine runs one process).
gpu_count() {
  python -c "import torch; print(max(torch.cuda.device_count(), 1))"
}
