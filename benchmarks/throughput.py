"""Training throughput: our training step against the HF-Trainer/pyreft way, at several batch sizes.

    python benchmarks/throughput.py                         # SmolLM2, ../shared/data/alpaca_en_demo.json if present
    python benchmarks/throughput.py --batch_sizes 8,32,64 --model_shape llama-3.2-1b   # on a GPU
    python benchmarks/throughput.py --steps 12 --nproc 2

Two variants do the same work (N optimizer steps of B examples, same model and interventions), each batch
size of each in its own process so that its peak memory is its own:
  ours      the scripts' step: GlobalBatchSampler + DataLoader (workers and pinned memory per device, as
            the scripts default), length-grouped batches padded to --pad_to_multiple_of, no attention mask,
            the LM head only from the first label position, no host sync inside the step
  baseline  uniformly random batches padded to their longest example, the attention mask and
            full-vocabulary logits at every position, collated in the loop, as HF's Trainer with pyreft's
            collator does
For each batch size it prints non-pad tokens/s of both, their ratio, the padding fraction, peak memory,
and host and device milliseconds per step (torch.profiler, 3 extra steps); then this machine's dense
matmul FLOP/s and the achieved training FLOP/s (4 x parameters x tokens for a frozen base, plus 6 x
intervention parameters x intervened positions) as a fraction of it. --model_shape llama-3.2-1b builds
that model's configuration with random weights (same cost per token as the real one; needs no download).
--nproc N also runs train_multigpu.py on 1 and N processes and prints the scaling efficiency.
"""

from __future__ import annotations

import argparse
import itertools
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
    parser.add_argument("--batch_sizes", default=None,
                        help="per-device batch sizes, comma-separated; default: 8,32,64 on CUDA, 8 on CPU")
    parser.add_argument("--model_shape", choices=["pretrained", "llama-3.2-1b"], default="pretrained",
                        help="pretrained: --model_name_or_path as is; llama-3.2-1b: that configuration with random "
                             "weights and --model_name_or_path's tokenizer")
    parser.add_argument("--pad_to_multiple_of", type=int, default=None, help="ours; default: the scripts' default")
    parser.add_argument("--dataloader_num_workers", type=int, default=None, help="ours; default: the scripts'")
    parser.add_argument("--layers", default=None, help="default: 8;19 (SmolLM2's 30 layers), 4;10 for llama-3.2-1b")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--model_max_length", type=int, default=512)
    parser.add_argument("--nproc", type=int, default=0, help="also measure train_multigpu.py on 1 and N processes")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed steps, profile 3 more of each variant and print its top operators")
    parser.add_argument("--peak_flops", type=float, default=None, help="the device's peak FLOP/s, for MFU")
    parser.add_argument("--variant", choices=["ours", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--per_device_train_batch_size", type=int, help=argparse.SUPPRESS)  # the variant's
    return parser.parse_args()


LLAMA_3_2_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                   tie_word_embeddings=True, rms_norm_eps=1e-5)


def load_model(args: argparse.Namespace, device):
    """The base model and tokenizer: pretrained, or Llama-3.2-1B's shapes with random weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from alpaca.model import load_base_model, resolve_dtype, resolve_model_path

    dtype = resolve_dtype("auto", device)
    model, tokenizer = load_base_model(resolve_model_path(args.model_name_or_path), dtype, device)
    if args.model_shape == "llama-3.2-1b":
        torch.manual_seed(0)
        config = LlamaConfig(**LLAMA_3_2_1B, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        with torch.device(device):  # initialized where it runs: seconds on a GPU instead of a minute on the CPU
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.requires_grad_(False)
        model.eval()
    return model, tokenizer


def run_variant(args: argparse.Namespace) -> dict:
    """One variant at one batch size, in this process: returns what it measured."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    from alpaca.args import resolve_device_defaults
    from alpaca.data import (
        Collator,
        GlobalBatchSampler,
        StepCollator,
        dataloader_worker_init,
        global_batches,
        load_records,
        prepare_dataset,
    )
    from alpaca.loss import summed_token_loss, token_weighted_loss
    from alpaca.model import build_reft_model, intervention_parameters

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    resolve_device_defaults(args, device.type)
    model, tokenizer = load_model(args, device)
    dataset = prepare_dataset(load_records(args.data_path), tokenizer, args.model_max_length)
    torch.manual_seed(0)
    reft_model = build_reft_model(model, args.layers, (1, 1), False, args.rank)
    parameters = [p for _, p in intervention_parameters(reft_model)]
    optimizer = torch.optim.AdamW(parameters, lr=1e-3)
    num_layers = len(reft_model.interventions) // 2
    batch_size, ours = args.per_device_train_batch_size, args.variant == "ours"
    if ours:  # as train.py builds it
        sampler = GlobalBatchSampler(len(dataset), batch_size, seed=0, lengths=np.array(dataset["length"]))
        collate = Collator(tokenizer.pad_token_id, (1, 1), False, num_layers, args.pad_to_multiple_of)
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=StepCollator(collate, batch_size),
                            num_workers=args.dataloader_num_workers, pin_memory=device.type == "cuda",
                            worker_init_fn=dataloader_worker_init)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    else:
        collate = Collator(tokenizer.pad_token_id, (1, 1), False, num_layers)
        del reft_model._scatter_intervention_output  # pyvene's own, with its host-to-device copy in each hook

    def epochs():
        """Each step's micro-batches, epoch after epoch."""
        for epoch in itertools.count():
            if ours:
                sampler.set_epoch(epoch)
                yield from loader
            else:
                for indices in global_batches(len(dataset), batch_size, 0, epoch):
                    yield [collate([dataset[i] for i in indices])]

    steps = epochs()

    def train_step(micro_batches: list[dict]) -> None:
        if ours:
            label_tokens = sum(batch["num_label_tokens"] for batch in micro_batches)
            for batch in micro_batches:
                summed_loss = summed_token_loss(reft_model, batch, device)
                token_weighted_loss(summed_loss, label_tokens).backward()
                loss_sum.add_(summed_loss.detach())  # on the device, as the scripts keep it
        else:
            batch = micro_batches[0]
            token_weighted_loss(baseline_summed_loss(reft_model, batch, device), batch["num_label_tokens"]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    tokens = padded = positions = 0
    for step in range(args.steps):
        micro_batches = next(steps)
        if step == 1:  # the first step is warm-up (allocator, kernels)
            synchronize()
            started = time.perf_counter()
        train_step(micro_batches)
        if step >= 1:
            tokens += sum(batch["num_tokens"] for batch in micro_batches)
            padded += sum(batch["input_ids"].numel() for batch in micro_batches)
            positions += sum(sum(len(window[0]) for window in batch["intervention_locations"])
                             * batch["input_ids"].shape[0] for batch in micro_batches)
    synchronize()
    seconds = time.perf_counter() - started
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"  # before the profiler's own memory
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    host_ms, device_ms = profile_steps(args, train_step, steps, device)
    base_parameters = sum(p.numel() for p in model.parameters())
    intervention_parameters_count = sum(p.numel() for p in parameters)
    flops = 4 * base_parameters * tokens + 6 * intervention_parameters_count / len(reft_model.interventions) * positions
    return {"variant": args.variant, "batch_size": batch_size, "tokens": tokens, "padded_tokens": padded,
            "seconds": seconds, "peak_bytes": peak, "flops": flops, "host_ms": host_ms, "device_ms": device_ms,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"CPU, {torch.get_num_threads()} threads"}


PROFILED_STEPS = 3


def profile_steps(args: argparse.Namespace, train_step, steps, device) -> tuple[float, float | None]:
    """Host and device milliseconds per step over PROFILED_STEPS more steps. Host: wall time of the step on the
    CPU (issuing work, Python, and any wait for the device); device: the kernels' own time, summed."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for _ in range(PROFILED_STEPS):
            micro_batches = next(steps)
            with record_function("train_step"):
                train_step(micro_batches)
        if device.type == "cuda":
            torch.cuda.synchronize()
    averages = profiler.key_averages()
    host_ms = next(event.cpu_time_total for event in averages if event.key == "train_step") / 1e3 / PROFILED_STEPS
    device_ms = (sum(event.self_device_time_total for event in averages) / 1e3 / PROFILED_STEPS
                 if device.type == "cuda" else None)
    if args.profile:
        print(f"--- {args.variant}, batch {args.per_device_train_batch_size}: {PROFILED_STEPS} steps, top operators "
              "by self CPU time", file=sys.stderr)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=15), file=sys.stderr)
        if device.type == "cuda":
            print(f"--- {args.variant}: top operators by self device time", file=sys.stderr)
            print(averages.table(sort_by="self_device_time_total", row_limit=12), file=sys.stderr)
    return host_ms, device_ms


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
    if args.layers is None:
        args.layers = "8;19" if args.model_shape == "pretrained" else "4;10"
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    import torch

    batch_sizes = [int(size) for size in (args.batch_sizes or ("8,32,64" if torch.cuda.is_available() else "8"))
                   .split(",")]
    print(f"model {args.model_name_or_path} ({args.model_shape}) | data {args.data_path} | {args.steps} steps per "
          f"batch size (the first is warm-up), then {PROFILED_STEPS} profiled | layers {args.layers}, rank {args.rank}")
    roof, roof_shape = matmul_flops()
    header_printed = False
    for batch_size in batch_sizes:  # each row as soon as it is measured: a run cut short keeps what it had
        results = {}
        for variant in ("baseline", "ours"):
            child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant,
                                    "--per_device_train_batch_size", str(batch_size)], capture_output=True, text=True)
            if child.returncode:
                sys.exit(f"{variant} at batch {batch_size} failed:\n{child.stderr[-3000:]}")
            results[variant] = json.loads(child.stdout.strip().splitlines()[-1])
            if args.profile:
                print(child.stderr[child.stderr.find(f"--- {variant}"):])
        device = results["ours"]["device"]
        peak = args.peak_flops or next((flops for name, flops in GPU_PEAK_FLOPS.items() if name in device), None)
        if not header_printed:
            print(f"device: {device}; dense matmul ({roof_shape}): {roof / 1e9:.1f} GFLOP/s")
            print(f"{'batch':>5} {'variant':<9} {'non-pad tok/s':>14} {'ratio':>6} {'padding':>8} {'peak mem':>10} "
                  f"{'host ms':>8} {'device ms':>9} {'GFLOP/s':>8} {'of matmul':>9}" + (f" {'MFU':>6}" if peak else ""))
            header_printed = True
        rates = {variant: r["tokens"] / r["seconds"] for variant, r in results.items()}
        for variant, r in results.items():
            achieved = r["flops"] / r["seconds"]
            ratio = f"{rates['ours'] / rates['baseline']:.2f}x" if variant == "ours" else ""
            device_ms = f"{r['device_ms']:.1f}" if r["device_ms"] is not None else "-"
            print(f"{batch_size:>5} {variant:<9} {rates[variant]:>14.1f} {ratio:>6} "
                  f"{1 - r['tokens'] / r['padded_tokens']:>8.1%} {r['peak_bytes'] / 2**30:>6.2f} GiB "
                  f"{r['host_ms']:>8.1f} {device_ms:>9} {achieved / 1e9:>8.1f} {achieved / roof:>9.1%}"
                  + (f" {achieved / peak:>6.1%}" if peak else ""), flush=True)
    if args.nproc > 1:
        args.per_device_train_batch_size = batch_sizes[0]
        one, many = multigpu_tokens_per_s(args, 1), multigpu_tokens_per_s(args, args.nproc)
        print(f"train_multigpu.py: 1 process {one:.1f} tok/s, {args.nproc} processes {many:.1f} tok/s; "
              f"scaling efficiency {many / (args.nproc * one):.0%} (same global batch)")


if __name__ == "__main__":
    main()
