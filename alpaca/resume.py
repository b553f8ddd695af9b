"""Resuming a run exactly: every rank's random generators, the checkpoint's state loaded into the training
objects, and the checks that a resumed run is the checkpoint's own (the same global batch, seed, prompts,
data, base model and flags)."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AutoConfig

from alpaca.args import build_parser
from alpaca.checkpoint import latest_checkpoint, load_intervention_states
from alpaca.data import load_training_splits, records_fingerprint
from alpaca.errors import UsageError
from alpaca.flag_values import parse_layers, parse_position
from alpaca.model import check_model, model_fingerprint
from alpaca.output import LogWindow
from alpaca.step_schedule import StepSchedule


def rng_state(gpus: list[int]) -> dict[str, torch.Tensor]:
    """Return the state of every random generator training draws from, as tensors (a weights-only load accepts them):
    the host's and those of the process's GPUs (several under --device_map, whose interventions draw dropout on
    each)."""
    _, python_state, python_gauss = random.getstate()
    _, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    state = {"python": torch.tensor(python_state, dtype=torch.int64),
             "python_gauss": torch.tensor(torch.nan if python_gauss is None else python_gauss, dtype=torch.float64),
             "numpy": torch.from_numpy(numpy_keys.astype(np.int64)),
             "numpy_pos": torch.tensor([numpy_pos, numpy_has_gauss], dtype=torch.int64),
             "numpy_gauss": torch.tensor(numpy_gauss, dtype=torch.float64),
             "torch": torch.get_rng_state()}
    for index, gpu in enumerate(gpus):
        state[cuda_rng_key(index)] = torch.cuda.get_rng_state(gpu)
    return state


def cuda_rng_key(index: int) -> str:
    """Name the state key of a GPU: the process's first GPU under "cuda" (the one a single-GPU run has); its others
    after it."""
    return "cuda" if index == 0 else f"cuda{index}"


def restore_rng_state(state: dict[str, torch.Tensor], gpus: list[int]) -> None:
    python_gauss = state["python_gauss"].item()
    random.setstate((3, tuple(state["python"].tolist()), None if np.isnan(python_gauss) else python_gauss))
    numpy_pos, numpy_has_gauss = state["numpy_pos"].tolist()
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), numpy_pos, numpy_has_gauss,
                         state["numpy_gauss"].item()))
    torch.set_rng_state(state["torch"])
    for index, gpu in enumerate(gpus):
        if cuda_rng_key(index) in state:
            torch.cuda.set_rng_state(state[cuda_rng_key(index)], gpu)


@dataclass
class TrainingStart:
    """Where a run starts: a new run at step 0; a resumed one where its checkpoint left off."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    next_batch: int = 0  # of the epoch's global batch plan
    window: dict[str, torch.Tensor] = field(default_factory=dict)  # the logging window's sums so far (LogWindow)
    wandb_run_id: str | None = None
    optimizer_state: dict | None = None  # torch's AdamW format; the strategy loads it once the parameters are placed


def restore_training_state(checkpoint: tuple[dict, dict], args: argparse.Namespace, reft_model, scheduler,
                           gpus: list[int], *, rank: int = 0, world_size: int = 1, num_examples: int,
                           fingerprint: dict) -> TrainingStart:
    """Load a checkpoint into the interventions, the schedule and the random generators of this process's `gpus`,
    and return where training goes on. `fingerprint`: this run's (training_fingerprint), which must be the
    checkpoint's."""
    states, saved = checkpoint
    check_resumable(saved, args, world_size, num_examples)
    # the same layers, positions' layout, low-rank dimension and initialization
    load_intervention_states(reft_model, states)
    check_fingerprint(saved.get("fingerprint"), fingerprint, args)
    total_steps = StepSchedule.from_args(args, num_examples, world_size).total_steps
    if saved["step"] >= total_steps:
        raise UsageError(f"the checkpoint is at step {saved['step']} and this run ends at step {total_steps}: "
                         "nothing to train; raise --max_steps or --num_train_epochs (the checkpoint loads as an "
                         "output as it is)")
    scheduler.load_state_dict(saved["scheduler"])
    resume_learning_rate(scheduler, saved["optimizer"], args.learning_rate)
    if saved["geometry"]["world_size"] == world_size:  # else dropout's streams restart; the plan is the same
        restore_rng_state(saved["rng"][rank], gpus)
    # The saved window is the sum over ranks: one rank carries it on.
    window = LogWindow.restored(saved["window"]) if rank == 0 else {}
    return TrainingStart(saved["step"], saved["epoch"], saved["next_batch"], window, saved["wandb_run_id"],
                         saved["optimizer"])


def resume_learning_rate(scheduler, optimizer_state: dict, learning_rate: float) -> None:
    """Set the schedule to go on from its step at this run's --learning_rate: the way on from a diverging run's newest
    checkpoint is a lower one (alpaca.divergence). The saved optimizer groups take the schedule's rate, which loading
    them restores; with the checkpoint's own --learning_rate every value is the saved one, bit for bit."""
    saved_peak = scheduler.base_lrs[0]
    if learning_rate != saved_peak:
        print(f"Resuming at --learning_rate {learning_rate} (the checkpoint's: {saved_peak}); the schedule goes on "
              f"from step {scheduler.last_epoch} at the new peak")
    scheduler.base_lrs = [learning_rate] * len(scheduler.base_lrs)
    scheduler._last_lr = [learning_rate * factor(scheduler.last_epoch) for factor in scheduler.lr_lambdas]
    for group, rate in zip(optimizer_state["param_groups"], scheduler._last_lr, strict=True):
        group.update(lr=rate, initial_lr=learning_rate)


# A checkpoint is bound to every flag of the parser (alpaca.args) but those listed here, so that a flag added
# later is bound until someone decides otherwise. These do not change what a step computes:
NOT_BOUND = (
    # where the run writes, whether it resumes or replaces, where caches are
    "output_dir", "overwrite_output_dir", "resume_from_checkpoint", "cache_dir",
    # a plan (--plan) runs two steps on fake GPUs and writes no checkpoint
    "plan",
    # what is logged and saved, when and where
    "logging_steps", "report_to", "run_name", "wandb_project", "save_strategy", "save_steps", "save_total_limit",
    # evaluation and the sample answers: outside the training steps
    "eval_strategy", "eval_steps", "eval_data_path", "eval_data_split", "per_device_eval_batch_size",
    "num_sample_answers", "max_new_tokens",
    # the run's length: a resume that would train no step is refused
    "max_steps", "num_train_epochs",
    # the peak of the schedule, which a resume may change (resume_learning_rate): a diverging run goes on from
    # its newest checkpoint at a lower one; the schedule's shape and warmup stay bound
    "learning_rate",
    # how a step is computed, not what: placement and strategy (a DDP checkpoint resumes under FSDP, ZeRO or a
    # device map), kernels, recomputation, padding, packing, tokenizing and loading of the same global batch
    "device_map", "max_memory", "offload_folder", "ddp_backend", "ddp_timeout", "fsdp", "deepspeed",
    "attn_implementation", "torch_compile", "optim", "gradient_checkpointing", "pad_to_multiple_of", "packing",
    "packing_max_tokens", "dataloader_num_workers", "preprocessing_num_workers",
    "remove_unused_columns",  # accepted for pyreft's command line, and ignored
)
# Bound, but not as given: the global batch these make up with the world size (whose split may change), the
# seed and the prompt template are checked on their own (check_resumable, with messages of their own); the data
# flags choose the training records, bound by content (a moved file, or the same records in another container,
# is the same data); the base model is bound by its files (alpaca.model.model_fingerprint), its dtype as resolved.
BOUND_OTHERWISE = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "seed", "prompt_template",
    "data_path", "data_split", "data_config", "data_format", "field_map", "max_n_train_example", "eval_split_ratio",
    "model_name_or_path", "bf16", "fp16",
)


def bound_flags() -> list[str]:
    """List the flags a checkpoint records and a resume must keep: those of the parser (train_multigpu.py's, a
    superset of train.py's) on neither list above."""
    parsed = vars(build_parser("train_multigpu.py", multigpu=True).parse_args([]))
    return [name for name in parsed if name not in NOT_BOUND and name not in BOUND_OTHERWISE]


def bound_flag_values(args: argparse.Namespace, num_layers: int, dtype: torch.dtype) -> dict:
    """Return bound_flags' values, normalized: --layers all as the list of layers, --position in one spelling, --dtype
    auto as the dtype it resolved to. A flag train.py lacks is None there."""
    first_n, last_n = parse_position(args.position)
    flags = {name: getattr(args, name, None) for name in bound_flags()}
    flags.update(layers=";".join(map(str, parse_layers(args.layers, num_layers))),
                 position="+".join(f"{side}{n}" for side, n in (("f", first_n), ("l", last_n)) if n),
                 dtype=str(dtype).removeprefix("torch."))
    return flags


def training_fingerprint(args: argparse.Namespace, records, model_path: str, dtype: torch.dtype) -> dict:
    """Fingerprint what a checkpoint is bound to: the training data as trained on (content), the base model at
    `model_path` (config, tokenizer, weights: alpaca.model.model_fingerprint) and the bound flags (bound_flag_values,
    `dtype` as resolved). From files alone: no weight is loaded."""
    config = AutoConfig.from_pretrained(model_path, cache_dir=args.cache_dir).get_text_config(decoder=True)
    num_layers = config.num_hidden_layers
    return {"data": records_fingerprint(records), "model": model_fingerprint(model_path, args.cache_dir),
            "flags": bound_flag_values(args, num_layers, dtype)}


def check_fingerprint(saved: dict | None, current: dict, args: argparse.Namespace,
                      bound_to: str = "the checkpoint") -> None:
    """Refuse, in one line naming every difference, a resume on other data, another base model or other flags."""
    if saved is None:
        raise UsageError(f"{bound_to} records no fingerprint of its data, base model and flags, so this resume "
                         "cannot be checked against them; resume it with the version of these scripts that wrote it, "
                         "or train anew in another --output_dir")
    changes = []
    if saved["data"] != current["data"]:
        changes.append(f"the training data (the records of --data_path {args.data_path!r} as trained on, after "
                       "--field_map, --max_n_train_example and any held-out split)")
    changes += [f"the base model's {part} (--model_name_or_path {args.model_name_or_path!r})"
                for part in ("config", "tokenizer", "weights") if saved["model"][part] != current["model"][part]]
    recorded = saved["flags"]
    changes += [f"--{name} ({recorded[name] if name in recorded else 'not recorded'} in {bound_to}, {value} in "
                "this run)" for name, value in current["flags"].items()
                if name not in recorded or recorded[name] != value]
    if changes:
        raise UsageError(f"this run differs from {bound_to} in {'; '.join(changes)}. Resume with the data, "
                         f"model and flags {bound_to} was trained with (its training_args.json), or train "
                         "anew in another --output_dir")


def geometry(args: argparse.Namespace, world_size: int) -> dict:
    return {"world_size": world_size, "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "global_batch_size": args.per_device_train_batch_size * world_size * args.gradient_accumulation_steps}


def describe_geometry(g: dict) -> str:
    return (f"global batch {g['global_batch_size']} = {g['per_device_train_batch_size']} per device x "
            f"{g['world_size']} processes x {g['gradient_accumulation_steps']} accumulation")


def check_resumable(trainer_state: dict, args: argparse.Namespace, world_size: int, num_examples: int | None,
                    bound_to: str = "the checkpoint") -> None:
    """Check that the batch plan is the same one: same global batch, seed and prompts; the world size may change.
    `num_examples`: this run's, None where not counted yet."""
    saved, current = trainer_state["geometry"], geometry(args, world_size)
    if saved["global_batch_size"] != current["global_batch_size"]:
        raise UsageError(f"{bound_to} was written with {describe_geometry(saved)}, this run has "
                         f"{describe_geometry(current)}; resume with the same global batch")
    if trainer_state["seed"] != args.seed:
        raise UsageError(f"{bound_to} was written with --seed {trainer_state['seed']} on "
                         f"{trainer_state['num_examples']} examples, this run has --seed {args.seed}"
                         f"{'' if num_examples is None else f' on {num_examples}'}; resume with the same data and "
                         "seed")
    saved_template = trainer_state["prompt_template"]
    if saved_template != args.prompt_template:
        raise UsageError(f"{bound_to} was trained with --prompt_template {saved_template}, this run has "
                         f"{args.prompt_template}; resume with --prompt_template {saved_template}")


def finished_record(step: int, args: argparse.Namespace, world_size: int, num_examples: int,
                    fingerprint: dict) -> dict:
    """Return what a finished run leaves of itself next to its output (alpaca.output.FINISHED_FILE): its last step and
    what a resume of it is checked against, as a checkpoint's trainer_state.json records them."""
    return {"step": step, "geometry": geometry(args, world_size), "seed": args.seed, "num_examples": num_examples,
            "prompt_template": args.prompt_template, "fingerprint": fingerprint, "learning_rate": args.learning_rate}


def check_finished(record: dict, args: argparse.Namespace, world_size: int, dtype: torch.dtype) -> str:
    """Check --resume_from_checkpoint auto in a finished run's directory: the line saying there is nothing to train when
    this run is that run; refused like any resume when it differs, and when it asks for another number of steps
    (the output keeps no optimizer state to go on from). Decided before the base model loads (a 70B base takes
    minutes of the job's slot): from the record, the training records, the base model's files (check_model: the
    refusals of a run on it) and the flags, `dtype` as resolved; with the same records, tokenizer and flags, this
    run has the finished run's number of examples once tokenized."""
    records, _ = load_training_splits(args)
    fingerprint = training_fingerprint(args, records, check_model(args), dtype)
    check_resumable(record, args, world_size, None, "the finished run")
    check_fingerprint(record["fingerprint"], fingerprint, args, "the finished run")
    if record["learning_rate"] != args.learning_rate:  # which a resume may change, but a finished run has no state
        raise UsageError(f"the finished run in {args.output_dir} was trained at --learning_rate "
                         f"{record['learning_rate']}, this run has {args.learning_rate}; a finished run keeps no "
                         "optimizer state to go on from: resume one of its checkpoints at the new rate with "
                         "--resume_from_checkpoint, or train anew with --overwrite_output_dir (without "
                         "--resume_from_checkpoint)")
    total_steps = StepSchedule.from_args(args, record["num_examples"], world_size).total_steps
    if record["step"] != total_steps:
        newest = latest_checkpoint(args.output_dir) if total_steps > record["step"] else None
        raise UsageError(f"the finished run in {args.output_dir} ended at step {record['step']}, this run would end "
                         f"at step {total_steps}; a finished run keeps no optimizer state to go on from: "
                         + (f"resume its newest checkpoint with --resume_from_checkpoint {newest}, or " if newest
                            else "") + "train anew with --overwrite_output_dir (without --resume_from_checkpoint)")
    return (f"Nothing to train: {args.output_dir} holds this run, finished at step {record['step']} with these "
            "data, model and flags (to train it again: --overwrite_output_dir without --resume_from_checkpoint)")
