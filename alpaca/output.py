"""The output directory: trained interventions in pyreft's format, the resolved arguments, metrics."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import netrc
import os
import pickle
import resource
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from urllib.parse import urlparse

import datasets
import torch
import transformers

from alpaca.constants import HELD_OUT_FILE, INTERVENTIONS
from alpaca.errors import UsageError
from alpaca.model import import_intervention, new_intervention
from alpaca.workarounds import (
    compute_in_float32,
    keep_foreign_hooks,
    pyreft,
    register_layout,
    set_train_mode,
    trainable_dtype,
)

ARGS_FILE = "training_args.json"
FINISHED_FILE = "run_finished.json"  # written last: the run finished, and what it was trained on
METRICS_FILE = "metrics.jsonl"
LOSS_PLOT_FILE = "loss.png"


def save_interventions(reft_model, directory: str | os.PathLike) -> None:
    """Write `config.json` + `intkey_*.bin`, loadable with `pyreft.ReftModel.load(directory, base_model)`.

    pyvene's `save` pickles tensors on their training device, so a run saved on a GPU would not load
    on a CPU-only machine: we rewrite each binary with CPU tensors, in the same layout. Files are
    written to a fresh staging directory and moved in, so a crash never leaves half a file behind.
    """
    os.makedirs(directory, exist_ok=True)
    staging_root = tempfile.mkdtemp(prefix=".staging-", dir=directory)
    staging = os.path.join(staging_root, "interventions")  # pyvene complains about existing directories
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # pyvene prints "Directory ... created"
            reft_model.save(save_directory=staging)
        for key, intervention in reft_model.interventions.items():
            state = {name: tensor.detach().cpu() for name, tensor in intervention.state_dict().items()}
            torch.save(state, os.path.join(staging, f"intkey_{key}.bin"))
        for name in os.listdir(staging):
            os.replace(os.path.join(staging, name), os.path.join(directory, name))
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)


def load_reft_model(directory: str | os.PathLike, base_model):
    """Load the ReFT model saved in `directory` (pyreft's format), on the base model's device, computing as training
    did: interventions in float32, their outputs in the base's dtype (alpaca.workarounds.compute_in_float32).

    It reads pyreft's files itself rather than through `pyreft.ReftModel.load`, which fails on NoReFT and
    NodiReFT (their `add_bias` is not saved), rebuilds learned sources in bfloat16 whatever the model's
    dtype, and imports whatever module config.json names. Here each intervention is rebuilt from its
    class (only those of INTERVENTIONS) and takes its saved state through its own `load_state_dict`,
    whatever its layout. Nothing runs code: `intkey_*.bin` are read weights-only.
    """

    directory = Path(directory)
    try:
        config = json.loads((directory / "config.json").read_text())
        states = {path.name: torch.load(path, map_location="cpu", weights_only=True)
                  for path in directory.glob("intkey_*.bin")}
        layout = list(zip(config["intervention_types"], config["representations"], config["intervention_dimensions"],
                          config["sorted_keys"], strict=True))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{directory} holds no readable interventions ({error}); pass an output_dir written by "
                         "train.py or one of its checkpoint-<step> directories") from None
    except pickle.UnpicklingError:
        raise UsageError(f"{directory} has intervention files holding pickled objects besides tensors, which "
                         "could run code when loaded; they are not loaded") from None
    known = {f"<class '{path}'>": path for path in INTERVENTIONS.values()}
    foreign = sorted({type_name for type_name, *_ in layout if type_name not in known})
    if foreign:
        raise UsageError(f"{directory}/config.json names intervention classes that are not in INTERVENTIONS "
                         f"({', '.join(foreign)}); they are not imported")
    representations = [
        {"layer": layer, "component": component, "low_rank_dimension": low_rank_dimension,
         "intervention": new_intervention(import_intervention(known[type_name]), dimension, low_rank_dimension,
                                          base_model.dtype,
                                          add_bias="proj_layer.bias" in states.get(f"intkey_{key}.bin", {}))}
        for type_name, (layer, component, _, _, low_rank_dimension, *_), dimension, key in layout
    ]
    register_layout(base_model)
    # A base spread by a device map is not moved (accelerate refuses to): its interventions stay on the CPU until
    # alpaca.device_map.DeviceMap.place puts each on its layer's device.
    device_mapped = hasattr(base_model, "hf_device_map")
    reft_model = pyreft.get_reft_model(base_model, pyreft.ReftConfig(representations=representations),
                                       set_device=not device_mapped)
    keep_foreign_hooks(reft_model)
    compute_in_float32(reft_model)
    for key, intervention in reft_model.interventions.items():
        if f"intkey_{key}.bin" not in states:
            raise UsageError(f"{directory} lacks intkey_{key}.bin; pass a complete output_dir")
        intervention.load_state_dict(states[f"intkey_{key}.bin"])
        intervention.to(trainable_dtype(base_model.dtype))  # LoReFT's load rebuilds its rotation in float32
    if not device_mapped:
        reft_model.set_device(base_model.device, set_model=False)
    set_train_mode(reft_model, False)
    return reft_model


def save_args(args: argparse.Namespace, directory: str | os.PathLike, held_out: datasets.Dataset | None = None,
              **resolved) -> None:
    """Save the arguments, the run's first write to its output directory: a finished run there is finished no more.
    The records --eval_split_ratio `held_out` go beside them (HELD_OUT_FILE); an earlier run's are removed."""
    (Path(directory) / FINISHED_FILE).unlink(missing_ok=True)
    (Path(directory) / HELD_OUT_FILE).unlink(missing_ok=True)
    if held_out is not None:
        staging = Path(directory) / f".{HELD_OUT_FILE}.staging-{os.getpid()}"
        staging.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in held_out),
                           encoding="utf-8")
        os.replace(staging, Path(directory) / HELD_OUT_FILE)
    with open(Path(directory) / ARGS_FILE, "w") as file:
        json.dump({**vars(args), **resolved}, file, indent=2, default=str)


class LogWindow:
    """What training saw since the last log, as named sums (SUMS). A sum of device values (the token loss) stays on
    the device in float64, since reading it makes the host wait for the step: it is read once per logging step. A
    sum of host values (the label tokens and tokens the collator counted) stays on the host."""

    # The sums, in the order ranks all-reduce them as one tensor. A metric of your own is one more name here, added
    # to with `add_sums` and shown by train_record (docs/adapting.md (h)).
    SUMS = ("loss_sum", "label_tokens", "tokens")
    # The sums a resumed run carries over from its checkpoint, so that its logged loss is an uninterrupted run's.
    # The tokens restart, as tokens/s restarts with the clock.
    CARRIED = ("loss_sum", "label_tokens")

    def __init__(self, device: torch.device, carried: dict[str, float] | None = None) -> None:
        """`carried`: a checkpoint's sums (`restored`), on one rank only, since they are the sums over ranks."""
        self.device = device
        self.sums: dict[str, torch.Tensor | float] = dict.fromkeys(self.SUMS, 0) | (carried or {})
        self.tokens_seen = 0  # since the start of this process, for its throughput

    def add(self, summed_loss: torch.Tensor, batch: dict) -> None:
        """Add a micro-batch's summed token loss (on the device) and the tokens its collator counted."""
        self.add_sums(loss_sum=summed_loss, label_tokens=batch["num_label_tokens"], tokens=batch["num_tokens"])
        self.tokens_seen += batch["num_tokens"]

    def add_sums(self, **values: torch.Tensor | float) -> None:
        """Add to the named sums: a tensor, detached, in float64 on its device; a number on the host."""
        for name, value in values.items():
            self.sums[name] = self.sums[name] + (value.detach().double() if isinstance(value, torch.Tensor) else value)

    def totals(self) -> torch.Tensor:
        """Return the sums in SUMS order, float64 on the device: what ranks all-reduce (one collective); `named` reads
        it back. The host's sums travel to the device in one copy."""
        values = [self.sums[name] for name in self.SUMS]
        host = torch.tensor([0 if isinstance(value, torch.Tensor) else value for value in values],
                            dtype=torch.float64, device=self.device)
        return torch.stack([value if isinstance(value, torch.Tensor) else host[index]
                            for index, value in enumerate(values)])

    @classmethod
    def named(cls, totals: torch.Tensor) -> dict[str, float]:
        """Return `totals`' values by name (a read of the device: a logging step's or a checkpoint's)."""
        return dict(zip(cls.SUMS, totals.tolist(), strict=True))

    @classmethod
    def restored(cls, saved: dict[str, float] | list) -> dict[str, float]:
        """Return the CARRIED sums of a checkpoint's window (`named` totals, summed over ranks)."""
        if not isinstance(saved, dict) or not set(cls.CARRIED) <= saved.keys():
            raise UsageError("the checkpoint's logging window lacks the sums this version carries over a resume "
                             f"({', '.join(cls.CARRIED)}): it was written by another version of these scripts; resume "
                             "it with that version, or train anew in another --output_dir")
        return {name: saved[name] for name in cls.CARRIED}

    def reset(self) -> None:
        self.sums = dict.fromkeys(self.SUMS, 0)


def start_line(summary: str, schedule, args: argparse.Namespace, *, eval_size: int, resume_from, step: int,
               ready_s: float, processes: int = 1, placement: str = "") -> str:
    """Return the line a run starts with: data and model, the global batch and the step schedule, where it resumes."""
    per_process = f"{processes} processes x " if processes > 1 or placement else ""
    return (f"{summary}\nglobal batch {schedule.global_batch_size} = {args.per_device_train_batch_size} per device x "
            f"{per_process}{args.gradient_accumulation_steps} accumulation"
            + (f", packed into micro-batches of up to {args.packing_max_tokens} tokens" if args.packing else "")
            + f" | {schedule.total_steps} steps "
            f"({schedule.steps_per_epoch} per epoch){placement}"
            + (f" | eval: {eval_size} examples, {args.eval_strategy}" if eval_size else "")
            + (f" | resuming {resume_from} at step {step}" if resume_from else "")
            + f" | ready in {ready_s:.1f}s")


def train_record(step: int, steps_per_epoch: int, sums: dict[str, float], *, learning_rate: float, grad_norm: float,
                 window_seconds: float, elapsed_s: float) -> dict:
    """Build a training log record from a window's sums since the last one, summed over ranks (LogWindow.named)."""
    return {"step": step, "epoch": round(step / steps_per_epoch, 4), "loss": sums["loss_sum"] / sums["label_tokens"],
            "learning_rate": learning_rate, "grad_norm": grad_norm, "tokens_per_s": sums["tokens"] / window_seconds,
            "elapsed_s": elapsed_s}


def eval_record(step: int, steps_per_epoch: int, totals: list[float], num_examples: int, seconds: float) -> dict:
    """Build an evaluation log record from (summed loss, label tokens) over the whole evaluation set."""
    loss_sum, label_tokens = totals
    return {"step": step, "epoch": round(step / steps_per_epoch, 4), "eval_loss": loss_sum / label_tokens,
            "eval_label_tokens": int(label_tokens), "eval_examples": num_examples, "eval_s": seconds}


class MetricsLog:
    """The run's arguments (args.json, with the values `resolved` from them), then one JSON object per logged
    step (training) or evaluation in `metrics.jsonl`, and in wandb with `--report_to wandb` (as train/<key> and
    eval/<key>, like HF's Trainer). `disable`: a log that writes nothing (a rank but 0), as tqdm's."""

    def __init__(self, directory: str | os.PathLike, args: argparse.Namespace, resume_step: int = 0,
                 wandb_run_id: str | None = None, disable: bool = False, held_out: datasets.Dataset | None = None,
                 **resolved):
        """Start the run's log: a resumed run keeps the records up to its checkpoint (a killed run may have logged past
        it) and continues the same wandb run. The arguments (and the `held_out` records) are saved first."""
        self.disable, self.wandb_run = disable, None
        if disable:
            return
        save_args(args, directory, held_out, **resolved)
        self.path = Path(directory) / METRICS_FILE
        kept = [r for r in read_metrics(directory) if r["step"] <= resume_step] if resume_step else []
        self.path.write_text("".join(json_line(record) for record in kept))
        self.wandb_run = (start_wandb(args, {**vars(args), **resolved}, wandb_run_id)
                          if args.report_to == "wandb" else None)
        self.postfix: dict[str, str] = {}

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def write(self, record: dict, progress=None) -> None:
        """Append the record; with a tqdm `progress` bar, show it there (evaluations also as a line)."""
        if self.disable:
            return
        with open(self.path, "a") as file:
            file.write(json_line(record))
        if self.wandb_run is not None:
            self.wandb_run.log({key.replace("eval_", "eval/", 1) if key.startswith("eval_") else f"train/{key}": value
                                for key, value in finite_or_none(record).items() if key != "step"},
                               step=record["step"])
        if progress is None:
            return
        if "eval_loss" in record:
            self.postfix["eval_loss"] = f"{record['eval_loss']:.4f}"
            progress.write(f"step {record['step']}: eval loss {record['eval_loss']:.4f} on "
                           f"{record['eval_examples']} examples ({record['eval_s']:.1f}s)")
        else:
            self.postfix.update(loss=f"{record['loss']:.4f}", lr=f"{record['learning_rate']:.2e}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
        progress.set_postfix(self.postfix)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()

    def records(self) -> list[dict]:
        return read_metrics(self.path.parent)

    def loss_summary(self) -> str:
        """Summarize the logged training loss as 'loss first -> last', and the eval loss when there is one."""
        records = self.records()
        summary = []
        for key, name in (("loss", "loss"), ("eval_loss", "eval loss")):
            values = [record[key] for record in records if record.get(key) is not None]  # null: not finite
            if values:
                summary.append(f"{name} {values[0]:.4f} -> {values[-1]:.4f}")
        return ", ".join(summary)


def _has_wandb_credentials() -> bool:
    """Tell whether there is an API key in the environment or in ~/.netrc (where `wandb login` puts it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def start_wandb(args: argparse.Namespace, config: dict, run_id: str | None = None):
    """Start a wandb run that never prompts: without credentials (and no WANDB_MODE) it runs offline.
    With `run_id` (from a checkpoint) it continues that run."""
    import wandb  # here: only --report_to wandb needs it, and its import takes seconds

    offline = "WANDB_MODE" not in os.environ and not _has_wandb_credentials()
    run = wandb.init(project=args.wandb_project, name=args.run_name, config=config, dir=args.output_dir,
                     mode="offline" if offline else None, id=run_id, resume="allow" if run_id else None)
    if offline:
        print(f"wandb: not logged in, so this run is logged offline in {run.dir}; upload it later with: "
              f"wandb sync {Path(run.dir).parent}")
    return run


def finite_or_none(record: dict) -> dict:
    """Return the record with a NaN or infinite number as None: JSON (RFC 8259) has no NaN or Infinity, which
    json.dumps writes as bare tokens that strict parsers refuse."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()}


def json_line(record: dict) -> str:
    return json.dumps(finite_or_none(record), allow_nan=False) + "\n"


def read_metrics(directory: str | os.PathLike) -> list[dict]:
    path = Path(directory) / METRICS_FILE
    if not path.exists():
        return []
    with open(path) as file:
        return [json.loads(line) for line in file if line.strip()]


def plot_loss(directory: str | os.PathLike) -> Path:
    import matplotlib  # here: once per run, at its end; its import takes a second

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(directory)
    figure, axis = plt.subplots(figsize=(6, 3.5))
    for key, label, style in (("loss", "train loss", "-"), ("eval_loss", "eval loss", "o-")):
        # a value that was not finite (null) leaves a gap in the line
        points = [(record["step"], math.nan if record[key] is None else record[key])
                  for record in records if key in record]
        if points:
            axis.plot(*zip(*points), style, label=label)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss (per output token)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    path = Path(directory) / LOSS_PLOT_FILE
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def peak_memory(gpus: list[int]) -> str:
    """Describe the process's peak memory: allocated on each of its `gpus`, or resident without one."""
    if not gpus:
        return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB resident"
    return ", ".join(f"cuda:{gpu} {torch.cuda.max_memory_allocated(gpu) / 2**30:.2f} GiB" for gpu in gpus)


def quiet_non_main_rank() -> None:
    """Make a rank other than 0 print errors only: no stdout, progress bars or library warnings."""
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)  # pyvene warns through the root logger
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
