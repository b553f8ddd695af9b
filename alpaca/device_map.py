"""--device_map: one process's base model spread over its GPUs, the CPU and disk, placed by transformers (accelerate's
`dispatch_model`), as `from_pretrained(device_map=...)` places it for any HF user. On CPU and disk the weights wait
(on the meta device for disk) and accelerate's hooks bring each module's weights to its execution device for its
forward. Under torchrun each rank owns a group of the node's GPUs (`gpu_group`) and the map applies within it: its
GPU indices (and --max_memory's) count from the group's first GPU.

What we add to transformers' placement: the map is checked against the model before any weight is read (one line
for a mistake), each intervention goes where its layer's output is, pyvene's index tensors are built on each
activation's device, and the logits stay where the head computed them (the loss is computed there).
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate.utils import get_max_memory

from alpaca.errors import UsageError
from alpaca.sharding import empty_base_model
from alpaca.signals import wait_for_launcher
from alpaca.workarounds import index_tensors_on, pyvene


def one_process_gpus(device_map: bool) -> list[int]:
    """Pick train.py's GPUs: cuda:0, or with a `device_map` every visible GPU. Never nn.DataParallel: it copies
    pyvene's location lists whole to every GPU. GPUs left idle are named, with the way to use them."""
    count = torch.cuda.device_count()
    gpus = list(range(count)) if device_map else [0]
    if count > len(gpus):
        print(f"{count} GPUs visible; train.py uses cuda:0. To train on all of them: torchrun --nproc_per_node "
              f"{count} train_multigpu.py <same flags>, or --device_map auto for a model one GPU cannot hold")
    return gpus


def local_rank_gpus(prog: str, device_map: bool) -> list[int]:
    """Pick this process's GPUs under a launcher: the one of its local rank, or with a `device_map` its equal group of
    the node's GPUs (`gpu_group`). Local ranks, not global ones: each node counts from 0.

    Where the node has too few GPUs, or they do not divide among its processes, every rank of the node sees it
    and stops; local rank 0 says why. The others wait for the launcher to stop them, since one leaving first
    could get rank 0 stopped before it has printed. A launcher without LOCAL_WORLD_SIZE leaves each rank to
    judge (and report) itself."""
    local_rank, count = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    problem = None
    if processes > count:
        problem = f"{processes} processes on this node but {count} GPU(s) visible; launch with --nproc_per_node {count}"
    elif device_map and count % processes:
        divisors = ", ".join(str(n) for n in range(1, count + 1) if count % n == 0)
        problem = (f"--device_map gives each process an equal group of the node's GPUs, but {count} GPUs do not "
                   f"divide among {processes} processes; launch with --nproc_per_node one of {divisors}")
    if problem:
        reports = local_rank == 0 or "LOCAL_WORLD_SIZE" not in os.environ
        if not reports:
            wait_for_launcher()
        sys.exit(f"{prog}: error: {problem}" if reports else 2)
    return gpu_group(local_rank, processes, count) if device_map else [local_rank]


def gpu_group(local_rank: int, processes: int, gpus: int) -> list[int]:
    """Return the GPUs of a node's process `local_rank` when its `gpus` are split evenly among `processes` (they
    divide: local_rank_gpus checks)."""
    size = gpus // processes
    return list(range(local_rank * size, (local_rank + 1) * size))


class DeviceMap:
    """A --device_map (a strategy name or {module name: GPU index within `gpus`, 'cpu' or 'disk'}) with its
    --max_memory and --offload_folder, over this process's GPUs `gpus` (node indices)."""

    def __init__(self, device_map: str | dict, max_memory: dict | None, offload_folder: str | None,
                 gpus: list[int]) -> None:
        self.device_map, self.max_memory, self.offload_folder, self.gpus = device_map, max_memory, offload_folder, gpus

    def on_node(self, device: int | str, flag: str) -> int | str:
        """Return a device of the flags ('cpu', 'disk', or a GPU index within this process's group) as transformers
        names it (the node's GPU index)."""
        if isinstance(device, str):
            return device
        if device >= len(self.gpus):
            there = f"GPUs 0..{len(self.gpus) - 1}" if self.gpus else "no GPU"
            raise UsageError(f"{flag}: GPU {device} is not there: this process has {there} (and 'cpu', 'disk'); "
                             "name a device it has")
        return self.gpus[device]

    def from_pretrained_kwargs(self, model_path: str, dtype: torch.dtype, cache_dir: str | None,
                               model: torch.nn.Module | None = None) -> dict:
        """Return what `from_pretrained` is given to place the model: a JSON map is checked first against the model
        (`model`, or one built on the meta device: no weight read); a named strategy gets the memory of this process's
        devices only."""
        kwargs = {"offload_folder": self.offload_folder}
        if isinstance(self.device_map, dict):
            check_covers(self.device_map, model or empty_base_model(model_path, dtype, cache_dir))
            kwargs["device_map"] = {name: self.on_node(device, "--device_map")
                                    for name, device in self.device_map.items()}
            return kwargs
        kwargs["device_map"] = self.device_map
        if self.max_memory is not None:
            kwargs["max_memory"] = {self.on_node(device, "--max_memory"): size
                                    for device, size in self.max_memory.items()}
        elif torch.cuda.is_available():
            free = get_max_memory()  # every visible GPU's and the CPU's: keep this process's GPUs
            kwargs["max_memory"] = {device: size for device, size in free.items()
                                    if device in self.gpus or not isinstance(device, int)}
        return kwargs

    def place(self, reft_model) -> None:
        """Place each intervention on its layer's output device (it runs there, in pyvene's hook), pyvene's index
        tensors on each activation's, and leave the logits on the head's device: the batch's labels go to them,
        not they (batch x positions x vocabulary) to the embeddings' device, where accelerate's root hook would
        move every output."""
        model = reft_model.model
        for key, intervention in reft_model.interventions.items():
            intervention.to(execution_device(model, hooked_module_name(reft_model, key)))
        index_tensors_on(reft_model, None)
        root_hook = getattr(model, "_hf_hook", None)
        if root_hook is not None:
            root_hook.io_same_device = False

    def describe(self, model) -> str:
        """Describe where the base's modules are, e.g. 'cpu: 9 modules, disk: 2 modules'."""
        # transformers dispatches (and records hf_device_map) only a model it spreads over several devices
        placed = list(getattr(model, "hf_device_map", {"": model.device}).values())
        devices = sorted({str(device) for device in placed})
        return ", ".join(f"{device}: {sum(str(d) == device for d in placed)} modules" for device in devices)


def check_covers(device_map: dict, model: torch.nn.Module) -> None:
    """Check that every name of a JSON map is a module or tensor of the model, and every tensor of its state dict (a
    tied LM head's too, as accelerate checks) and every buffer is placed by one: accelerate would silently skip an
    unknown name, and leave an unplaced buffer (rotary tables) where it was built."""
    tensors = list(dict.fromkeys([*model.state_dict(keep_vars=True), *(name for name, _ in model.named_buffers())]))
    known = {name for name, _ in model.named_modules()} | set(tensors)
    unknown = [name for name in device_map if name not in known]
    if unknown:
        raise UsageError(f"--device_map names {unknown[0]!r}, which is not a module of {type(model).__name__}; use "
                         f"its modules' names, e.g. {', '.join(repr(name) for name, _ in model.named_children())}")
    unplaced = [name for name in tensors
                if "" not in device_map and not any(name == key or name.startswith(key + ".") for key in device_map)]
    if unplaced:
        more = f" and {len(unplaced) - 1} more" if len(unplaced) > 1 else ""
        raise UsageError(f"--device_map leaves {unplaced[0]!r}{more} unplaced; give it (or a module holding it) a "
                         "device")


def hooked_module_name(reft_model, key: str) -> str:
    """Return the dotted name of the module whose output the intervention `key` acts on, from pyvene's table
    ('model.layers[%s]' -> 'model.layers.3')."""
    representation = reft_model.representations[key]
    path = pyvene.type_to_module_mapping[type(reft_model.model)][representation.component][0]
    return (path % representation.layer).replace("[", ".").replace("]", "")


def execution_device(model, name: str) -> torch.device:
    """Find where the module `name` runs (and leaves its output): its accelerate hook's execution device, or the nearest
    enclosing module's; without hooks (the whole model on one device), where its parameters are."""
    parts = name.split(".") if name else []
    for end in range(len(parts), -1, -1):
        hook = getattr(model.get_submodule(".".join(parts[:end])), "_hf_hook", None)
        for single in getattr(hook, "hooks", [hook]):  # a SequentialHook holds several
            device = getattr(single, "execution_device", None)
            if device is not None:
                return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    return next(model.get_submodule(name).parameters()).device


def input_device(model) -> torch.device:
    """Find where a batch enters the base model: where its input embeddings run."""
    embeddings = model.get_input_embeddings()
    name = next(name for name, module in model.named_modules() if module is embeddings)
    return execution_device(model, name)
