"""Resuming a run exactly: every rank's random generators, the checkpoint's state loaded into the training
objects, and the checks that a resumed run is the checkpoint's own (the same global batch, seed, prompts,
data, base model and flags)."""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch

from alpaca.checkpoint import load_intervention_states
from alpaca.data import records_fingerprint
from alpaca.errors import UsageError
from alpaca.flag_values import parse_layers, parse_position
from alpaca.model import model_fingerprint
from alpaca.optim import StepSchedule
from alpaca.output import LogWindow


def rng_state(gpus: list[int]) -> dict[str, torch.Tensor]:
    """Every random generator training draws from, as tensors (a weights-only load accepts them): the host's
    and those of the process's GPUs (several under --device_map, whose interventions draw dropout on each)."""
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
    """The process's first GPU under "cuda" (the one a single-GPU run has); its others after it."""
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


def restore_training_state(checkpoint: tuple[dict, dict], args: argparse.Namespace, reft_model, optimizer,
                           scheduler, rank: int, world_size: int, num_examples: int, gpus: list[int],
                           fingerprint: dict):
    """Load a checkpoint into the training objects; returns where training goes on:
    (step, epoch, next batch, the logging window's carried sums, wandb run id). `optimizer` None: the caller loads the
    optimizer state later (DeepSpeed's partitions exist only once its engine does). `fingerprint`: this run's
    (training_fingerprint), which must be the checkpoint's."""
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
    if optimizer is not None:
        optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    if saved["geometry"]["world_size"] == world_size:  # else dropout's streams restart; the plan is the same
        restore_rng_state(saved["rng"][rank], gpus)
    # The saved window is the sum over ranks: one rank carries it on.
    window = LogWindow.restored(saved["window"]) if rank == 0 else {}
    return saved["step"], saved["epoch"], saved["next_batch"], window, saved["wandb_run_id"]


# bitsandbytes' quantization of the base
QUANTIZATION_FLAGS = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant")
# The flags a checkpoint is bound to, besides those checked on their own (the global batch, --seed,
# --prompt_template): each changes what a step computes. A resumed run that changed one would not be the run the
# checkpoint belongs to; some would even be ignored without a word (the optimizer's and scheduler's states
# restore the learning rate, weight decay and betas). The run's length (--max_steps, --num_train_epochs) may change.
BOUND_FLAGS = ("model_max_length", "layers", "position", "share_weights", "intervention", "rank", "dropout",
               "group_by_length", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
               "max_grad_norm", "lr_scheduler_type", "warmup_ratio", "warmup_steps", "dtype", *QUANTIZATION_FLAGS)


def training_fingerprint(args: argparse.Namespace, records, model) -> dict:
    """What a checkpoint is bound to: the training data as trained on (content), the base model (config,
    tokenizer, weights: alpaca.model.model_fingerprint) and BOUND_FLAGS, normalized (--layers all is the list of
    layers, --dtype auto the dtype it resolved to)."""
    first_n, last_n = parse_position(args.position)
    flags = {name: getattr(args, name) for name in BOUND_FLAGS}
    flags.update(layers=";".join(map(str, parse_layers(args.layers, model.config.num_hidden_layers))),
                 position="+".join(f"{side}{n}" for side, n in (("f", first_n), ("l", last_n)) if n),
                 dtype=str(model.dtype).removeprefix("torch."))
    return {"data": records_fingerprint(records), "model": model_fingerprint(model.name_or_path, args.cache_dir),
            "flags": flags}


def check_fingerprint(saved: dict | None, current: dict, args: argparse.Namespace) -> None:
    """Refuse, in one line naming every difference, a resume on other data, another base model or other flags."""
    if saved is None:
        raise UsageError("the checkpoint records no fingerprint of its data, base model and flags, so this resume "
                         "cannot be checked against them; resume it with the version of these scripts that wrote it, "
                         "or train anew in another --output_dir")
    changes = []
    if saved["data"] != current["data"]:
        changes.append(f"the training data (the records of --data_path {args.data_path!r} as trained on, after "
                       "--field_map, --max_n_train_example and any held-out split)")
    changes += [f"the base model's {part} (--model_name_or_path {args.model_name_or_path!r})"
                for part in ("config", "tokenizer", "weights") if saved["model"][part] != current["model"][part]]
    recorded = saved["flags"]
    changes += [f"--{name} ({recorded[name] if name in recorded else 'not recorded'} in the checkpoint, {value} in "
                "this run)" for name, value in current["flags"].items()
                if name not in recorded or recorded[name] != value]
    if changes:
        raise UsageError(f"this run differs from the checkpoint in {'; '.join(changes)}. Resume with the data, "
                         "model and flags the checkpoint was trained with (its training_args.json), or train "
                         "anew in another --output_dir")


def geometry(args: argparse.Namespace, world_size: int) -> dict:
    return {"world_size": world_size, "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "global_batch_size": args.per_device_train_batch_size * world_size * args.gradient_accumulation_steps}


def describe_geometry(g: dict) -> str:
    return (f"global batch {g['global_batch_size']} = {g['per_device_train_batch_size']} per device x "
            f"{g['world_size']} processes x {g['gradient_accumulation_steps']} accumulation")


def check_resumable(trainer_state: dict, args: argparse.Namespace, world_size: int, num_examples: int) -> None:
    """The batch plan must be the same one: same global batch, seed and prompts; the world size may change."""
    saved, current = trainer_state["geometry"], geometry(args, world_size)
    if saved["global_batch_size"] != current["global_batch_size"]:
        raise UsageError(f"the checkpoint was written with {describe_geometry(saved)}, this run has "
                         f"{describe_geometry(current)}; resume with the same global batch")
    if trainer_state["seed"] != args.seed:
        raise other_data_or_seed(trainer_state, args, num_examples)
    saved_template = trainer_state["prompt_template"]
    if saved_template != args.prompt_template:
        raise UsageError(f"the checkpoint was trained with --prompt_template {saved_template}, this run has "
                         f"{args.prompt_template}; resume with --prompt_template {saved_template}")


def other_data_or_seed(trainer_state: dict, args: argparse.Namespace, num_examples: int) -> UsageError:
    return UsageError(f"the checkpoint was written with --seed {trainer_state['seed']} on "
                      f"{trainer_state['num_examples']} examples, this run has --seed {args.seed} on {num_examples}; "
                      "resume with the same data and seed")
