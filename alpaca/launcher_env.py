"""What the launcher tells this process through its environment: its rank, and `accelerate launch`'s settings.
Standard library only."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

from alpaca.errors import UsageError
from alpaca.flag_values import sharding_flag


def launched_alone_as_world_of_one() -> None:
    """Give plain `python train_multigpu.py` (or examples/generate.py) the environment torchrun gives a world of
    one process, on a free port."""
    if "RANK" in os.environ:  # torchrun or accelerate launched it
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port))


def exit_if_launched_on_several_processes(prog: str) -> None:
    """Refuse train.py under torchrun: every rank would train on all the data and overwrite the others' output."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        sys.exit(f"{prog}: error: launched on {world_size} processes (WORLD_SIZE={world_size}); {prog} trains "
                 f"on one device. Use: torchrun --nproc_per_node {world_size} train_multigpu.py <same flags>")


def spare_cores() -> int:
    """Return the cores this process can spare for work of its own (tokenizing): all it may run on (a job scheduler's
    share; macOS knows only the machine's count). Under torchrun one process a node tokenizes while the others wait
    for its cache (alpaca.distributed.first_on_local_main), so it is not a share of the node's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def is_main_process() -> bool:
    """Tell whether this is rank 0, or not distributed. Every rank parses and validates; rank 0 reports a mistake."""
    return os.environ.get("RANK", "0") == "0"


def exit_with_line(line: str, status: int) -> NoReturn:
    """Print `line` (a mistake or a failure, told in one line) on stderr and exit with `status`. Under torchrun
    the line is this worker's error file too, in the format torchelastic's `record` writes: torchrun's summary
    then names it as the root cause of the failed attempt, where it would say `error_file: <N/A>`."""
    print(line, file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                             "timestamp": str(int(time.time()))}}}
        with contextlib.suppress(OSError):  # the line is out already
            Path(error_file).write_text(json.dumps(record))
    raise SystemExit(status)


def follow_accelerate_launch(args: argparse.Namespace) -> None:
    """Follow `accelerate launch --use_deepspeed` and `--use_fsdp`: they tell the script through its environment
    (accelerate 1.x: ACCELERATE_USE_DEEPSPEED and ACCELERATE_DEEPSPEED_CONFIG_FILE; ACCELERATE_USE_FSDP and
    FSDP_OFFLOAD_PARAMS), which accelerate's own Accelerator would read. These scripts have none, so they read them
    here: the run is the one of --deepspeed CONFIG.json or --fsdp, never a silent DDP run. The other DeepSpeed and FSDP
    settings of accelerate are not read: the config file and the flags give them."""
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
    """Follow the mixed precision and dynamo backend `accelerate launch` passes (its flags, else its saved config) as
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
