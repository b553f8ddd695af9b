"""A ledger of the collectives a process issues, for the tests that hold the scripts to torch.distributed's rules:
every rank calls the same collectives in the same order, and NCCL takes only tensors on the GPU the process is
bound to (its training device), so a CPU tensor or another GPU's, which gloo on CPU accepts, fails on GPUs.

tests/faults.py installs it when LEDGER names a directory: each process appends one JSON line per collective to
LEDGER/rank-<RANK>.jsonl as it issues it (so a rank that exits or is killed keeps what it issued), with its kind, its
group, the group's timeout, the devices, shapes and dtypes of its tensors, and the code that called it. The
training device is recorded as the scripts choose it (alpaca.strategy.choose_strategy), and where the sample
answers start (alpaca.generation.sample_answers); `check` reads the files. On CPU processes every tensor is on the
CPU, so the device rule cannot fail there: it holds the code to NCCL's rule on GPUs (benchmarks/gpu_check.sh).
Only Python-level calls are seen (torch.distributed's functions, which DeepSpeed, FSDP2 and transformers call); DDP's
reducer calls the process group from C++.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
               "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object",
               "scatter_object_list", "send", "recv", "isend", "irecv", "new_group")
# Entries that are not collectives: the training device, as the scripts choose it, and where the sample answers start
TRAINING_DEVICE, SAMPLE_ANSWERS = "training device", "sample answers"
# The frames a call's site skips: torch's, DeepSpeed's wrappers of torch's collectives, and this file's.
OUTSIDE = (f"{os.sep}torch{os.sep}", f"deepspeed{os.sep}comm{os.sep}", f"deepspeed{os.sep}utils{os.sep}nvtx.py",
           f"{os.sep}collective_ledger.py")


class Ledger:
    """Records each collective of torch.distributed this process issues (not those a recorded one issues inside)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.file = open(directory / f"rank-{os.environ.get('RANK', '0')}.jsonl", "a")  # noqa: SIM115 - the process's
        self.inside = threading.local()
        self.host_groups: set[str] = set()  # the groups created for host tensors (backend="gloo" asked for)

    def install(self) -> None:
        for name in COLLECTIVES:
            original = getattr(distributed_c10d, name)
            recorded = self.recording(name, original)
            setattr(distributed_c10d, name, recorded)  # what torch.distributed's own functions call
            setattr(dist, name, recorded)
        import alpaca.generation
        import alpaca.strategy

        choose_strategy, sample_answers = alpaca.strategy.choose_strategy, alpaca.generation.sample_answers

        def recorded_choice(*args, **kwargs):
            strategy = choose_strategy(*args, **kwargs)
            self.write({"kind": TRAINING_DEVICE, "device": str(strategy.device)})
            return strategy

        def recorded_answers(*args, **kwargs):
            self.write({"kind": SAMPLE_ANSWERS})
            return sample_answers(*args, **kwargs)

        alpaca.strategy.choose_strategy, alpaca.generation.sample_answers = recorded_choice, recorded_answers

    def recording(self, name: str, original):
        @functools.wraps(original)
        def recorded(*args, **kwargs):
            if getattr(self.inside, "depth", 0):
                return original(*args, **kwargs)
            self.inside.depth = 1
            try:
                result = original(*args, **kwargs)
                if name == "new_group":
                    if kwargs.get("backend") == "gloo":
                        self.host_groups.add(result.group_name)
                    self.write({"kind": name, **group_fields(result, self.host_groups), "site": caller()})
                else:
                    self.write(entry(name, args, kwargs, self.host_groups))
                return result
            finally:
                self.inside.depth = 0
        return recorded

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def entry(name: str, args: tuple, kwargs: dict, host_groups: set[str]) -> dict:
    """What a call of collective `name` is recorded as."""
    tensors = [value for value in [*args, *kwargs.values()] for value in (value if isinstance(value, list | tuple)
                                                                          else [value])
               if isinstance(value, torch.Tensor)]
    group = kwargs.get("group", next((arg for arg in args if isinstance(arg, dist.ProcessGroup)), None))
    return {"kind": name, **group_fields(group, host_groups), "devices": [str(t.device) for t in tensors],
            "shapes": [list(t.shape) for t in tensors], "dtypes": [str(t.dtype) for t in tensors], "site": caller()}


def group_fields(group, host_groups: set[str]) -> dict:
    """The group a collective runs on (`default`: the process group the script initialized), whether it carries
    host tensors, and its timeout in seconds."""
    group = group if group is not None else distributed_c10d._get_default_group()
    name = "default" if group is distributed_c10d._get_default_group() else group.group_name
    backend = dist.get_backend(group)
    timeout = group._get_backend(torch.device("cuda" if backend == "nccl" else "cpu")).options._timeout
    return {"group": name, "host": name in host_groups, "timeout_s": timeout.total_seconds()}


def caller() -> str:
    """The innermost frame outside torch that led to the call: `file:function`, the file as `package/module.py`."""
    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename for part in OUTSIDE):
            return f"{'/'.join(Path(frame.filename).parts[-2:])}:{frame.name}"
    return "?"


def install_from_environment() -> None:
    if os.environ.get("LEDGER"):
        Ledger(Path(os.environ["LEDGER"])).install()


def read(directory: Path) -> dict[int, list[dict]]:
    return {int(path.stem.split("-")[1]): [json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted(directory.glob("rank-*.jsonl"))}


def signature(record: dict) -> tuple:
    """What every rank's call must share: the collective, its group, the code that issued it, its tensors' shapes and
    dtypes (not their devices: each rank has its own GPU)."""
    return (record["kind"], record["group"], record["site"], str(record.get("shapes")), str(record.get("dtypes")))


def collectives(records: list[dict]) -> list[dict]:
    return [record for record in records if record["kind"] not in (TRAINING_DEVICE, SAMPLE_ANSWERS)]


def check(directory: Path, world_size: int, timeout_s: float | None = None,
          device: str | None = None) -> dict[int, list[dict]]:
    """Assert the ledger of a job of `world_size` processes: every rank issued the same collectives in the same order;
    each tensor given to a group of the training backend was on its rank's training device (`device` where the
    script chooses no strategy: examples/generate.py), and each given to a host group on the CPU; with
    `timeout_s`, every group waits that long. Returns the ledger."""
    ledgers = read(directory)
    assert sorted(ledgers) == list(range(world_size)), f"ledgers of ranks {sorted(ledgers)}"
    calls = {rank: collectives(records) for rank, records in ledgers.items()}
    for rank, records in calls.items():
        for index, (first, other) in enumerate(zip(calls[0], records)):
            assert signature(first) == signature(other), (
                f"collective {index}: rank 0 issued {signature(first)}, rank {rank} {signature(other)}")
        assert len(records) == len(calls[0]), (
            f"rank 0 issued {len(calls[0])} collectives, rank {rank} {len(records)}; the first one apart: "
            f"{(calls[0] + records)[min(len(records), len(calls[0]))]}")
    for rank, records in ledgers.items():
        training_device = device
        for record in records:
            if record["kind"] == TRAINING_DEVICE:
                training_device = record["device"]
            if record["kind"] in (TRAINING_DEVICE, SAMPLE_ANSWERS):
                continue
            expected = "cpu" if record["host"] else training_device
            strays = [found for found in record.get("devices", []) if found != expected]
            assert expected is not None or not record.get("devices"), f"rank {rank}: {record} before a device"
            assert not strays, f"rank {rank}: {record['kind']} from {record['site']} on {strays}, not {expected}"
            if timeout_s is not None:
                assert record["timeout_s"] == timeout_s, f"rank {rank}: {record} waits {record['timeout_s']} s"
    return ledgers
