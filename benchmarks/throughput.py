"""Training throughput: our training step against the HF-Trainer/pyreft way, at several batch sizes.

    python benchmarks/throughput.py                         # SmolLM2, ../shared/data/alpaca_en_demo.json if present
    python benchmarks/throughput.py --batch_sizes 8,32,64 --model_shape llama-3.2-1b   # on a GPU
    python benchmarks/throughput.py --num_examples 236 --repeats 2      # on a CPU: 30 steps of batch 8

Each variant is a set of flags (VARIANTS) for a process of its own per batch size, so that its peak memory is its
own; each row is printed as soon as it is measured (a failed variant as its error's last lines), and --time_budget
stops starting variants, so a run cut short keeps what it measured. Adding a variant (a packed step, another
attention backend) is one more entry:
  baseline  uniformly random batches padded to their longest example, the attention mask and full-vocabulary
            logits at every position, collated in the loop, pyvene's own index writes: HF's Trainer with
            pyreft's collator
  eager     the scripts' step: DistributedGlobalBatchSampler + DataLoader (workers and pinned memory per device, as the
            scripts default), length-grouped batches padded to --pad_to_multiple_of, no attention mask, the
            LM head only from the first label position, no host sync inside the forward
  compiled  eager with --torch_compile (each decoder layer's forward compiled)
  packed    eager with --packing: each step's examples end to end in packs of up to batch x --model_max_length
            tokens, no padding but each pack's tail (rounded to --pad_to_multiple_of); SDPA given the packs'
            position ids, which on a GPU builds a mask over the whole pack (attention computed across examples,
            then masked)
  varlen    packed with --attn_implementation sdpa_varlen: each pack through torch's varlen flash kernel (CUDA)
  flash     packed with --attn_implementation flash_attention_2 (the flash-attn package, CUDA); not by default

How it times (docs/performance.md, Method): every variant trains on the same --num_examples examples (seeded),
an epoch of them per timed window, repeated until a window holds at least --min_steps (30) steps. Before timing,
each variant runs one step of every distinct step shape of that window (each padded width, the partial last
batch): shape-keyed work (cuDNN plans, compiled graphs, allocator blocks) is never inside a timed window. The
window is timed --repeats times, with CUDA events on a GPU; the table gives the median and the range of
non-pad tokens/s. On a GPU (or with --profile) the same window then runs once more, 6 of its steps under
torch.profiler: host milliseconds per step, and device milliseconds counted as torch's own table counts them (device
events only); on a CPU the host's milliseconds are the timed step's. MFU is training FLOP/s over the device's peak
(GPU_PEAK_FLOPS or --peak_flops; on a CPU, over its measured dense matmul rate), counted two ways: 4 x parameters
per non-pad token (the usual rule, which peers quote), and exactly what ReFT needs (`reft_flops`). --nproc N also
runs train_multigpu.py on 1 and N processes and prints the scaling efficiency.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
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
# Each variant's flags to its own process.
VARIANTS = {"baseline": ["--baseline"], "eager": [], "compiled": ["--torch_compile"], "packed": ["--packing"],
            "varlen": ["--packing", "--attn_implementation", "sdpa_varlen"],
            "flash": ["--packing", "--attn_implementation", "flash_attention_2"]}
DEFAULT_VARIANTS = {"cuda": ["baseline", "eager", "compiled", "packed", "varlen"], "cpu": ["baseline", "eager"]}
MIN_TIMED_STEPS = 30
PROFILED_STEPS = 6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", default="embedded:SmolLM2-135M-Instruct")
    parser.add_argument("--data_path", default=str(SHARED_DATA if SHARED_DATA.exists()
                                                   else REPO / "examples" / "data" / "alpaca_sample.json"))
    parser.add_argument("--num_examples", type=int, default=None,
                        help="train on this many examples of --data_path (seeded; default: all), an epoch of them "
                             "per timed window (several epochs if one has under 30 steps)")
    parser.add_argument("--repeats", type=int, default=3, help="timed windows per variant: median and range")
    parser.add_argument("--min_steps", type=int, default=MIN_TIMED_STEPS,
                        help="steps a timed window holds at least (whole epochs)")
    parser.add_argument("--batch_sizes", default=None,
                        help="per-device batch sizes, comma-separated; default: 8,32,64 on CUDA, 8 on CPU")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated, of {', '.join(VARIANTS)}; default: "
                             f"{','.join(DEFAULT_VARIANTS['cuda'])} on CUDA, {','.join(DEFAULT_VARIANTS['cpu'])} on "
                             "CPU (compiling 30 layers takes minutes there; varlen and flash run on CUDA only)")
    parser.add_argument("--model_shape", choices=["pretrained", *MODEL_SHAPES], default="pretrained",
                        help="pretrained: --model_name_or_path as is; otherwise that configuration with random "
                             "weights (built on the device) and --model_name_or_path's tokenizer")
    parser.add_argument("--pad_to_multiple_of", type=int, default=None, help="ours; default: the scripts' default")
    parser.add_argument("--dataloader_num_workers", type=int, default=None, help="ours; default: the scripts'")
    parser.add_argument("--cudnn_sdpa", default="on", choices=["on", "off"],
                        help="off: torch.backends.cuda.enable_cudnn_sdp(False), SDPA's other backends only")
    parser.add_argument("--layers", default=None, help="default: 8;19 (SmolLM2's 30 layers), 4;10 for llama-3.2-1b")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--model_max_length", type=int, default=512)
    parser.add_argument("--nproc", type=int, default=0, help="also measure train_multigpu.py on 1 and N processes")
    parser.add_argument("--profile", action="store_true", help="print each variant's top operators too")
    parser.add_argument("--peak_flops", type=float, default=None, help="the device's peak FLOP/s, for MFU")
    parser.add_argument("--time_budget", type=float, default=None,
                        help="seconds after which no new variant starts (the rows measured are printed as they come)")
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)  # a child's name
    parser.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torch_compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--packing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--attn_implementation", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--per_device_train_batch_size", type=int, help=argparse.SUPPRESS)  # the child's
    return parser.parse_args()


MODEL_SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5),
}
DEFAULT_LAYERS = {"pretrained": "8;19", "llama-3.2-1b": "4;10", "llama-3.1-8b": "8;19"}


def load_model(args: argparse.Namespace, device):
    """The base model and tokenizer: pretrained, or one of MODEL_SHAPES with random weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from alpaca.model import load_base_model, resolve_dtype, resolve_model_path

    dtype = resolve_dtype("auto", device)
    model, tokenizer = load_base_model(resolve_model_path(args.model_name_or_path), dtype, device)
    if args.model_shape != "pretrained":
        del model
        torch.manual_seed(0)
        config = LlamaConfig(**MODEL_SHAPES[args.model_shape], bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        with torch.device(device):  # initialized where it runs: seconds on a GPU instead of minutes on the CPU
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.requires_grad_(False)
        model.eval()
    return model, tokenizer


def reft_flops(model, reft_model, batch: dict, first_layer: int) -> float:
    """The FLOPs one micro-batch's step needs, exactly: each decoder layer's matmuls (2 per parameter and token)
    and causal attention (2 x hidden x length^2 per sequence) forward, again for the gradient of its input in
    the layers from the first intervened one on (below it nothing needs a gradient); the LM head forward and
    backward at the positions predicting a label; each intervention 6 x its parameters per intervened position.
    Real tokens only (no padding); a pack's examples each attend within themselves."""
    from alpaca.layers import decoder_layers

    config = model.config.get_text_config(decoder=True)
    layers = decoder_layers(model)
    if "cu_seq_lens_q" in batch:  # a pack: its examples' lengths, then its tail's if it has one
        lengths = batch["cu_seq_lens_q"].diff().tolist()
        lengths = lengths[:-1] if sum(lengths) > batch["num_tokens"] else lengths
    else:
        lengths = batch["attention_mask"].sum(dim=1).tolist()
    flops = 0.0
    for index, layer in enumerate(layers):
        passes = 2 if index >= first_layer else 1
        flops += passes * (2 * sum(p.numel() for p in layer.parameters()) * sum(lengths)
                           + 2 * config.hidden_size * sum(length**2 for length in lengths))
    flops += 4 * config.hidden_size * config.vocab_size * batch["num_label_tokens"]
    per_intervention = sum(p.numel() for p in next(iter(reft_model.interventions.values())).parameters())
    return flops + 6 * per_intervention * batch["num_intervened_positions"]


def run_variant(args: argparse.Namespace) -> dict:
    """One variant at one batch size, in this process: returns what it measured."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    from alpaca.args import resolve_device_defaults
    from alpaca.collate import Collator, StepCollator
    from alpaca.data import load_records, prepare_dataset
    from alpaca.flag_values import parse_layers
    from alpaca.loss import summed_token_loss, token_weighted_loss
    from alpaca.model import (
        build_reft_model,
        check_attention,
        compile_decoder_layers,
        intervention_parameters,
        set_attention,
    )
    from alpaca.sampler import DistributedGlobalBatchSampler, dataloader_worker_init, global_batches

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.cudnn_sdpa == "off":
        torch.backends.cuda.enable_cudnn_sdp(False)
    resolve_device_defaults(args, device.type)
    model, tokenizer = load_model(args, device)
    records = load_records(args.data_path)
    if args.num_examples:
        records = records.select(np.random.default_rng(0).permutation(len(records))[: args.num_examples])
    dataset = prepare_dataset(records, tokenizer, args.model_max_length)
    check_attention(args.attn_implementation, device, model.dtype)
    set_attention(model, args.attn_implementation)
    torch.manual_seed(0)
    reft_model = build_reft_model(model, args.layers, (1, 1), False, low_rank_dimension=args.rank)
    if args.torch_compile:
        compile_decoder_layers(model)
    parameters = [p for _, p in intervention_parameters(reft_model)]
    optimizer = torch.optim.AdamW(parameters, lr=1e-3)
    num_layers = len(reft_model.interventions) // 2
    batch_size, ours = args.per_device_train_batch_size, not args.baseline
    if ours:  # as train.py builds it, from the flags it reads
        collate = Collator(tokenizer.pad_token_id, (1, 1), False, num_layers, args.pad_to_multiple_of)
        packing_max_tokens = batch_size * args.model_max_length if args.packing else None
        lengths = np.array(dataset["length"])
        sampler = DistributedGlobalBatchSampler(len(dataset), batch_size, seed=0, lengths=lengths,
                                                packing=(lengths, packing_max_tokens) if args.packing else None)
        loader = DataLoader(dataset, batch_sampler=sampler, pin_memory=device.type == "cuda",
                            collate_fn=StepCollator(collate, batch_size, packing_max_tokens),
                            num_workers=args.dataloader_num_workers, persistent_workers=False,
                            worker_init_fn=dataloader_worker_init, generator=torch.Generator())
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    else:
        collate = Collator(tokenizer.pad_token_id, (1, 1), False, num_layers)
        del reft_model._scatter_intervention_output  # pyvene's own, with its host-to-device copy in each hook
    steps_per_epoch = -(-len(dataset) // batch_size)
    epochs = range(-(-args.min_steps // steps_per_epoch))

    def window():
        """The timed window's steps (each a list of micro-batches): the same ones every time it is walked."""
        for epoch in epochs:
            if ours:
                sampler.set_epoch(epoch)
                yield from loader
            else:
                for indices in global_batches(len(dataset), batch_size, 0, epoch):
                    yield [collate([dataset[i] for i in indices])]

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

    # Warm-up: one step of each distinct shape of the window (widths, the partial last batch, kept logits).
    first_layer = min(parse_layers(args.layers, model.config.get_text_config(decoder=True).num_hidden_layers))
    seen, tokens, padded, flops = set(), 0, 0, 0.0
    for micro_batches in window():
        shape = tuple((tuple(b["input_ids"].shape), b.get("num_kept_logits")) for b in micro_batches)
        tokens += sum(batch["num_tokens"] for batch in micro_batches)
        padded += sum(batch["input_ids"].numel() for batch in micro_batches)
        flops += sum(reft_flops(model, reft_model, batch, first_layer) for batch in micro_batches)
        if shape not in seen:
            seen.add(shape)
            train_step(micro_batches)
    synchronize()
    seconds = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        started = time.perf_counter()
        for micro_batches in window():
            train_step(micro_batches)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            seconds.append(time.perf_counter() - started)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"  # before the profiler's own memory
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    steps = len(epochs) * steps_per_epoch
    if device.type == "cuda" or args.profile:
        host_ms, device_ms = profile_steps(args, train_step, window, steps, device)
    else:  # the host's time is the step's
        host_ms, device_ms = statistics.median(seconds) * 1e3 / steps, None
    base_parameters = sum(p.numel() for p in model.parameters())
    return {"variant": args.variant, "batch_size": batch_size, "tokens": tokens, "padded_tokens": padded,
            "steps": steps, "warmed_shapes": len(seen), "seconds": seconds,
            "peak_bytes": peak, "flops_4n": 4 * base_parameters * tokens, "flops_exact": flops,
            "host_ms": host_ms, "device_ms": device_ms,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"CPU, {torch.get_num_threads()} threads"}


def profile_steps(args: argparse.Namespace, train_step, window, steps: int, device) -> tuple[float, float | None]:
    """Host and device milliseconds per step over the timed window once more, PROFILED_STEPS of its steps, spread
    over it, each under torch.profiler (reading a whole window's events back took minutes on an H200). Host: wall
    time of the step on the CPU (issuing work, Python, and any wait for the device); device: the device events'
    own time, summed as torch's table sums it (a kernel's time is also on its CPU op's row: not counted twice)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    every = -(-steps // PROFILED_STEPS)  # at most PROFILED_STEPS of them: steps 0, every, 2 x every, ...
    host_us = device_us = 0.0
    for number, micro_batches in enumerate(window()):
        if number % every:
            train_step(micro_batches)
            continue
        with profile(activities=activities) as profiler:
            with record_function("train_step"):
                train_step(micro_batches)
            if device.type == "cuda":
                torch.cuda.synchronize()
        averages = profiler.key_averages()
        host_us += next(event.cpu_time_total for event in averages if event.key == "train_step")
        device_us += sum(event.self_device_time_total for event in averages
                         if event.device_type == DeviceType.CUDA and not event.is_user_annotation)
    recorded = -(-steps // every)
    if args.profile:
        print(f"--- {args.variant}, batch {args.per_device_train_batch_size}: the last recorded step's top operators "
              "by self CPU time", file=sys.stderr)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=15), file=sys.stderr)
        if device.type == "cuda":
            print(f"--- {args.variant}: top operators by self device time", file=sys.stderr)
            print(averages.table(sort_by="self_device_time_total", row_limit=12), file=sys.stderr)
    return host_us / 1e3 / recorded, device_us / 1e3 / recorded if device.type == "cuda" else None


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


def multigpu_tokens_per_s(args: argparse.Namespace, nproc: int, batch_size: int) -> float:
    """train_multigpu.py's own logged global tokens/s, steps after the first."""
    with tempfile.TemporaryDirectory() as output_dir:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   str(REPO / "train_multigpu.py"), "--model_name_or_path", args.model_name_or_path, "--data_path",
                   args.data_path, "--output_dir", output_dir, "--layers", args.layers, "--rank", str(args.rank),
                   "--per_device_train_batch_size", str(max(1, batch_size // nproc)),
                   "--max_steps", str(MIN_TIMED_STEPS), "--logging_steps", "1", "--num_sample_answers", "0"]
        subprocess.run(command, check=True, capture_output=True, text=True)
        records = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))][1:]
        return sum(r["tokens_per_s"] for r in records) / len(records)


def main() -> None:
    args = parse_args()
    args.layers = args.layers or DEFAULT_LAYERS[args.model_shape]
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    import torch

    on_cuda = torch.cuda.is_available()
    batch_sizes = [int(size) for size in (args.batch_sizes or ("8,32,64" if on_cuda else "8")).split(",")]
    variants = args.variants.split(",") if args.variants else DEFAULT_VARIANTS["cuda" if on_cuda else "cpu"]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or variants[0] != "baseline":
        sys.exit(f"--variants {args.variants}: {'unknown ' + unknown[0] if unknown else 'the baseline is not first'}; "
                 f"choose among {', '.join(VARIANTS)}, baseline first (the ratios are to it)")
    print(f"model {args.model_name_or_path} ({args.model_shape}) | data {args.data_path}, "
          f"{args.num_examples or 'all'} examples | each timed window: >= {args.min_steps} steps, whole epochs, "
          f"after one step of each of its shapes; {args.repeats} repeats | layers {args.layers}, rank {args.rank}")
    roof, roof_shape = matmul_flops()
    device = torch.cuda.get_device_name(0) if on_cuda else f"CPU, {torch.get_num_threads()} threads"
    peak = args.peak_flops or next((flops for name, flops in GPU_PEAK_FLOPS.items() if name in device), None)
    print(f"device: {device}; dense matmul ({roof_shape}): {roof / 1e9:.1f} GFLOP/s; MFU over "
          + (f"the peak {peak / 1e12:.0f} TFLOP/s" if peak else "that matmul rate (no peak known)"))
    print(f"{'batch':>5} {'variant':<9} {'steps':>5} {'shapes':>6} {'non-pad tok/s':>13} {'range':>15} "
          f"{'ratio':>6} {'padding':>8} {'peak mem':>10} {'host ms':>8} {'device ms':>9} {'MFU 4N':>7} {'exact':>7}",
          flush=True)
    started = time.monotonic()
    runs = [(batch_size, variant) for batch_size in batch_sizes for variant in variants]
    baseline_rate = {}
    for number, (batch_size, variant) in enumerate(runs):
        # each row as soon as it is measured, and no new variant past the budget: a cut run keeps what it had
        if args.time_budget is not None and time.monotonic() - started > args.time_budget:
            left = ", ".join(f"{name} at {size}" for size, name in runs[number:])
            print(f"time budget of {args.time_budget:.0f} s spent; not started: {left}", flush=True)
            break
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], *VARIANTS[variant], "--variant", variant,
                                "--per_device_train_batch_size", str(batch_size)], capture_output=True, text=True)
        if child.returncode:
            last_lines = "\n".join(f"    {line}" for line in child.stderr.strip().splitlines()[-8:])
            print(f"{batch_size:>5} {variant:<9} failed (exit {child.returncode}):\n{last_lines}", flush=True)
            continue
        r = json.loads(child.stdout.strip().splitlines()[-1])
        rates = [r["tokens"] / s for s in r["seconds"]]
        median = statistics.median(rates)
        if variant == "baseline":
            baseline_rate[batch_size] = median
        mfu = {count: r[count] / statistics.median(r["seconds"]) / (peak or roof)
               for count in ("flops_4n", "flops_exact")}
        ratio = (f"{median / baseline_rate[batch_size]:.2f}x" if variant != "baseline" and batch_size in baseline_rate
                 else "")
        device_ms = f"{r['device_ms']:.1f}" if r["device_ms"] is not None else "-"
        spread = f"{min(rates):.0f}-{max(rates):.0f}"
        print(f"{batch_size:>5} {variant:<9} {r['steps']:>5} {r['warmed_shapes']:>6} {median:>13.1f} "
              f"{spread:>15} {ratio:>6} {1 - r['tokens'] / r['padded_tokens']:>8.1%} "
              f"{r['peak_bytes'] / 2**30:>6.2f} GiB {r['host_ms']:>8.1f} {device_ms:>9} "
              f"{mfu['flops_4n']:>7.1%} {mfu['flops_exact']:>7.1%}", flush=True)
        if args.profile:
            print(child.stderr[child.stderr.find(f"--- {variant}"):], flush=True)
    if args.nproc > 1:
        one, many = (multigpu_tokens_per_s(args, count, batch_sizes[0]) for count in (1, args.nproc))
        print(f"train_multigpu.py: 1 process {one:.1f} tok/s, {args.nproc} processes {many:.1f} tok/s; "
              f"scaling efficiency {many / (args.nproc * one):.0%} (same global batch)")


if __name__ == "__main__":
    main()
