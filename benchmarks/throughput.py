"""Training throughput: our batching against the HF-Trainer/pyreft way, and against the machine's matmul roof.

    python benchmarks/throughput.py                    # SmolLM2, ../shared/data/alpaca_en_demo.json if present
    python benchmarks/throughput.py --steps 12 --nproc 2

Two variants do the same work (N optimizer steps of B examples, same model and interventions), each in its
own process so that its peak memory is its own:
  ours      length-grouped batches (--group_by_length) and the LM head only from the first label position
  baseline  uniformly random batches padded to their longest example and full-vocabulary logits at every
            position, as HF's Trainer with pyreft's collator does
It prints non-pad tokens/s, their ratio, the padding fraction and peak memory; then this machine's dense
matmul FLOP/s and the achieved training FLOP/s (4 x parameters x tokens for a frozen base, plus 6 x
intervention parameters x intervened positions) as a fraction of it. --nproc N also runs train_multigpu.py
on 1 and N processes and prints the scaling efficiency.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SHARED_DATA = REPO.parent / "shared" / "data" / "alpaca_en_demo.json"
# Dense bf16 peak of common GPUs (no sparsity), FLOP/s, for MFU; override with --peak_flops.
GPU_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", default="embedded:SmolLM2-135M-Instruct")
    parser.add_argument("--data_path", default=str(SHARED_DATA if SHARED_DATA.exists()
                                                   else REPO / "examples" / "data" / "alpaca_sample.json"))
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per variant (the first is warm-up)")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--layers", default="8;19")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--model_max_length", type=int, default=512)
    parser.add_argument("--nproc", type=int, default=0, help="also measure train_multigpu.py on 1 and N processes")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed steps, profile 3 more of each variant and print its top operators")
    parser.add_argument("--peak_flops", type=float, default=None, help="the device's peak FLOP/s, for MFU")
    parser.add_argument("--variant", choices=["ours", "baseline"], help=argparse.SUPPRESS)
    return parser.parse_args()


def run_variant(args: argparse.Namespace) -> dict:
    """One variant, in this process: returns what it measured."""
    import numpy as np
    import torch

    from alpaca.data import Collator, global_batches, load_records, prepare_dataset
    from alpaca.loss import summed_token_loss, token_weighted_loss
    from alpaca.model import (
        build_reft_model,
        intervention_parameters,
        load_base_model,
        resolve_dtype,
        resolve_model_path,
    )

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    model, tokenizer = load_base_model(resolve_model_path(args.model_name_or_path), resolve_dtype("auto", device),
                                       device)
    records = load_records(args.data_path)
    dataset = prepare_dataset(records, tokenizer, args.model_max_length)
    torch.manual_seed(0)
    reft_model = build_reft_model(model, args.layers, (1, 1), False, args.rank)
    parameters = [p for _, p in intervention_parameters(reft_model)]
    optimizer = torch.optim.AdamW(parameters, lr=1e-3)
    collate = Collator(tokenizer.pad_token_id, (1, 1), False, len(reft_model.interventions) // 2)
    ours = args.variant == "ours"
    lengths = np.array(dataset["length"]) if ours else None
    batches = global_batches(len(dataset), args.per_device_train_batch_size, 0, 0, lengths)

    def train_step(indices: list[int]) -> dict:
        batch = collate([dataset[i] for i in indices])
        loss = (summed_token_loss if ours else baseline_summed_loss)(reft_model, batch, device)
        token_weighted_loss(loss, batch["num_label_tokens"]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return batch

    tokens = padded = positions = 0
    for step, indices in enumerate(batches[: args.steps]):
        if step == 1:  # the first step is warm-up (allocator, kernels)
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        batch = train_step(indices)
        if step >= 1:
            tokens += int(batch["attention_mask"].sum())
            padded += batch["attention_mask"].numel()
            positions += sum(len(window[0]) for window in batch["intervention_locations"]) * len(indices)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as profiler:
            for indices in batches[args.steps : args.steps + 3]:
                train_step(indices)
            if device.type == "cuda":
                torch.cuda.synchronize()
        averages = profiler.key_averages()
        print(f"--- {args.variant}: 3 steps, top operators by self CPU time", file=sys.stderr)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=15), file=sys.stderr)
        if device.type == "cuda":
            print(f"--- {args.variant}: top operators by self device time", file=sys.stderr)
            print(averages.table(sort_by="self_device_time_total", row_limit=12), file=sys.stderr)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    base_parameters = sum(p.numel() for p in model.parameters())
    intervention_parameters_count = sum(p.numel() for p in parameters)
    flops = 4 * base_parameters * tokens + 6 * intervention_parameters_count / len(reft_model.interventions) * positions
    return {"variant": args.variant, "tokens": tokens, "padded_tokens": padded, "seconds": seconds,
            "peak_bytes": peak, "flops": flops, "device": torch.cuda.get_device_name(device)
            if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"}


def baseline_summed_loss(reft_model, batch: dict, device):
    """The loss as pyreft's ReftTrainer computes it under HF's Trainer (summed here, like ours): the LM head
    runs at every position."""
    import torch
    import torch.nn.functional as F

    _, outputs = reft_model(
        {"input_ids": batch["input_ids"].to(device), "attention_mask": batch["attention_mask"].to(device),
         "use_cache": False},
        unit_locations={"sources->base": (None, batch["intervention_locations"])},
    )
    logits = outputs.logits[:, :-1].to(torch.float32)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1).to(device),
                           ignore_index=-100, reduction="sum")


def matmul_flops() -> tuple[float, str]:
    """Dense matmul FLOP/s of this machine in the training dtype: the roof our FLOP/s is compared with."""
    import torch

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = 8192 if device.type == "cuda" else 2048
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    repeats = 50 if device.type == "cuda" else 10
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - started), f"{size}x{size} {dtype}"


def multigpu_tokens_per_s(args: argparse.Namespace, nproc: int) -> float:
    """train_multigpu.py's own logged global tokens/s, steps after the first."""
    with tempfile.TemporaryDirectory() as output_dir:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   str(REPO / "train_multigpu.py"), "--model_name_or_path", args.model_name_or_path, "--data_path",
                   args.data_path, "--output_dir", output_dir, "--layers", args.layers, "--rank", str(args.rank),
                   "--per_device_train_batch_size", str(max(1, args.per_device_train_batch_size // nproc)),
                   "--max_steps", str(args.steps), "--logging_steps", "1", "--num_sample_answers", "0"]
        subprocess.run(command, check=True, capture_output=True, text=True)
        records = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))][1:]
        return sum(r["tokens_per_s"] for r in records) / len(records)


def main() -> None:
    args = parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    print(f"model {args.model_name_or_path} | data {args.data_path} | {args.steps} steps of "
          f"{args.per_device_train_batch_size} examples (the first is warm-up) | layers {args.layers}, "
          f"rank {args.rank}")
    results = {}
    for variant in ("baseline", "ours"):
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant],
                               capture_output=True, text=True)
        if child.returncode:
            sys.exit(f"{variant} failed:\n{child.stderr[-3000:]}")
        results[variant] = json.loads(child.stdout.strip().splitlines()[-1])
        if args.profile:
            print(child.stderr[child.stderr.find(f"--- {variant}"):])
    roof, roof_shape = matmul_flops()
    peak = args.peak_flops or next((flops for name, flops in GPU_PEAK_FLOPS.items()
                                    if name in results["ours"]["device"]), None)
    print(f"device: {results['ours']['device']}; dense matmul ({roof_shape}): {roof / 1e9:.1f} GFLOP/s")
    print(f"{'variant':<10} {'non-pad tok/s':>14} {'padding':>8} {'peak mem':>10} {'train GFLOP/s':>14} "
          f"{'of matmul':>10}" + (f" {'MFU':>6}" if peak else ""))
    for name, r in results.items():
        rate = r["tokens"] / r["seconds"]
        achieved = r["flops"] / r["seconds"]
        print(f"{name:<10} {rate:>14.1f} {1 - r['tokens'] / r['padded_tokens']:>8.1%} "
              f"{r['peak_bytes'] / 2**30:>8.2f} GiB {achieved / 1e9:>14.1f} {achieved / roof:>10.1%}"
              + (f" {achieved / peak:>6.1%}" if peak else ""))
    ratio = (results["ours"]["tokens"] / results["ours"]["seconds"]) / (
        results["baseline"]["tokens"] / results["baseline"]["seconds"])
    print(f"ours / baseline non-pad tokens/s: {ratio:.2f}x")
    if args.nproc > 1:
        one, many = multigpu_tokens_per_s(args, 1), multigpu_tokens_per_s(args, args.nproc)
        print(f"train_multigpu.py: 1 process {one:.1f} tok/s, {args.nproc} processes {many:.1f} tok/s; "
              f"scaling efficiency {many / (args.nproc * one):.0%} (same global batch)")


if __name__ == "__main__":
    main()
