#!/usr/bin/env bash
# One node whose workers torchrun restarts when one fails (killed, out of memory, an exception): up to
# MAX_RESTARTS times, all of them anew, each restart going on from the newest checkpoint by itself. The run
# ends with the model of an uninterrupted one. A mistake in the flags fails each attempt alike: its one line
# is printed once per attempt (docs/checkpoints.md).
#
#   examples/launch/elastic.sh
#   MAX_RESTARTS=5 NPROC=8 OUTPUT_DIR=runs/8gpu examples/launch/elastic.sh --fsdp
set -euo pipefail
source "$(dirname "$0")/common.sh"

NPROC=${NPROC:-$(gpu_count)}
plan_batch "$NPROC"
torchrun --standalone --nproc_per_node "$NPROC" --max_restarts "${MAX_RESTARTS:-3}" \
  "$REPO/train_multigpu.py" "${TRAIN_FLAGS[@]}" "${BATCH_FLAGS[@]}" --resume_from_checkpoint auto "$@"
