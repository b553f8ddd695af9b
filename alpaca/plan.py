"""--plan: will this command fit? Two optimizer steps of the script's own step, on fake GPUs, in one CPU process.

    python train_multigpu.py --model_name_or_path DIR --fsdp ... --plan 8x80GB

The process is rank 0 of a world of NODES x GPUS on torch's "fake" process group (every collective returns at
once), its device a fake CUDA device (alpaca.fake_cuda): every tensor is a FakeTensor, with a shape, a dtype and a
device but no memory, so a 70B base costs the host nothing. The base is built from its config.json alone (no
weight is read: the strategy's readers of weights allocate fake tensors instead, `weights_not_read`); the
interventions, the optimizer and the collator are the script's; the micro-batches are the longest the data gives
(or --model_max_length wide where the model has no tokenizer); the step is the script's `backward_step` and
`strategy.step`. torch's MemTracker (FSDP2's, under --fsdp) follows every tensor on the device, by what it is,
and its peak is the plan's. Every collective of the wrap and the steps, FSDP2's own included, is held to NCCL's
rule (fake_cuda.NCCLDeviceRule): a tensor off the rank's GPU fails the plan with its call site.

What is planned: train.py's one GPU, --device_map (one process per node over its GPUs, the base placed by
transformers' map, alpaca.plan_device_map), DDP and --fsdp (with --gradient_checkpointing and any
--per_device_train_batch_size), and a 4-bit base (bitsandbytes' layers, quantized on the fake GPU by its own
functions, `quantized_base`) on one GPU or under DDP. DeepSpeed's engine needs real tensors: a ZeRO plan runs the
step of a torch strategy that places the base alike and counts ZeRO's model states by DeepSpeed's layout
(alpaca.plan_zero), and says so. FSDP2's gathered 4-bit weight needs a real one, and LLM.int8's outlier columns
(--load_in_8bit) the activations' values: a plan of them is refused with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import time
from collections.abc import Callable, Iterator
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from alpaca import fake_cuda, zero
from alpaca.args import resolve_device_defaults
from alpaca.collate import Collator, give_step_counts, step_counts
from alpaca.device_map import local_rank_gpus, one_process_gpus
from alpaca.distributed import bound_device
from alpaca.errors import UsageError
from alpaca.flag_values import parse_layers, parse_position
from alpaca.model import (
    build_reft_model,
    enable_gradient_checkpointing,
    intervention_parameters,
    quantization_config,
    resolve_dtype,
    resolve_model_path,
    set_attention,
)
from alpaca.optim import build_optimizer
from alpaca.output import LogWindow
from alpaca.plan_device_map import accelerate_on_fake_tensors, fullest_gpu, place_by_device_map
from alpaca.plan_zero import stand_in, zero_parts
from alpaca.step_schedule import StepSchedule
from alpaca.strategy import (
    DDP,
    FSDP,
    Strategy,
    ZeRO,
    choose_strategy,
    local_parameter_bytes,
    quantization_constant_bytes,
)

PLANNED_STEPS = 2  # the second has the optimizer state the first created: the peak of every later step
GiB = 2**30


def plan(prog: str, args: argparse.Namespace, backward_step: Callable) -> None:
    """Plan the command of `args` (see the module's docstring) and print the plan; `backward_step` is the script's."""
    nodes, gpus_per_node, gpu_bytes = args.plan
    spread = args.device_map is not None  # a node's one process spreads the base over its GPUs
    world_size = nodes if spread else nodes * gpus_per_node
    if prog == "train.py" and world_size > 1:
        raise UsageError("train.py trains on one process: plan it with --plan 1x<MEMORY> (with --device_map "
                         "<GPUS>x<MEMORY>), or plan N GPUs with train_multigpu.py")
    fake_cuda.run_with_fake_cuda(args.cache_dir)  # may start this command again, with fake CUDA devices
    from torch.testing._internal.distributed.fake_pg import FakeStore

    started = time.perf_counter()
    if gpus_per_node > fake_cuda.DEVICES:
        raise UsageError(f"--plan plans up to {fake_cuda.DEVICES} GPUs a node; got {gpus_per_node}")
    fake_cuda.answer_torch_cuda(gpu_bytes, gpus_per_node)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(1 if spread else gpus_per_node))
    path = resolve_model_path(args.model_name_or_path, args.cache_dir)  # the default: its converted directory
    config = read_config(args, path)
    gpus = one_process_gpus(spread) if prog == "train.py" else local_rank_gpus(prog, spread)  # the scripts' choice
    device = torch.device("cuda", gpus[0])
    resolve_device_defaults(args, device.type)
    dtype = resolve_dtype(args.dtype, device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        strategy = choose_strategy(args, device, dtype, gpus, distributed=prog == "train_multigpu.py")
        check_planned(args, strategy)
        stepped = stand_in(strategy) if isinstance(strategy, ZeRO) else strategy  # what runs on the fake GPUs
        micro_batches, collate, source = longest_micro_batches(args, config, path)
        # train_multigpu.py's step also takes a placeholder for a rank's missing micro-batches, and the GPUs whose
        # random state it keeps: every micro-batch planned is real
        takes = inspect.signature(backward_step).parameters
        rank_options = {"placeholder": micro_batches[0], "gpus": []} if "placeholder" in takes else {}
        with (fake_cuda.fake_tensor_mode(), fake_cuda.gpu_attention_kernels(), weights_not_read(),
              quant_states_given_back(stepped), accelerate_on_fake_tensors(),
              mock.patch("alpaca.strategy.DistributedDataParallel", fake_cuda.ddp_on_the_fake_group)):
            reft_model, optimizer, scheduler = build_planned_model(args, stepped, config, path, dtype, collate)
            if stepped is not strategy:  # its model-sized values, as ZeRO's wrap fills them (alpaca.zero.start)
                zero.fill_model_sized(strategy.config, reft_model.model, sum(
                    parameter.numel() for _, parameter in intervention_parameters(reft_model)))
            # the rule of the group as the script binds it: to the rank's GPU, or to none where it spans several
            with fake_cuda.HostReads(), fake_cuda.NCCLDeviceRule(bound_device(gpus), gpus) as rule:
                train_model = stepped.wrap(reft_model, optimizer, scheduler, None)
                tracker = memory_tracker(stepped, reft_model, optimizer)
                with one_forward_at_a_time(tracker, train_model), tracker:
                    for step in range(PLANNED_STEPS):
                        window = LogWindow(device)
                        counts = [count * world_size for count in step_counts(micro_batches)]  # every rank's alike
                        give_step_counts(micro_batches, counts)
                        backward_step(stepped, train_model, micro_batches, counts[0], window, device,
                                      **rank_options)
                        stepped.step(step + 1)
                # here, where host reads are answered: a 4-bit QuantState reads its values as it lists them
                gpu_parts = {gpu: memory_parts(peak_of(tracker, gpu), reft_model, optimizer, stepped, gpu)
                             for gpu in (torch.device("cuda", index) for index in gpus)}
                gpu_totals = {gpu: gpu_part["total"] for gpu, gpu_part in gpu_parts.items()}
                parts = gpu_parts[fullest_gpu(gpu_totals)]
                if stepped is not strategy:
                    parts = zero_parts(parts, strategy, reft_model, world_size)
    finally:
        dist.destroy_process_group()
    print(plan_report(args, strategy, world_size, gpu_bytes, parts, micro_batches, source,
                      time.perf_counter() - started, rule.count, gpu_totals if len(gpus) > 1 else {}))


class FrozenBaseMemTracker(MemTracker):
    """torch's MemTracker, without its hook on every parameter's gradient, which a frozen one refuses. Every tensor
    is still counted as it is allocated; a gradient is then labelled a temporary until its parameter's module runs
    again (memory_parts counts the interventions' own)."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True) -> tuple[int, int]:
        return super()._track_module_params_and_buffers(module, install_grad_hooks=False)


def memory_tracker(strategy: Strategy, reft_model, optimizer) -> MemTracker:
    """Return torch's tracker of every tensor's memory by what it is: FSDP2's under --fsdp (sharded and gathered
    parameters, all-gather and reduce-scatter buffers), else MemTracker over the ReFT model and the optimizer."""
    if isinstance(strategy, FSDP):
        return FSDPMemTracker(reft_model.model, optimizer)
    tracker = FrozenBaseMemTracker()
    tracker.track_external(reft_model, optimizer)
    return tracker


@contextlib.contextmanager
def one_forward_at_a_time(tracker: MemTracker, top: torch.nn.Module) -> Iterator[None]:
    """Clear the tracker's statistics of each module before each forward of `top`: MemTracker refuses a second forward
    of a module it has statistics of (a micro-batch, a step), and the plan reads only the device's peak. Registered
    before the tracker's own hooks, so that it runs first."""
    def clear(module: torch.nn.Module, inputs) -> None:
        if module is top:
            tracker.reset_mod_stats()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(clear)
    try:
        yield
    finally:
        handle.remove()


def read_config(args: argparse.Namespace, path: str):
    """Read the model's config.json (a directory's, or a hub name's from the cache), the only file a plan needs."""
    try:
        return AutoConfig.from_pretrained(path, cache_dir=args.cache_dir)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0]
        raise UsageError(f"--plan builds the base from its config: cannot read the config of "
                         f"--model_name_or_path {args.model_name_or_path!r}: {reason}") from None


def check_planned(args: argparse.Namespace, strategy: Strategy) -> None:
    """Refuse what cannot run on fake tensors, and what the plan's step is not, with the reason."""
    for flag, step in (("packing", "the longest padded micro-batches"), ("torch_compile", "the eager step")):
        if getattr(args, flag):
            raise UsageError(f"--plan does not plan --{flag}: it runs {step}; plan without --{flag}")
    if args.load_in_8bit:
        raise UsageError("--plan does not plan --load_in_8bit: which of LLM.int8's columns are outliers, kept in 16 "
                         "bits, depends on the activations' values, which a plan has none of; plan --load_in_4bit "
                         "(docs/big-models.md#will-it-fit)")
    if strategy.quantization is not None and strategy.shards_base:
        raise UsageError("--plan does not plan --fsdp --load_in_4bit: FSDP2's gathered 4-bit weight is wrapped in "
                         "bitsandbytes' parameter class, which a fake tensor cannot be; plan --load_in_4bit, or "
                         "--fsdp (docs/big-models.md#will-it-fit)")
    if strategy.quantization is not None and strategy.device_map is not None:
        raise UsageError("--plan does not plan --device_map with a quantized base: it quantizes the base on one "
                         "GPU; plan --load_in_4bit, or --device_map (docs/big-models.md#will-it-fit)")


def longest_micro_batches(args: argparse.Namespace, config, path: str) -> tuple[list[dict], Collator, str]:
    """Collate the step of the longest examples: the data's, tokenized as training does, where the model has a
    tokenizer; else --model_max_length tokens each, with the shortest prompt the positions allow (the most logits).
    Returns the micro-batches, the collator and where their tokens come from."""
    position = parse_position(args.position)
    num_layers = num_intervened_layers_of(args, config)
    count = args.per_device_train_batch_size * args.gradient_accumulation_steps
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, cache_dir=args.cache_dir)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    if tokenizer is not None:
        from alpaca.data import load_training_splits, tokenize_splits

        records, _ = load_training_splits(args)
        [dataset] = tokenize_splits([records], tokenizer, args)
        longest = np.argsort(-np.array(dataset["length"]), kind="stable")[:count]
        examples = [dataset[int(index)] for index in longest]
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
        source = f"the {len(examples)} longest examples of the data ({examples[0]['length']} tokens at most)"
    else:
        length, prompt = args.model_max_length, max(1, sum(position))
        examples = [{"input_ids": [index % config.get_text_config().vocab_size for index in range(length)],
                     "prompt_length": prompt, "length": length}] * count
        pad_id = 0
        source = f"{count} examples of --model_max_length {length} tokens (the model has no tokenizer)"
    collate = Collator(pad_id, position, args.share_weights, num_layers, args.pad_to_multiple_of)
    size = args.per_device_train_batch_size
    micro_batches = [collate(examples[start:start + size]) for start in range(0, len(examples), size)]
    return micro_batches, collate, source


def num_intervened_layers_of(args: argparse.Namespace, config) -> int:
    """Count the intervened layers, which the collator builds locations for (alpaca.model.num_intervened_layers
    counts them in the built model)."""
    return len(parse_layers(args.layers, config.get_text_config(decoder=True).num_hidden_layers))


@contextlib.contextmanager
def weights_not_read() -> Iterator[None]:
    """Replace the strategies' readers of weights: --fsdp's shards are allocated (fake) where they live, never read."""
    def allocate_shards(model, model_name_or_path, device, cache_dir=None, offload=False) -> None:
        model.to_empty(device=torch.device("cpu") if offload else device)
        for module in model.modules():  # buffers on the device either way, as load_shards places them
            for name, buffer in module.named_buffers(recurse=False):
                module.register_buffer(name, torch.empty_like(buffer, device=device),
                                       persistent=name not in module._non_persistent_buffers_set)

    # --fsdp offload pins its CPU shards, an operation FakeTensorMode lacks: a fake tensor holds no memory to pin
    with (mock.patch("alpaca.strategy.load_shards", allocate_shards),
          mock.patch.object(torch.Tensor, "pin_memory", lambda tensor, device=None: tensor)):
        yield


def build_planned_model(args: argparse.Namespace, strategy: Strategy, config, path: str, dtype: torch.dtype,
                        collate: Collator):
    """Build the base from its config (on the meta device where the strategy shards it, placed by a device map, else
    on its device), and the interventions, the optimizer and the schedule as load_data_and_model and train do."""
    if strategy.quantization is not None:
        model = quantized_base(config, quantization_config(strategy.quantization, dtype), dtype, strategy.device)
    else:
        with torch.device("meta" if strategy.shards_base or strategy.device_map else strategy.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if strategy.device_map is not None:
            place_by_device_map(model, strategy.device_map, path, dtype, args.cache_dir)
            strategy.note_placement(model)
    model.tie_weights()
    model.requires_grad_(False)
    model.eval()
    if isinstance(strategy, FSDP):  # what FSDP.load_base keeps for load_shards
        strategy.model_path, strategy.cache_dir = args.model_name_or_path, args.cache_dir
    set_attention(model, args.attn_implementation)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    torch.manual_seed(args.seed)
    reft_model = build_reft_model(model, args.layers, collate.position, args.share_weights,
                                  low_rank_dimension=args.rank, dropout=args.dropout,
                                  intervention=args.intervention, component=args.component)
    world_size = dist.get_world_size()
    schedule = StepSchedule.from_args(args, max(world_size * args.per_device_train_batch_size, 1), world_size)
    optimizer, scheduler = build_optimizer(reft_model, args, schedule)
    return reft_model, optimizer, scheduler


def quantized_base(config, quantization: BitsAndBytesConfig, dtype: torch.dtype, device: torch.device):
    """Build the base as `from_pretrained(quantization_config=quantization)` does, on the fake device: transformers'
    bitsandbytes quantizer replaces its linear layers (on the meta device, outside the fake mode: bitsandbytes'
    parameter classes wrap a tensor's data, which a fake tensor cannot lend), every tensor is then allocated on the
    device, and each 4-bit weight is quantized there by bitsandbytes' own function, kept as a plain parameter (its
    quant_state on the module, `quant_states_given_back`)."""
    import bitsandbytes as bnb
    from transformers.quantizers import AutoHfQuantizer

    with unset_fake_temporarily():
        # double quantization's table, built by reading values back (none in a fake tensor): on the host, into
        # bitsandbytes' cache of it
        bnb.functional.name2qmap.setdefault("dynamic", bnb.functional.create_dynamic_map())
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            AutoHfQuantizer.from_config(quantization, pre_quantized=False).preprocess_model(model, device_map=None)
    quantized = {module: module.weight for module in model.modules() if isinstance(module, bnb.nn.Linear4bit)}
    for module, weight in quantized.items():
        module.weight = torch.nn.Parameter(torch.empty(weight.shape, dtype=dtype, device="meta"), requires_grad=False)
    model.to_empty(device=device)
    for module, weight in quantized.items():
        packed, module.quant_state = bnb.functional.quantize_4bit(
            module.weight, blocksize=weight.blocksize, compress_statistics=weight.compress_statistics,
            quant_type=weight.quant_type, quant_storage=module.quant_storage)
        module.weight = torch.nn.Parameter(packed, requires_grad=False)
    return model


@contextlib.contextmanager
def quant_states_given_back(strategy: Strategy) -> Iterator[None]:
    """Under a 4-bit base, give each Linear4bit's weight its module's quant_state at each forward, as bitsandbytes
    does for a weight that has lost it (moved, gathered), but without wrapping the weight in its parameter class,
    which a fake tensor cannot be (`quantized_base`)."""
    if strategy.quantization is None:
        yield
        return

    def give_back(module: torch.nn.Module) -> None:
        module.weight.quant_state = module.quant_state

    with mock.patch("bitsandbytes.nn.modules.fix_4bit_weight_quant_state_from_module", give_back):
        yield


def peak_of(tracker: MemTracker, gpu: torch.device) -> dict[str, int]:
    """Return the tracker's peak on `gpu` by category name (its keys are str enums, which hash by their member's
    name); nothing where the GPU held nothing."""
    snapshot = tracker.get_tracker_snapshot("peak").get(gpu, {})
    return {"Total": 0} | {getattr(kind, "value", kind): size for kind, size in snapshot.items()}


def ddp_bucket_bytes(strategy: Strategy, reft_model, device: torch.device) -> int:
    """Count DDP's buckets on `device`: a copy of every gradient it reduces, allocated as DDP is built (none without
    DDP)."""
    return intervention_bytes(reft_model, device) if isinstance(strategy, DDP) else 0


def intervention_bytes(reft_model, device: torch.device) -> int:
    """Count the bytes of the interventions' parameters on `device`."""
    return sum(p.nbytes for _, p in intervention_parameters(reft_model) if p.device == device)


def untraced_bytes(strategy: Strategy, reft_model, device: torch.device) -> int:
    """Count what `device` holds that the tracker does not follow: DDP's buckets (`ddp_bucket_bytes`), under --fsdp
    the interventions' parameters (FSDP2's tracker follows the base and the optimizer), and a quantized base's
    constants (a 4-bit weight's QuantState, in no module's parameters or buffers)."""
    interventions = intervention_bytes(reft_model, device) if isinstance(strategy, FSDP) else 0
    constants = sum(quantization_constant_bytes(p) for p in reft_model.model.parameters() if p.device == device)
    return ddp_bucket_bytes(strategy, reft_model, device) + interventions + constants


def memory_parts(peak: dict[str, int], reft_model, optimizer, strategy: Strategy,
                 gpu: torch.device) -> dict[str, int]:
    """Split the peak of one of the rank's GPUs, with what the tracker does not follow added (`untraced_bytes`): the
    base parameters this rank holds there, the interventions with their gradients and optimizer state (counted
    exactly), the communication buffers (DDP's buckets; FSDP2's gathered units and their all-gather and
    reduce-scatter buffers), and the rest, activations and temporaries of the longest step."""
    # a gradient of each parameter's bytes: the step's zero_grad has dropped them by now
    interventions = 2 * intervention_bytes(reft_model, gpu) + sum(
        value.nbytes for state in optimizer.state.values() for value in state.values()
        if isinstance(value, torch.Tensor) and value.device == gpu)
    # what this GPU holds: --fsdp offload's shards and a device map's CPU modules are in CPU memory
    base = local_parameter_bytes(reft_model.model, gpu) + sum(
        buffer.nbytes for buffer in reft_model.model.buffers() if buffer.device == gpu)
    gathered = sum(peak.get(kind, 0) for kind in ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"))
    communication = ddp_bucket_bytes(strategy, reft_model, gpu) + gathered
    total = peak["Total"] + untraced_bytes(strategy, reft_model, gpu)
    return {"base": base, "interventions": interventions, "communication": communication,
            "activations": max(total - base - interventions - communication, 0), "total": total}


def plan_report(args: argparse.Namespace, strategy: Strategy, world_size: int, gpu_bytes: int,
                parts: dict[str, int], micro_batches: list[dict], source: str, seconds: float,
                collectives: int, gpu_totals: dict[torch.device, int]) -> str:
    """Say what each rank holds at its peak (on its fullest GPU, where it spans several: `gpu_totals`), the headroom,
    and whether it fits; if not, what to try."""
    width = micro_batches[0]["input_ids"].shape[1]
    headroom = gpu_bytes - parts["total"]
    gpus = f"{world_size} x {gpu_bytes / GiB:.2f} GiB GPUs"
    holds = "every rank holds the same"
    if gpu_totals:
        gpus = f"{world_size} process{'es' * (world_size > 1)} x {len(gpu_totals)} GPUs of {gpu_bytes / GiB:.2f} GiB"
        peaks = ", ".join(f"{gpu}: {total / GiB:.3f}" for gpu, total in gpu_totals.items())
        holds = f"{holds}, on its GPUs {peaks} GiB at their peaks; its fullest, {fullest_gpu(gpu_totals)}, holds"
    lines = [
        f"Plan of {gpus}, {strategy.layout}, {len(micro_batches)} micro-batch"
        f"{'es' * (len(micro_batches) > 1)} of {args.per_device_train_batch_size} x {width} tokens a step ({source}); "
        f"{holds}:",
        f"  base model (this rank's part)        {parts['base'] / GiB:9.3f} GiB",
        f"  interventions, gradients, AdamW      {parts['interventions'] / GiB:9.3f} GiB",
        f"  activations and temporaries          {parts['activations'] / GiB:9.3f} GiB",
        f"  communication buffers                {parts['communication'] / GiB:9.3f} GiB",
        f"  peak GPU memory                      {parts['total'] / GiB:9.3f} GiB of {gpu_bytes / GiB:.2f} GiB "
        f"({headroom / GiB:+.3f} GiB headroom; {parts['total']} bytes)",
    ]
    if headroom >= 0:
        lines.append("Verdict: fits.")
    else:
        lines.append("Verdict: does not fit. " + remedies(args, strategy, world_size, parts, gpu_bytes))
    if isinstance(strategy, ZeRO):
        lines.append("DeepSpeed's engine needs real tensors: its model states are counted by formula, at their most "
                     "(alpaca.zero.planned_base_bytes and planned_trainable_bytes; tests/test_plan.py checks the plan "
                     "against a CPU run), and the activations and the collectives below are those of "
                     f"{'--fsdp' if strategy.shards_base else 'DDP'}'s step (alpaca.plan_zero.stand_in).")
    lines.append(f"Planned in {seconds:.0f}s on fake GPUs: {PLANNED_STEPS} steps of the script's own step, whose "
                 f"{collectives} collectives all took tensors on the rank's GPU{'s' * bool(gpu_totals)}, as NCCL "
                 "needs; nothing was trained, --output_dir untouched.")
    return "\n".join(lines)


def remedies(args: argparse.Namespace, strategy: Strategy, world_size: int, parts: dict[str, int],
             gpu_bytes: int) -> str:
    """Name the flags that shrink the larger of what overflows, the base or the activations, first; each is to be
    planned again, not assumed to fit."""
    base_flags, activation_flags = [], []
    deepspeed = isinstance(strategy, ZeRO)
    if strategy.device_map is not None:
        base_flags.append("--max_memory with room on 'cpu' (modules kept in CPU memory, brought to their GPU for each "
                          "forward)")
    if not strategy.shards_base and world_size > 1:
        base_flags.append("--fsdp (the base sharded over the ranks)" if strategy.quantization is None
                          else "--fsdp (the 4-bit base sharded over the ranks; it trains, but is not planned)")
        if deepspeed and strategy.quantization is None:
            base_flags.append("--deepspeed examples/deepspeed/zero3.json (ZeRO-3: the base partitioned over the ranks)")
    if strategy.quantization is None and not strategy.shards_base:
        base_flags.append("--load_in_4bit (the base in 4 bits: another model's arithmetic, docs/big-models.md)")
    if strategy.shards_base and not strategy.offload:
        base_flags.append("--deepspeed examples/deepspeed/zero3_offload.json (the partitions in CPU memory)"
                          if deepspeed else "--fsdp offload (the shards in CPU memory)")
    if not args.gradient_checkpointing:
        activation_flags.append("--gradient_checkpointing (a decoder layer's activations recomputed in the backward)")
    if args.per_device_train_batch_size % 2 == 0:
        half = args.per_device_train_batch_size // 2
        activation_flags.append(f"--per_device_train_batch_size {half} --gradient_accumulation_steps "
                                f"{args.gradient_accumulation_steps * 2} (the same global batch)")
    flags = (base_flags + activation_flags if parts["base"] > parts["activations"]
             else activation_flags + base_flags)
    over = (parts["total"] - gpu_bytes) / GiB
    return f"It is {over:.3f} GiB over. Try, and plan again: {'; '.join(flags) or 'more or larger GPUs'}."
