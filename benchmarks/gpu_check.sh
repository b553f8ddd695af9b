#!/usr/bin/env bash
# The GPU checks of issue 13 on one GPU, in about 8 minutes (each part has a timeout). Run from the repository
# root, with the project's Python as PYTHON (default: python) and the model as MODEL (default: the embedded
# SmolLM2; a directory with the same shapes measures the same speed: benchmarks/random_model.py makes one from
# config and tokenizer alone). Each throughput batch size takes about 80 s on an H200. Prints, in order:
#   1. the throughput table (ours vs the HF/pyreft baseline) at per-device batch 8 and 32 on SmolLM2-135M,
#      and at 8 on Llama-3.2-1B's shape (random weights);
#   2. the host syncs left in train.py's step (torch.cuda.set_sync_debug_mode("warn"));
#   3. train.py against train_multigpu.py on 1 process (NCCL, DDP) and with --fsdp: max weight and loss
#      differences, next to two identical train.py runs (bf16 kernels are not bitwise deterministic).
set -euo pipefail
PYTHON=${PYTHON:-python}
OUT=${OUT:-$(mktemp -d)}
DATA=${DATA:-$( [ -f ../shared/data/alpaca_en_demo.json ] && echo ../shared/data/alpaca_en_demo.json \
                || echo examples/data/alpaca_sample.json )}
MODEL=${MODEL:-embedded:SmolLM2-135M-Instruct}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
section() { echo; echo "=== $* ($(date +%T))"; }

section "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PYTHON -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__)"

section "1a. throughput, SmolLM2-135M"
timeout 200 $PYTHON benchmarks/throughput.py --model_name_or_path "$MODEL" --data_path "$DATA" --batch_sizes 8,32 \
    --steps 12 || echo "(failed)"
section "1b. throughput, Llama-3.2-1B shape"
timeout 100 $PYTHON benchmarks/throughput.py --model_name_or_path "$MODEL" --data_path "$DATA" --batch_sizes 8 \
    --steps 8 --model_shape llama-3.2-1b || echo "(failed)"

COMMON=(--model_name_or_path "$MODEL" --data_path "$DATA" --max_steps 10 --logging_steps 1 --num_sample_answers 0 --per_device_train_batch_size 8)
section "2. host syncs in train.py's step (steps 3-10; step 10 logs and the run saves)"
timeout 40 $PYTHON benchmarks/sync_count.py train.py "${COMMON[@]}" --logging_steps 1000 \
    --output_dir "$OUT/sync" 2>&1 | sed -n '/synchronizing operations/,$p' || echo "(failed)"

section "3. train.py vs train_multigpu.py (1 process, NCCL) and --fsdp"
timeout 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/single" | tail -1 || echo "(failed)"
timeout 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/single-again" | tail -1 || echo "(failed)"
timeout 40 $PYTHON -m torch.distributed.run --standalone --nproc_per_node 1 train_multigpu.py "${COMMON[@]}" \
    --output_dir "$OUT/ddp" | tail -1 || echo "(failed)"
timeout 40 $PYTHON -m torch.distributed.run --standalone --nproc_per_node 1 train_multigpu.py "${COMMON[@]}" \
    --fsdp --output_dir "$OUT/fsdp" | tail -1 || echo "(failed)"
$PYTHON - "$OUT" <<'PY'
import json, sys
from pathlib import Path

import torch

out = Path(sys.argv[1])

def run(name):
    weights = {f"{p.name}/{k}": t.float() for p in sorted((out / name).glob("intkey_*.bin"))
               for k, t in torch.load(p, weights_only=True).items()}
    losses = [json.loads(line)["loss"] for line in open(out / name / "metrics.jsonl") if '"loss"' in line]
    return weights, losses

reference_weights, reference_losses = run("single")
for name in ("single-again", "ddp", "fsdp"):
    weights, losses = run(name)
    weight_diff = max((weights[k] - reference_weights[k]).abs().max().item() for k in reference_weights)
    loss_diff = max(abs(a - b) for a, b in zip(losses, reference_losses))
    print(f"{name:>12} vs train.py: max |weight diff| {weight_diff:.2e}, max |loss diff| {loss_diff:.2e} "
          f"over {len(losses)} steps")
PY
echo; echo "done ($(date +%T)); outputs in $OUT"
