"""What the launcher and the cluster tell this process, and how it answers: its rank, `accelerate launch`'s
settings passed through the environment, the wait for the launcher to stop a rank that found a usage error, and
stop signals (SIGTERM, SIGINT), which end the run with a checkpoint. Standard library only."""

from __future__ import annotations

import argparse
import os
import signal
import time

from alpaca.errors import UsageError
from alpaca.flag_values import sharding_flag


def is_main_process() -> bool:
    """Rank 0, or not distributed. Every rank parses and validates; rank 0 reports a mistake."""
    return os.environ.get("RANK", "0") == "0"


def follow_accelerate_launch(args: argparse.Namespace) -> None:
    """`accelerate launch --use_deepspeed` and `--use_fsdp` tell the script through its environment (accelerate 1.x:
    ACCELERATE_USE_DEEPSPEED and ACCELERATE_DEEPSPEED_CONFIG_FILE; ACCELERATE_USE_FSDP and FSDP_OFFLOAD_PARAMS),
    which accelerate's own Accelerator would read. These scripts have none, so they read them here: the run is
    the one of --deepspeed CONFIG.json or --fsdp, never a silent DDP run. The other DeepSpeed and FSDP settings
    of accelerate are not read: the config file and the flags give them."""
    launched_with = [name for name, variable in (("--use_deepspeed", "ACCELERATE_USE_DEEPSPEED"),
                                                 ("--use_fsdp", "ACCELERATE_USE_FSDP"))
                     if os.environ.get(variable, "").lower() == "true"]
    if not launched_with:
        return
    if not hasattr(args, "fsdp"):
        raise UsageError(f"accelerate launch {launched_with[0]}: train.py trains on one device; launch "
                         "train_multigpu.py with the same flags")
    if launched_with[0] == "--use_fsdp":
        words = (args.fsdp or "full_shard").split()
        offload = os.environ.get("FSDP_OFFLOAD_PARAMS", "").lower() == "true"
        args.fsdp = " ".join(words + (["offload"] if offload and "offload" not in words else []))
        return
    config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not config_file:
        raise UsageError("accelerate launch --use_deepspeed without --deepspeed_config_file: ZeRO's settings come "
                         "from a DeepSpeed config here; add --deepspeed_config_file examples/deepspeed/zero2.json (or "
                         "pass --deepspeed CONFIG.json to the script)")
    if args.deepspeed and os.path.abspath(args.deepspeed) != os.path.abspath(config_file):
        raise UsageError(f"--deepspeed {args.deepspeed} and accelerate's --deepspeed_config_file {config_file} differ; "
                         "pass one of them")
    args.deepspeed = config_file


ACCELERATE_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def follow_accelerate_precision_and_dynamo(args: argparse.Namespace) -> None:
    """`accelerate launch` passes its mixed precision and dynamo backend (its flags, else its saved config) as
    ACCELERATE_MIXED_PRECISION and ACCELERATE_DYNAMO_BACKEND ("no" when unset). bf16/fp16 are read as HF's
    Trainer reads them, as --bf16 and --fp16 (here: the base in that dtype, the interventions in float32);
    inductor as --torch_compile. What the scripts cannot run is refused, and so is a flag that says otherwise:
    never a silent float32 or eager run. (accelerate's DeepSpeed launcher passes no dynamo backend at all.)"""
    precision = (os.environ.get("ACCELERATE_MIXED_PRECISION") or "no").lower()
    setting = f"accelerate's mixed_precision {precision} (its --mixed_precision or its config file)"
    if precision in ACCELERATE_DTYPES:
        given = "--bf16" if args.bf16 else "--fp16" if args.fp16 else f"--dtype {args.dtype}"
        if given not in ("--dtype auto", f"--{precision}", f"--dtype {ACCELERATE_DTYPES[precision]}"):
            raise UsageError(f"{setting} and {given} differ; pass one of them")
        if precision == "fp16" and getattr(args, "deepspeed", None):
            raise UsageError(f"{setting} under --deepspeed: a float16 base needs loss scaling, which these scripts "
                             "do not run; launch with --mixed_precision bf16")
        args.dtype = ACCELERATE_DTYPES[precision]
    elif precision != "no":
        raise UsageError(f"{setting}: these scripts train in bf16, fp16 or float32; launch with --mixed_precision "
                         "bf16, or with no and pass --dtype")
    backend = (os.environ.get("ACCELERATE_DYNAMO_BACKEND") or "no").lower()
    setting = f"accelerate's dynamo_backend {backend} (its --dynamo_backend or its config file)"
    if backend == "inductor":
        sharding = sharding_flag(args)
        if sharding:
            raise UsageError(f"{setting} means --torch_compile here, not yet tested with {sharding} (sharded "
                             "weights); launch with --dynamo_backend no")
        args.torch_compile = True
    elif backend != "no":
        raise UsageError(f"{setting}: --torch_compile compiles with inductor only; launch with --dynamo_backend "
                         "inductor, or no")


LAUNCHER_WAIT_S = 30


def wait_for_launcher() -> None:
    """On a rank other than 0, which has found a mistake that rank 0 usually finds too and reports: wait (up to
    LAUNCHER_WAIT_S) for the launcher to stop this process once rank 0 has exited. Leaving first could get rank
    0 stopped before it has printed. A stop signal ends the wait and the process, whatever handlers training
    installed."""
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, signal.SIG_DFL)
    time.sleep(LAUNCHER_WAIT_S)


class StopSignal:
    """SIGTERM (preemption, torchrun forwarding) or SIGINT: finish the step, checkpoint, exit non-zero.

    A worker often gets the same request twice: from the terminal or the cluster, which signal the whole
    process group or cgroup, and again from torchrun, which forwards what it got. So a repeated SIGTERM is
    ignored, and only a second Ctrl-C (SIGINT) given after DUPLICATE_S seconds aborts at once.
    """

    DUPLICATE_S = 2.0

    def __init__(self) -> None:
        self.received: int | None = None
        self.received_at = 0.0
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, self._handle)

    def _handle(self, number: int, frame) -> None:
        if self.received is None:
            self.received, self.received_at = number, time.monotonic()
        elif number == signal.SIGINT and time.monotonic() - self.received_at > self.DUPLICATE_S:
            raise KeyboardInterrupt

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or 0)
