#!/usr/bin/env bash
# A model one GPU cannot hold: each process spreads it over its own group of GPUs (and the CPU, disk) with
# --device_map, as transformers' device_map="auto" does; with several processes DDP runs over the groups.
#
#   examples/launch/device_map.sh                        # one process, the model over every GPU
#   GPUS_PER_PROCESS=2 examples/launch/device_map.sh     # 8 GPUs: 4 processes (DDP) of 2 GPUs each
#   DEVICE_MAP=sequential MAX_MEMORY='{"0": "60GiB", "1": "60GiB", "cpu": "200GiB"}' OFFLOAD_FOLDER=/scratch/offload \
#     MODEL=meta-llama/Llama-3.1-70B examples/launch/device_map.sh --bf16
set -euo pipefail
source "$(dirname "$0")/common.sh"

DEVICE_MAP=${DEVICE_MAP:-auto}  # auto, balanced, balanced_low_0, sequential, or a JSON map (docs/big-models.md)
GPUS_PER_PROCESS=${GPUS_PER_PROCESS:-$(gpu_count)}
NPROC=${NPROC:-$(($(gpu_count) / GPUS_PER_PROCESS))}
PLACEMENT_FLAGS=(--device_map "$DEVICE_MAP")
if [[ -n ${MAX_MEMORY:-} ]]; then PLACEMENT_FLAGS+=(--max_memory "$MAX_MEMORY"); fi
if [[ -n ${OFFLOAD_FOLDER:-} ]]; then PLACEMENT_FLAGS+=(--offload_folder "$OFFLOAD_FOLDER"); fi
plan_batch "$NPROC"
# --standalone: a local rendezvous on a free port, so several jobs can share a node.
torchrun --standalone --nproc_per_node "$NPROC" \
  "$REPO/train_multigpu.py" "${TRAIN_FLAGS[@]}" "${BATCH_FLAGS[@]}" "${PLACEMENT_FLAGS[@]}" "$@"
