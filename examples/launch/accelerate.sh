#!/usr/bin/env bash
# The same run through `accelerate launch` (it sets the variables torchrun sets; the script does the rest:
# accelerate's --mixed_precision bf16 and --dynamo_backend inductor would be read as --bf16 and --torch_compile,
# so they are left at no here and the flags say what runs).
#
#   NPROC=8 examples/launch/accelerate.sh
#   NPROC=8 DEEPSPEED_CONFIG=examples/deepspeed/zero2.json examples/launch/accelerate.sh   # as --deepspeed CONFIG
#   NPROC=8 FSDP=1 examples/launch/accelerate.sh                                            # as --fsdp
set -euo pipefail
source "$(dirname "$0")/common.sh"

NPROC=${NPROC:-$(gpu_count)}
plan_batch "$NPROC"
# accelerate's --use_deepspeed and --use_fsdp reach the script through its environment, which it follows
# (alpaca.launcher_env.follow_accelerate_launch); accelerate allows one of them or --multi_gpu.
strategy=()
if [[ -n ${DEEPSPEED_CONFIG:-} ]]; then
  strategy=(--use_deepspeed --deepspeed_config_file "$DEEPSPEED_CONFIG")
elif [[ -n ${FSDP:-} ]]; then
  strategy=(--use_fsdp)
elif ((NPROC > 1)); then
  strategy=(--multi_gpu)
fi
accelerate launch "${strategy[@]}" --num_processes "$NPROC" --num_machines 1 --mixed_precision no \
  --dynamo_backend no --main_process_port "${MASTER_PORT:-29500}" "$REPO/train_multigpu.py" "${TRAIN_FLAGS[@]}" "${BATCH_FLAGS[@]}" "$@"
