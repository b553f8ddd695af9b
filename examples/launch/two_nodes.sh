#!/usr/bin/env bash
# Two nodes (NNODES to change), the same command on each; the nodes meet at MASTER_ADDR:MASTER_PORT (c10d
# rendezvous, ranks assigned as they arrive). Rank 0 writes OUTPUT_DIR, and after a restart rank 0 may be
# on the other node: put OUTPUT_DIR on a filesystem both nodes see.
#
#   MASTER_ADDR=node0.cluster examples/launch/two_nodes.sh      # on node0 and on node1
set -euo pipefail
source "$(dirname "$0")/common.sh"

: "${MASTER_ADDR:?set MASTER_ADDR to an address of one of the nodes, reachable from all of them}"
NNODES=${NNODES:-2}
NPROC=${NPROC:-$(gpu_count)}
ACCUMULATION=$(accumulation $((NNODES * NPROC)))
torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv_id "${RUN_ID:-reft-alpaca}" \
  train_multigpu.py "${TRAIN_FLAGS[@]}" --gradient_accumulation_steps "$ACCUMULATION" "$@"
