#!/usr/bin/env bash
# Two nodes (NNODES to change), the same command on each. The nodes meet at MASTER_ADDR:MASTER_PORT (c10d
# rendezvous), which orders them by hostname: rank 0, which writes OUTPUT_DIR, is on the first one. Put
# OUTPUT_DIR on a filesystem every node sees, so that a restart on other nodes still finds the checkpoints.
#
#   MASTER_ADDR=node0.cluster examples/launch/two_nodes.sh      # on node0 and on node1
set -euo pipefail
source "$(dirname "$0")/common.sh"

: "${MASTER_ADDR:?set MASTER_ADDR to an address of one of the nodes, reachable from all of them}"
NNODES=${NNODES:-2}
NPROC=${NPROC:-$(gpu_count)}
plan_batch $((NNODES * NPROC))
torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv_id "${RUN_ID:-reft-alpaca}" \
  "$REPO/train_multigpu.py" "${TRAIN_FLAGS[@]}" "${BATCH_FLAGS[@]}" "$@"
