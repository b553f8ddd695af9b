"""Checkpoints on disk: written atomically, verified when read, rotated; the output directory's checks; the
final output's write (`save_output`), under the same storage errors.

A checkpoint `output_dir/checkpoint-<step>/` holds the interventions twice: in pyreft's format (to load
or evaluate it like a final output) and as their full torch state (pyreft's format keeps the rotation's
matrix, not the parametrization's raw parameter the optimizer state refers to). Next to them, the trainer
state: tensors (optimizer, scheduler, every rank's RNG) in `trainer_state.pt`, which loads with
`torch.load(weights_only=True)` and so can never run code, and plain values (position in the batch plan,
batch geometry, wandb run id, and the fingerprint of the data, base model and flags it was trained on, which a
resume must match: alpaca.resume) in `trainer_state.json`. It is written to a hidden staging directory, closed
with a manifest of every file's size and SHA-256 (alpaca.manifest), and renamed into place: a checkpoint-<step>
directory is complete, and a damaged one is detected before anything in it is used.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from alpaca.constants import HELD_OUT_FILE
from alpaca.errors import StorageError, UsageError
from alpaca.manifest import files_problem, read_manifest, write_manifest
from alpaca.output import ARGS_FILE, FINISHED_FILE, METRICS_FILE, plot_loss, save_interventions

PREFIX = "checkpoint-"
INTERVENTIONS_STATE = "interventions.pt"
TRAINER_STATE = "trainer_state.pt"  # the tensors: optimizer, scheduler, RNG states
TRAINER_STATE_JSON = "trainer_state.json"  # the plain values
TENSOR_STATE_KEYS = ("optimizer", "scheduler", "rng")


@dataclass
class TrainerState:
    """What a checkpoint holds besides the interventions: everything an exact resume needs, and what the run is
    bound to. The tensors (TENSOR_STATE_KEYS) go to trainer_state.pt, the plain values to trainer_state.json."""

    step: int  # optimizer steps done
    epoch: int
    next_batch: int  # training goes on at this global batch of the epoch
    window: dict[str, float]  # the logging window so far, summed over ranks, by name (alpaca.output.LogWindow)
    optimizer: dict  # torch's optimizer.state_dict() (under DeepSpeed: alpaca.zero.optimizer_state, the same)
    scheduler: dict
    rng: list[dict[str, torch.Tensor]]  # every rank's random generators (alpaca.resume.rng_state), in rank order
    geometry: dict  # the global batch and how it was made up (alpaca.resume.geometry)
    seed: int
    num_examples: int
    prompt_template: str
    wandb_run_id: str | None
    fingerprint: dict  # the data, base model and flags the run is bound to (alpaca.resume.training_fingerprint)


def _fixed_buffers(intervention) -> dict[str, torch.Tensor]:
    """Return the rotation's parametrization `base`: an n x n buffer fixed at initialization (1.3 MB per intervention
    for a 576-wide model, 67 MB for a 4096-wide one). It is rebuilt from --seed when resuming, so checkpoints
    keep only a fingerprint of it: its column sums. (Not a hash: the QR behind it differs in the last bits
    between thread counts, e.g. under torchrun's one thread per process.)"""
    return {name: buffer for name, buffer in intervention.named_buffers() if name.endswith(".base")}


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().double().sum(dim=0).cpu()


def intervention_states(reft_model) -> dict[str, dict]:
    """Return the full torch state of each intervention (nn.Module.state_dict, not pyreft's override, which keeps only
    the rotation's matrix and not the raw parameter the optimizer state refers to)."""
    states = {}
    for key, intervention in reft_model.interventions.items():
        fixed = _fixed_buffers(intervention)
        state = {name: t for name, t in torch.nn.Module.state_dict(intervention).items() if name not in fixed}
        states[key] = {"state": state, "fixed": {name: _fingerprint(t) for name, t in fixed.items()}}
    return states


def load_intervention_states(reft_model, states: dict[str, dict]) -> None:
    if set(states) != set(reft_model.interventions.keys()):
        raise UsageError(f"the checkpoint has interventions {sorted(states)}, this run builds "
                         f"{sorted(reft_model.interventions.keys())}; resume with the original --layers, "
                         "--position and --share_weights")
    for key, intervention in reft_model.interventions.items():
        fixed = _fixed_buffers(intervention)
        saved = states[key]["fixed"]
        if saved.keys() != fixed.keys() or not all(
                torch.allclose(_fingerprint(t), saved[name], rtol=1e-5, atol=1e-6) for name, t in fixed.items()):
            raise UsageError("the checkpoint's interventions were initialized differently (another --seed, "
                             "--layers, --rank or model); resume with the original run's flags")
        missing, unexpected = torch.nn.Module.load_state_dict(intervention, states[key]["state"], strict=False)
        if unexpected or set(missing) != set(fixed):
            raise RuntimeError(f"checkpoint state of {key} does not fit: missing {missing}, unexpected {unexpected}")


def step_of(path: Path) -> int:
    match = re.fullmatch(rf"{PREFIX}(\d+)", path.name)
    return int(match[1]) if match else -1


def save_checkpoint(output_dir: str | os.PathLike, step: int, reft_model, trainer_state: TrainerState,
                    save_total_limit: int | None = None) -> Path:
    """Write checkpoint-<step> atomically, then delete the oldest beyond `save_total_limit`.

    A write that fails (disk full, quota, permissions) leaves no staging directory behind and raises a
    StorageError naming the newest intact checkpoint."""
    output_dir = Path(output_dir)
    final = output_dir / f"{PREFIX}{step}"
    staging = output_dir / f".{PREFIX}{step}.staging-{os.getpid()}"
    state = vars(trainer_state)
    contents = {
        INTERVENTIONS_STATE: tensor_bytes(intervention_states(reft_model)),
        TRAINER_STATE: tensor_bytes({key: state[key] for key in TENSOR_STATE_KEYS}),
        TRAINER_STATE_JSON: json.dumps({key: value for key, value in state.items() if key not in TENSOR_STATE_KEYS},
                                       indent=2).encode(),
    }
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with storage_errors(f"writing {final}", output_dir):
            save_interventions(reft_model, staging)
            if (output_dir / ARGS_FILE).exists():
                contents[ARGS_FILE] = (output_dir / ARGS_FILE).read_bytes()
            for name, data in contents.items():
                write_file(staging / name, data)
            write_manifest(staging, step=step)
            for path in staging.iterdir():  # on disk before the rename makes the checkpoint visible
                with open(path, "rb") as file:
                    os.fsync(file.fileno())
            if final.exists():  # the same step saved again after a resume
                shutil.rmtree(final)
            os.rename(staging, final)
    except StorageError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    rotate_checkpoints(output_dir, save_total_limit)
    return final


@contextlib.contextmanager
def storage_errors(what: str, output_dir: str | os.PathLike) -> Iterator[None]:
    """Turn a write inside that fails for a reason outside the program (disk full, quota, permissions) into a
    StorageError: one line with what failed, the free space there, the newest intact checkpoint, and how to
    resume."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        if isinstance(error, ConnectionError) or isinstance(error, RuntimeError) and "writ" not in str(error):
            raise  # not storage: a tracker's network (an OSError too), or a bug. pyvene's torch.save reports a
            # full disk as a RuntimeError ("... failed writing file ...")
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).splitlines()[0]
        newest = latest_checkpoint(output_dir)
        raise StorageError(
            f"{what} failed: {reason} ({shutil.disk_usage(output_dir).free / 2**20:.0f} MiB free there). "
            + (f"The newest intact checkpoint is {newest}: " if newest else "No checkpoint was saved before: ")
            + "make room (or fix the permissions), then rerun with --resume_from_checkpoint auto") from None


def save_output(reft_model, metrics, output_dir: str | os.PathLike, finished: dict) -> None:
    """Write the run's final output: the interventions (pyreft's format) and the closed metrics log; then, renamed into
    place after them, the record that the run finished (alpaca.resume.finished_record); last loss.png, drawn from the
    metrics: a plot that fails is one line, and the run stands."""
    with storage_errors(f"writing the output to {output_dir}", output_dir):
        save_interventions(reft_model, output_dir)
        metrics.close()
        staging = Path(output_dir) / f".{FINISHED_FILE}.staging-{os.getpid()}"
        with open(staging, "wb") as file:
            file.write(json.dumps(finished, indent=2).encode())
            os.fsync(file.fileno())
        os.replace(staging, Path(output_dir) / FINISHED_FILE)
    try:
        plot_loss(output_dir)
    except Exception as error:  # noqa: BLE001 - a figure of metrics that are written: nothing of the run is lost
        print(f"loss.png not drawn ({type(error).__name__}: {error}); the metrics it shows are in "
              f"{Path(output_dir) / METRICS_FILE}", file=sys.stderr)


def tensor_bytes(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def write_file(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a plain file write, so a full disk surfaces as OSError(ENOSPC), not as
    torch.save's "unexpected pos" RuntimeError."""
    with open(path, "wb") as file:
        file.write(data)


def checkpoint_problem(path: Path) -> str | None:
    """Return what is wrong with a checkpoint directory, or None if it is complete and intact. A manifest of any shape
    but the one save_checkpoint writes counts as damage, as a file that does not match its SHA-256 does."""
    if not path.is_dir():
        return "missing (no such directory)"
    manifest = read_manifest(path)
    if isinstance(manifest, str):
        return manifest
    return files_problem(path, manifest, required=(INTERVENTIONS_STATE, TRAINER_STATE, TRAINER_STATE_JSON))


def is_complete(path: Path) -> bool:
    """Tell whether a checkpoint is complete and intact: every file of the manifest there, with its size and SHA-256."""
    return checkpoint_problem(path) is None


def checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """List the checkpoint-<step> directories, oldest first (intact or not)."""
    directory = Path(output_dir)
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if p.is_dir() and step_of(p) >= 0), key=step_of)


def rotate_checkpoints(output_dir: str | os.PathLike, save_total_limit: int | None) -> None:
    """Keep the newest `save_total_limit` intact checkpoints; the newest intact one always survives."""
    if not save_total_limit or save_total_limit <= 0:
        return
    intact = [path for path in checkpoints(output_dir) if is_complete(path)]
    for path in intact[: -save_total_limit]:
        shutil.rmtree(path, ignore_errors=True)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """Find the newest intact checkpoint; incomplete or damaged ones are skipped with a warning."""
    for path in reversed(checkpoints(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        print(f"warning: skipping {path}: {problem}", file=sys.stderr)
    return None


def load_checkpoint(path: str | os.PathLike) -> tuple[dict, dict]:
    """Load the intervention states and the trainer state, on the CPU, from a checkpoint verified against its manifest.
    Only tensors and plain containers are unpickled (weights_only=True): a checkpoint never runs code."""
    path = Path(path)
    problem = checkpoint_problem(path)
    if problem is not None:
        raise UsageError(f"--resume_from_checkpoint {str(path)!r} is {problem}; pass an intact checkpoint-<step> "
                         "directory, or 'auto' for the newest intact one")
    try:
        states = torch.load(path / INTERVENTIONS_STATE, map_location="cpu", weights_only=True)
        tensors = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UsageError(f"{path} holds pickled objects besides tensors, which could run code when loaded; it is "
                         "not loaded. Resume from a checkpoint these scripts wrote") from None
    return states, {**json.loads((path / TRAINER_STATE_JSON).read_text()), **tensors}


def prepare_output_dir(args: argparse.Namespace) -> tuple[Path | None, dict | None]:
    """Check the output directory before anything is loaded or written; return the checkpoint to resume from, if any,
    and with --resume_from_checkpoint auto in a finished run's directory, that run's record
    (alpaca.resume.check_finished).

    An earlier run's output is never overwritten by mistake: a finished run or checkpoints in
    output_dir are refused unless resuming or --overwrite_output_dir.
    """
    output_dir = Path(args.output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(output_dir)
        probe = output_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise UsageError(f"--output_dir {args.output_dir!r} is not writable ({error.strerror}); "
                         "pass a directory you can write to") from None
    if args.resume_from_checkpoint:
        if args.resume_from_checkpoint != "auto":
            return Path(args.resume_from_checkpoint), None
        if (output_dir / FINISHED_FILE).exists():
            try:
                return None, json.loads((output_dir / FINISHED_FILE).read_text())
            except ValueError:
                raise UsageError(f"{output_dir / FINISHED_FILE} is damaged; train anew with --overwrite_output_dir "
                                 "(without --resume_from_checkpoint)") from None
        latest = latest_checkpoint(output_dir)
        if latest is None:
            print(f"No checkpoint in {output_dir} to resume from: starting from scratch.")
        return latest, None
    earlier = checkpoints(output_dir) or (output_dir / ARGS_FILE).exists()
    if earlier and not args.overwrite_output_dir:
        raise UsageError(f"--output_dir {args.output_dir!r} already holds a run; resume it with "
                         "--resume_from_checkpoint auto, or pass --overwrite_output_dir to replace it")
    if earlier:
        for path in checkpoints(output_dir):
            shutil.rmtree(path)
    return None, None


def remove_stale_staging(output_dir: str | os.PathLike) -> None:
    """Remove staging directories (and files) left by a run killed while writing a checkpoint, its held-out records or
    its final output."""
    for pattern in (f".{PREFIX}*.staging-*", ".staging-*"):
        for path in Path(output_dir).glob(pattern):
            shutil.rmtree(path, ignore_errors=True)
    for name in (FINISHED_FILE, HELD_OUT_FILE):
        for path in Path(output_dir).glob(f".{name}.staging-*"):
            path.unlink()
