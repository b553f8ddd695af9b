#!/usr/bin/env bash
# One node, all its GPUs (NPROC to choose): DDP, or add --fsdp to shard the base model.
#
#   examples/launch/multi_gpu.sh
#   NPROC=4 OUTPUT_DIR=runs/4gpu examples/launch/multi_gpu.sh --fsdp
set -euo pipefail
source "$(dirname "$0")/common.sh"

NPROC=${NPROC:-$(gpu_count)}
plan_batch "$NPROC"
# --standalone: a local rendezvous on a free port, so several jobs can share a node.
torchrun --standalone --nproc_per_node "$NPROC" \
  "$REPO/train_multigpu.py" "${TRAIN_FLAGS[@]}" "${BATCH_FLAGS[@]}" "$@"
