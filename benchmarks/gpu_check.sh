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
#   8. packed against padded in float32 with TF32 off (NVIDIA_TF32_OVERRIDE=0): --packing under sdpa beside two
#      padded runs, within float32 rounding; sdpa_varlen's flash kernel has no float32 (refused in one line).
#   9. ZeRO-3 with and without CPU offload against train.py, float32 with TF32 off: what separates offload from
#      ZeRO-3 once bf16 and TF32 roundings are out of the way (docs/exactness.md).
#  10. train_multigpu.py as NCCL runs it, on 1 process, with an eval split evaluated every 2 steps and 2 sample
#      answers: DDP, --fsdp, --fsdp "full_shard offload", ZeRO-2, ZeRO-3 and ZeRO-3 offload. A run passes when it
#      ends 0, prints its "Trained to step" line, saved its interventions and its ledger of collectives
#      (tests/collective_ledger.py) has every tensor on the GPU (the host group's on the CPU) and every group
#      waiting --ddp_timeout; each prints "passed" or why not.
#  11. Llama-3.1-70B's shapes on one GPU: a random NF4 base built layer by layer on the device
#      (benchmarks/llama70b_nf4.py) and trained by train.py's loop as a --load_in_4bit base, with
#      --gradient_checkpointing: the build's seconds, the run's tokens/s, and its peak memory beside the formula.
#      NF4_70B_SHAPE (default: the whole model) passes that script fewer layers or a smaller vocabulary (and
#      --layers within them: the default intervenes on 8 and 19).
# SECTIONS picks some (default: "1a 1b 1c 2 3 4 5 6 7 8 9 10"; 1d and 11 when asked). Each section stops starting
# runs after SECTION_SECONDS (default 300), and no run lasts more than RUN_SECONDS (default: no limit; a rehearsal's
# short one); each run's whole output is in $OUT/NAME.log, and a run that fails prints its exit status and its
# error's last lines.
set -euo pipefail
PYTHON=${PYTHON:-python}
OUT=${OUT:-$(mktemp -d)}
DATA=${DATA:-$( [ -f ../shared/data/alpaca_en_demo.json ] && echo ../shared/data/alpaca_en_demo.json \
                || echo examples/data/alpaca_sample.json )}
MODEL=${MODEL:-embedded:SmolLM2-135M-Instruct}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SECTIONS=" ${SECTIONS:-1a 1b 1c 2 3 4 5 6 7 8 9 10} "
mkdir -p "$OUT"
VARIANTS=${VARIANTS:-baseline,eager,compiled,packed,varlen}
THROUGHPUT=($PYTHON benchmarks/throughput.py --model_name_or_path "$MODEL" --data_path "$DATA"
            --num_examples "${NUM_EXAMPLES:-256}" --repeats 3)
SECTION_SECONDS=${SECTION_SECONDS:-300}
RUN_SECONDS=${RUN_SECONDS:-0}
section() { echo; echo "=== $* ($(date +%T))"; SECTION_END=$(( SECONDS + SECTION_SECONDS )); }
# run NAME SECONDS COMMAND...: COMMAND's output to $OUT/NAME.log, at most SECONDS (and RUN_SECONDS) and no later than
# the section's end; prints its "Trained to step" line (else its last line), or why it failed: exit status and the
# error's lines. Its exit status is left in RUN_STATUS (empty: not started).
run() {
  local name=$1 seconds=$2 status=0; shift 2
  RUN_STATUS=
  (( RUN_SECONDS > 0 && RUN_SECONDS < seconds )) && seconds=$RUN_SECONDS
  (( SECTION_END - SECONDS < seconds )) && seconds=$(( SECTION_END - SECONDS ))
  if (( seconds < 5 )); then echo "$name: not started (the section's ${SECTION_SECONDS} s are spent)"; return; fi
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1 || status=$?
  RUN_STATUS=$status
  if (( status == 0 )); then
    grep -ah "Trained to step" "$OUT/$name.log" || tail -1 "$OUT/$name.log"
    return
  fi
  echo "$name: failed (exit $status$( (( status == 124 )) && echo ", timed out after $seconds s"))"
  # our one error line, an exception's, or torchrun's child failure; then the last lines
  local errors
  errors=$(grep -aE "error: |^(\[rank[0-9]+\]: )?[A-Za-z_.]*(Error|Exception)\b" "$OUT/$name.log" \
           | grep -v ChildFailedError | tail -3 || true)
  [[ -n $errors ]] && sed 's/^/    /' <<< "$errors"
  grep -av '^[[:space:]]*$' "$OUT/$name.log" | tail -4 | grep -vxF -f <(printf '%s\n' "$errors") | sed 's/^/    | /' || true
}
wants() { [[ $SECTIONS == *" $1 "* ]]; }

section "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PYTHON -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__)"

# throughput NAME SECONDS FLAGS...: benchmarks/throughput.py's rows as they come, for at most SECONDS and no later than
# the section's end, no new variant in its last third; its stderr in $OUT/NAME.log, whose last lines print if it fails
throughput() {
  local name=$1 seconds=$2 status=0; shift 2
  (( SECTION_END - SECONDS < seconds )) && seconds=$(( SECTION_END - SECONDS ))
  if (( seconds < 5 )); then echo "$name: not started (the section's ${SECTION_SECONDS} s are spent)"; return; fi
  timeout "$seconds" "${THROUGHPUT[@]}" --time_budget $(( seconds * 2 / 3 )) "$@" 2> "$OUT/$name.log" || status=$?
  (( status == 0 )) || { echo "$name: failed (exit $status)"; tail -5 "$OUT/$name.log" | sed 's/^/    | /'; }
}

if wants 1a; then
  section "1a. throughput, SmolLM2-135M"
  throughput 1a "$SECTION_SECONDS" --variants "$VARIANTS" --batch_sizes 8,32,64
fi
if wants 1b; then
  section "1b. throughput, Llama-3.2-1B shape"
  throughput 1b "$SECTION_SECONDS" --variants "$VARIANTS" --batch_sizes 8,32 --model_shape llama-3.2-1b
fi
if wants 1c; then
  section "1c. attention backend: cuDNN's SDPA off (against 1a and 1b's baseline and eager rows)"
  throughput 1c-smollm2 $(( SECTION_SECONDS / 2 )) --variants baseline,eager --batch_sizes 8 --cudnn_sdpa off
  throughput 1c-1b "$SECTION_SECONDS" --variants baseline,eager --batch_sizes 8 --cudnn_sdpa off \
      --model_shape llama-3.2-1b
fi
if wants 1d; then
  section "1d. throughput, Llama-3.1-8B shape (random bf16 weights built on the GPU)"
  throughput 1d "$SECTION_SECONDS" --variants "$VARIANTS" --batch_sizes 8 --model_shape llama-3.1-8b
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

try:
    reference_weights, reference_losses = run(reference)
except (OSError, ValueError) as error:
    sys.exit(f"{reference:>14}: no complete output ({error!r}), nothing to compare with")
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
  run sync 40 $PYTHON benchmarks/sync_count.py train.py "${COMMON[@]}" --logging_steps 1000 --output_dir "$OUT/sync"
  [[ -f $OUT/sync.log ]] && sed -n '/synchronizing operations/,$p' "$OUT/sync.log"
fi

if wants 3; then
  section "3. train.py vs train_multigpu.py (1 process, NCCL) and --fsdp"
  run single 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/single"
  run single-again 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/single-again"
  run ddp 40 "${ONE_PROCESS[@]}" "${COMMON[@]}" --output_dir "$OUT/ddp"
  run fsdp 40 "${ONE_PROCESS[@]}" "${COMMON[@]}" --fsdp --output_dir "$OUT/fsdp"
  compare single single-again ddp fsdp || echo "(compare failed)"
fi

if wants 4; then
  section "4. float32 with placeholders and dropout: --fsdp, DeepSpeed ZeRO-2, ZeRO-3, ZeRO-3 offload (1 process)"
  FP32=(--model_name_or_path "$MODEL" --data_path examples/data/alpaca_sample.json --num_train_epochs 2
        --per_device_train_batch_size 8 --gradient_accumulation_steps 4 --dtype float32 --dropout 0.1
        --logging_steps 1 --num_sample_answers 0 --overwrite_output_dir)
  run fp32 40 $PYTHON train.py "${FP32[@]}" --output_dir "$OUT/fp32"
  run fp32-again 40 $PYTHON train.py "${FP32[@]}" --output_dir "$OUT/fp32-again"
  run fp32-fsdp 50 "${ONE_PROCESS[@]}" "${FP32[@]}" --fsdp --output_dir "$OUT/fp32-fsdp"
  for config in zero2 zero3 zero3_offload; do
    run "fp32-$config" 70 "${ONE_PROCESS[@]}" "${FP32[@]}" --deepspeed "examples/deepspeed/$config.json" \
        --output_dir "$OUT/fp32-$config"
  done
  compare fp32 fp32-again fp32-fsdp fp32-zero2 fp32-zero3 fp32-zero3_offload || echo "(compare failed)"
fi

if wants 5; then
  section "5. packs, bf16: padded vs --packing under sdpa, sdpa_varlen (and flash_attention_2 if installed)"
  PACKED=(sdpa sdpa_varlen)
  $PYTHON -c "import flash_attn" 2>/dev/null && PACKED+=(flash_attention_2)
  run padded 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/padded"
  run padded-again 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/padded-again"
  for attention in "${PACKED[@]}"; do
    run "packed-$attention" 40 $PYTHON train.py "${COMMON[@]}" --packing --attn_implementation "$attention" \
        --output_dir "$OUT/packed-$attention"
  done
  compare padded padded-again "${PACKED[@]/#/packed-}" || echo "(compare failed)"
fi

if wants 6; then
  section "6. bf16: DDP, --fsdp, ZeRO-2, ZeRO-3, ZeRO-3 offload (1 process), and train.py split by --device_map"
  run bf16 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/bf16"
  run bf16-again 30 $PYTHON train.py "${COMMON[@]}" --output_dir "$OUT/bf16-again"
  run bf16-ddp 40 "${ONE_PROCESS[@]}" "${COMMON[@]}" --output_dir "$OUT/bf16-ddp"
  run bf16-fsdp 40 "${ONE_PROCESS[@]}" "${COMMON[@]}" --fsdp --output_dir "$OUT/bf16-fsdp"
  for config in zero2 zero3 zero3_offload; do
    run "bf16-$config" 70 "${ONE_PROCESS[@]}" "${COMMON[@]}" --deepspeed "examples/deepspeed/$config.json" \
        --output_dir "$OUT/bf16-$config"
  done
  # half of SmolLM2's bf16 layers on the GPU, the rest in CPU memory; then layers 0-3 on disk, the rest on the GPU
  run bf16-cpu-split 60 $PYTHON train.py "${COMMON[@]}" --device_map auto \
      --max_memory '{"0": "160MiB", "cpu": "8GiB"}' --output_dir "$OUT/bf16-cpu-split"
  DISK_MAP=$($PYTHON -c "import json; print(json.dumps({'model.embed_tokens': 0, **{f'model.layers.{i}': 'disk' if i < 4
else 0 for i in range(30)}, 'model.norm': 0, 'model.rotary_emb': 0, 'lm_head': 0}))")
  run bf16-disk-split 90 $PYTHON train.py "${COMMON[@]}" --device_map "$DISK_MAP" --offload_folder "$OUT/offload" \
      --output_dir "$OUT/bf16-disk-split"
  compare bf16 bf16-again bf16-ddp bf16-fsdp bf16-zero2 bf16-zero3 bf16-zero3_offload bf16-cpu-split \
      bf16-disk-split || echo "(compare failed)"
fi

if wants 7; then
  section "7. a 4-bit NF4 base, bf16 compute: train.py, DDP and --fsdp (1 process)"
  run nf4 40 $PYTHON train.py "${COMMON[@]}" --load_in_4bit --output_dir "$OUT/nf4"
  run nf4-again 40 $PYTHON train.py "${COMMON[@]}" --load_in_4bit --output_dir "$OUT/nf4-again"
  run nf4-ddp 50 "${ONE_PROCESS[@]}" "${COMMON[@]}" --load_in_4bit --output_dir "$OUT/nf4-ddp"
  run nf4-fsdp 50 "${ONE_PROCESS[@]}" "${COMMON[@]}" --load_in_4bit --fsdp --output_dir "$OUT/nf4-fsdp"
  compare nf4 nf4-again nf4-ddp nf4-fsdp || echo "(compare failed)"
fi
# float32 with TF32 off: torch's float32 matmuls round as float32 (train.py turns TF32 on for speed)
EXACT=(env NVIDIA_TF32_OVERRIDE=0)
if wants 8; then
  section "8. packed vs padded, float32, TF32 off: --packing under sdpa; sdpa_varlen has no float32 kernel"
  run fp32-padded 30 "${EXACT[@]}" $PYTHON train.py "${COMMON[@]}" --dtype float32 --output_dir "$OUT/fp32-padded"
  run fp32-padded-again 30 "${EXACT[@]}" $PYTHON train.py "${COMMON[@]}" --dtype float32 \
      --output_dir "$OUT/fp32-padded-again"
  run fp32-packed-sdpa 40 "${EXACT[@]}" $PYTHON train.py "${COMMON[@]}" --dtype float32 --packing \
      --output_dir "$OUT/fp32-packed-sdpa"
  run fp32-packed-sdpa_varlen 20 "${EXACT[@]}" $PYTHON train.py "${COMMON[@]}" --dtype float32 --packing \
      --attn_implementation sdpa_varlen --output_dir "$OUT/fp32-packed-sdpa_varlen"
  compare fp32-padded fp32-padded-again fp32-packed-sdpa || echo "(compare failed)"
fi

if wants 9; then
  section "9. ZeRO-3 and ZeRO-3 offload against train.py, float32, TF32 off (1 process)"
  [[ -f $OUT/fp32-padded/metrics.jsonl ]] || run fp32-padded 30 "${EXACT[@]}" $PYTHON train.py "${COMMON[@]}" \
      --dtype float32 --output_dir "$OUT/fp32-padded"
  for config in zero3 zero3_offload; do
    run "fp32-exact-$config" 70 "${EXACT[@]}" "${ONE_PROCESS[@]}" "${COMMON[@]}" --dtype float32 \
        --deepspeed "examples/deepspeed/$config.json" --output_dir "$OUT/fp32-exact-$config"
  done
  compare fp32-padded fp32-exact-zero3 fp32-exact-zero3_offload || echo "(compare failed)"
fi

if wants 10; then
  section "10. train_multigpu.py as NCCL runs it (1 process), with evaluation and sample answers: DDP, --fsdp," \
          "--fsdp offload, ZeRO-2, ZeRO-3, ZeRO-3 offload"
  WITH_EVAL=(--model_name_or_path "$MODEL" --data_path "$DATA" --max_steps 4 --logging_steps 1
             --per_device_train_batch_size 8 --eval_split_ratio 0.1 --eval_strategy steps --eval_steps 2
             --per_device_eval_batch_size 8 --num_sample_answers 2 --max_new_tokens 16 --ddp_timeout 120
             --overwrite_output_dir)
  # nccl NAME SECONDS FLAGS...: one process under torchrun (a free port: --standalone), its collectives recorded
  # (tests/collective_ledger.py); passed when it ends 0, printed its "Trained to step" line, saved its interventions
  # and gave each collective tensors on its GPU (the host group's on the CPU), each group waiting --ddp_timeout
  # (run() says why a run that ended otherwise failed)
  nccl() {
    local name=nccl-$1 seconds=$2; shift 2
    run "$name" "$seconds" env LEDGER="$OUT/$name-ledger" $PYTHON -m torch.distributed.run --standalone \
        --nproc_per_node 1 tests/faults.py train_multigpu.py "${WITH_EVAL[@]}" "$@" --output_dir "$OUT/$name"
    [[ $RUN_STATUS == 0 ]] || return 0
    local trained=no saved=no ledger
    grep -aq "Trained to step" "$OUT/$name.log" && trained=yes
    compgen -G "$OUT/$name/intkey_*" > /dev/null && saved=yes
    ledger=$($PYTHON -c "import sys; sys.path[:0] = ['tests', '.']; from collective_ledger import check; \
calls = check(__import__('pathlib').Path(sys.argv[1]), 1, 120)[0]; print(f'{len(calls)} collectives in step')" \
             "$OUT/$name-ledger" 2>&1 | tail -1)
    if [[ $trained == yes && $saved == yes && $ledger == *"in step" ]]; then echo "$name: passed ($ledger)"
    else echo "$name: did not pass (exit 0; \"Trained to step\" printed: $trained, interventions saved: $saved," \
              "ledger: $ledger)"
    fi
  }
  nccl ddp 40
  nccl fsdp 45 --fsdp
  nccl fsdp-offload 50 --fsdp "full_shard offload"
  for config in zero2 zero3 zero3_offload; do
    nccl "$config" 60 --deepspeed "examples/deepspeed/$config.json"
  done
fi

if wants 11; then
  section "11. Llama-3.1-70B's shapes in NF4 on one GPU: built on the device, trained by train.py's loop"
  # shellcheck disable=SC2086  # NF4_70B_SHAPE is flags
  run llama70b-nf4 "$SECTION_SECONDS" $PYTHON benchmarks/llama70b_nf4.py ${NF4_70B_SHAPE:-} "${COMMON[@]}" \
      --gradient_checkpointing --output_dir "$OUT/llama70b-nf4"
  grep -ahE "^built |^memory since" "$OUT/llama70b-nf4.log" 2>/dev/null || true
fi
echo; echo "done ($(date +%T)); outputs in $OUT"
