#!/usr/bin/env bash
# The GPU checks on one GPU (each part has a timeout). Run from the repository root, with the project's Python as
# PYTHON (default: python) and the model as MODEL (default: the embedded SmolLM2; a directory with the same shapes
# measures the same speed: benchmarks/random_model.py makes one from config and tokenizer alone). Prints, in order:
#   1. the throughput table (benchmarks/throughput.py: warmed shapes, CUDA events, median and range of 3 windows,
#      MFU two ways) of VARIANTS (default baseline,eager,compiled,packed,varlen; each a flag set of throughput.py's
#      VARIANTS; add flash where flash-attn is installed) on the same NUM_EXAMPLES examples (default 256: >= 30
#      steps a window):
#      1a. SmolLM2-135M at per-device batch 8, 32 and 64;  1b. Llama-3.2-1B's shape (random weights) at 8 and 32;
#      1c. the attention backend: baseline and eager with cuDNN's SDPA off, SmolLM2 at 8 and the 1B shape at 8
#          (against 1a/1b: pick the faster, docs/performance.md);  1d. Llama-3.1-8B's shape (random bf16) at 8.
#      The timeouts are estimates (a compiled variant compiles first: about a minute);
#   2. the host syncs left in train.py's step (torch.cuda.set_sync_debug_mode("warn")); it fails if one is in a
#      forward;
#   3. train.py against train_multigpu.py on 1 process (NCCL, DDP) and with --fsdp: max weight and loss
#      differences, next to two identical train.py runs (bf16 kernels are not bitwise deterministic);
#   4. the same in float32 for --fsdp and DeepSpeed ZeRO-2, ZeRO-3 and ZeRO-3 with CPU offload, 2 epochs of the
#      shipped sample (130 records, global batch 32: each epoch's last step has 1 micro-batch of 2, so FSDP and
#      DeepSpeed run 3 placeholders there) with dropout 0.1: placeholders draw no dropout masks on CUDA either;
#   5. packs on a GPU, bf16: train.py padded against --packing (SDPA, its mask over each pack) and --packing
#      --attn_implementation sdpa_varlen (torch's varlen kernel), max weight and loss differences, beside two
#      identical padded runs; with flash-attn installed, flash_attention_2 packed too.
#   6. bf16 as GPU users train: train.py against train_multigpu.py on 1 process with DDP, --fsdp,
#      ZeRO-2, ZeRO-3 and ZeRO-3 offload, and a --device_map split of the model between cuda:0 and the CPU (and
#      disk): weight and loss differences, and each run's tokens/s and peak device memory (its
#      "Trained to step" line).
#   7. a 4-bit NF4 base, bf16 compute: train.py --load_in_4bit against train_multigpu.py on 1 process with DDP and
#      with --fsdp (the base built on meta, each weight quantized whole and its rows kept): weight and loss
#      differences (the same bytes: within bf16's run-to-run noise), tokens/s and peak device memory.
# SECTIONS picks some (default: "1a 1b 1c 2 3 4 5 6 7"; 1d when asked).
set -euo pipefail
PYTHON=${PYTHON:-python}
OUT=${OUT:-$(mktemp -d)}
DATA=${DATA:-$( [ -f ../shared/data/alpaca_en_demo.json ] && echo ../shared/data/alpaca_en_demo.json \
                || echo examples/data/alpaca_sample.json )}
MODEL=${MODEL:-embedded:SmolLM2-135M-Instruct}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SECTIONS=" ${SECTIONS:-1a 1b 1c 2 3 4 5 6 7} "
VARIANTS=${VARIANTS:-baseline,eager,compiled,packed,varlen}
THROUGHPUT=($PYTHON benchmarks/throughput.py --model_name_or_path "$MODEL" --data_path "$DATA"
            --num_examples "${NUM_EXAMPLES:-256}" --repeats 3)
section() { echo; echo "=== $* ($(date +%T))"; }
wants() { [[ $SECTIONS == *" $1 "* ]]; }

section "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PYTHON -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__)"

if wants 1a; then
  section "1a. throughput, SmolLM2-135M"
  timeout 480 "${THROUGHPUT[@]}" --variants "$VARIANTS" --batch_sizes 8,32,64 || echo "(failed)"
fi
if wants 1b; then
  section "1b. throughput, Llama-3.2-1B shape"
  timeout 420 "${THROUGHPUT[@]}" --variants "$VARIANTS" --batch_sizes 8,32 --model_shape llama-3.2-1b \
      || echo "(failed)"
fi
if wants 1c; then
  section "1c. attention backend: cuDNN's SDPA off (against 1a and 1b's baseline and eager rows)"
  timeout 150 "${THROUGHPUT[@]}" --variants baseline,eager --batch_sizes 8 --cudnn_sdpa off || echo "(failed)"
  timeout 200 "${THROUGHPUT[@]}" --variants baseline,eager --batch_sizes 8 --cudnn_sdpa off \
      --model_shape llama-3.2-1b || echo "(failed)"
fi
if wants 1d; then
  section "1d. throughput, Llama-3.1-8B shape (random bf16 weights built on the GPU)"
  timeout 480 "${THROUGHPUT[@]}" --variants "$VARIANTS" --batch_sizes 8 --model_shape llama-3.1-8b || echo "(failed)"
fi

# compare REFERENCE NAME...: each run's max weight and loss differences from REFERENCE's (directories in $OUT)
compare() {
  $PYTHON - "$OUT" "$@" <<'PY'
import json, sys
from pathlib import Path

import torch

out, reference, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]

def run(name):
    weights = {f"{p.name}/{k}": t.float() for p in sorted((out / name).glob("intkey_*.bin"))
               for k, t in torch.load(p, weights_only=True).items()}
    losses = [json.loads(line)["loss"] for line in open(out / name / "metrics.jsonl") if '"loss"' in line]
    return weights, losses

reference_weights, reference_losses = run(reference)
for name in names:
    try:
        weights, losses = run(name)
        weight_diff = max((weights[k] - reference_weights[k]).abs().max().item() for k in reference_weights)
        loss_diff = max(abs(a - b) for a, b in zip(losses, reference_losses))
    except (OSError, KeyError, ValueError) as error:  # a run that failed or timed out before its output
        print(f"{name:>14}: no complete output ({error!r})")
        continue
    print(f"{name:>14} vs {reference}: max |weight diff| {weight_diff:.2e}, max |loss diff| {loss_diff:.2e} "
          f"over {len(losses)} steps")
PY
}
ONE_PROCESS=($PYTHON -m torch.distributed.run --standalone --nproc_per_node 1 train_multigpu.py)

COMMON=(--model_name_or_path "$MODEL" --data_path "$DATA" --max_steps 10 --logging_steps 1 --num_sample_answers 0
        --per_device_train_batch_size 8 --overwrite_output_dir)
if wants 2; then
  section "2. host syncs in train.py's step (steps 3-10; step 10 logs and the run saves)"
  timeout 40 $PYTHON benchmarks/sync_count.py train.py "${COMMON[@]}" --logging_steps 1000 \
      --output_dir "$OUT/sync" 2>&1 | sed -n '/synchronizing operations/,$p' || echo "(failed)"
fi

if wants 3; then
  section "3. train.py vs train_multigpu.py (1 process, NCCL) and --fsdp"
  timeout 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/single" | tail -1 || echo "(failed)"
  timeout 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/single-again" | tail -1 || echo "(failed)"
  timeout 40 "${ONE_PROCESS[@]}" "${COMMON[@]}" --output_dir "$OUT/ddp" | tail -1 || echo "(failed)"
  timeout 40 "${ONE_PROCESS[@]}" "${COMMON[@]}" --fsdp --output_dir "$OUT/fsdp" | tail -1 || echo "(failed)"
  compare single single-again ddp fsdp || echo "(compare failed)"
fi

if wants 4; then
  section "4. float32 with placeholders and dropout: --fsdp, DeepSpeed ZeRO-2, ZeRO-3, ZeRO-3 offload (1 process)"
  FP32=(--model_name_or_path "$MODEL" --data_path examples/data/alpaca_sample.json --num_train_epochs 2
        --per_device_train_batch_size 8 --gradient_accumulation_steps 4 --dtype float32 --dropout 0.1
        --logging_steps 1 --num_sample_answers 0 --overwrite_output_dir)
  timeout 40 $PYTHON train.py "${FP32[@]}" --output_dir "$OUT/fp32" | tail -1 || echo "(failed)"
  timeout 40 $PYTHON train.py "${FP32[@]}" --output_dir "$OUT/fp32-again" | tail -1 || echo "(failed)"
  timeout 50 "${ONE_PROCESS[@]}" "${FP32[@]}" --fsdp --output_dir "$OUT/fp32-fsdp" | tail -1 || echo "(failed)"
  for config in zero2 zero3 zero3_offload; do
    timeout 70 "${ONE_PROCESS[@]}" "${FP32[@]}" --deepspeed "examples/deepspeed/$config.json" \
        --output_dir "$OUT/fp32-$config" 2>&1 | tail -3 || echo "(failed)"
  done
  compare fp32 fp32-again fp32-fsdp fp32-zero2 fp32-zero3 fp32-zero3_offload || echo "(compare failed)"
fi

if wants 5; then
  section "5. packs, bf16: padded vs --packing under sdpa, sdpa_varlen (and flash_attention_2 if installed)"
  PACKED=(sdpa sdpa_varlen)
  $PYTHON -c "import flash_attn" 2>/dev/null && PACKED+=(flash_attention_2)
  timeout 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/padded" | tail -1 || echo "(failed)"
  timeout 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/padded-again" | tail -1 || echo "(failed)"
  for attention in "${PACKED[@]}"; do
    timeout 40 $PYTHON train.py "${COMMON[@]}" --packing --attn_implementation "$attention" \
        --output_dir "$OUT/packed-$attention" 2>&1 | tail -1 || echo "(failed)"
  done
  compare padded padded-again "${PACKED[@]/#/packed-}" || echo "(compare failed)"
fi

trained() { grep -h "Trained to step" || echo "(failed)"; }
if wants 6; then
  section "6. bf16: DDP, --fsdp, ZeRO-2, ZeRO-3, ZeRO-3 offload (1 process), and train.py split by --device_map"
  timeout 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/bf16" | trained
  timeout 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/bf16-again" | trained
  timeout 40 "${ONE_PROCESS[@]}" "${COMMON[@]}" --output_dir "$OUT/bf16-ddp" 2>&1 | trained
  timeout 40 "${ONE_PROCESS[@]}" "${COMMON[@]}" --fsdp --output_dir "$OUT/bf16-fsdp" 2>&1 | trained
  for config in zero2 zero3 zero3_offload; do
    timeout 70 "${ONE_PROCESS[@]}" "${COMMON[@]}" --deepspeed "examples/deepspeed/$config.json" \
        --output_dir "$OUT/bf16-$config" 2>&1 | trained
  done
  # half of SmolLM2's bf16 layers on the GPU, the rest in CPU memory; then layers 0-3 on disk, the rest on the GPU
  timeout 60 $PYTHON train.py "${COMMON[@]}" --device_map auto --max_memory '{"0": "160MiB", "cpu": "8GiB"}' \
      --output_dir "$OUT/bf16-cpu-split" 2>&1 | trained
  DISK_MAP=$($PYTHON -c "import json; print(json.dumps({'model.embed_tokens': 0, **{f'model.layers.{i}': 'disk' if i < 4
else 0 for i in range(30)}, 'model.norm': 0, 'model.rotary_emb': 0, 'lm_head': 0}))")
  timeout 90 $PYTHON train.py "${COMMON[@]}" --device_map "$DISK_MAP" --offload_folder "$OUT/offload" \
      --output_dir "$OUT/bf16-disk-split" 2>&1 | trained
  compare bf16 bf16-again bf16-ddp bf16-fsdp bf16-zero2 bf16-zero3 bf16-zero3_offload bf16-cpu-split \
      bf16-disk-split || echo "(compare failed)"
fi

if wants 7; then
  section "7. a 4-bit NF4 base, bf16 compute: train.py, DDP and --fsdp (1 process)"
  timeout 40 $PYTHON train.py "${COMMON[@]}" --load_in_4bit --output_dir "$OUT/nf4" | trained
  timeout 40 $PYTHON train.py "${COMMON[@]}" --load_in_4bit --output_dir "$OUT/nf4-again" | trained
  timeout 50 "${ONE_PROCESS[@]}" "${COMMON[@]}" --load_in_4bit --output_dir "$OUT/nf4-ddp" 2>&1 | trained
  timeout 50 "${ONE_PROCESS[@]}" "${COMMON[@]}" --load_in_4bit --fsdp --output_dir "$OUT/nf4-fsdp" 2>&1 | trained
  compare nf4 nf4-again nf4-ddp nf4-fsdp || echo "(compare failed)"
fi
echo; echo "done ($(date +%T)); outputs in $OUT"
