#!/usr/bin/env bash
# The same run through `accelerate launch` (it sets the variables torchrun sets; the script does the rest,
# so accelerate's own mixed precision and dynamo stay off: use --bf16 / --dtype instead).
#
#   NPROC=8 examples/launch/accelerate.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"

NPROC=${NPROC:-$(gpu_count)}
plan_batch "$NPROC"
multi=()
if ((NPROC > 1)); then multi=(--multi_gpu); fi
accelerate launch "${multi[@]}" --num_processes "$NPROC" --num_machines 1 --mixed_precision no \
  --dynamo_backend no --main_process_port "${MASTER_PORT:-29500}" "$REPO/train_multigpu.py" "${TRAIN_FLAGS[@]}" "${BATCH_FLAGS[@]}" "$@"
