"""One flag's value: parsed from its string (--position, --layers, --field_map, --device_map, --max_memory,
booleans), and which flag shards the base. Standard library only."""

from __future__ import annotations

import argparse
import json
import re

from alpaca.constants import DEVICE_MAP_STRATEGIES, RECORD_FIELDS
from alpaca.errors import UsageError

# What a device of a JSON --device_map or --max_memory may be (whether it is there is checked once torch is loaded).
_DEVICE = re.compile(r"^(?:\d+|cuda:\d+|cpu|disk)$")
_SIZE = re.compile(r"^\d+(?:\.\d+)?\s*[KMGT]i?B$")  # what accelerate's convert_file_size_to_int reads

_POSITION = re.compile(r"^(?:f(?P<f>[1-9]\d*)|l(?P<l>[1-9]\d*)|f(?P<both_f>[1-9]\d*)\+l(?P<both_l>[1-9]\d*))$")


def parse_field_map(value: str) -> dict[str, str]:
    """Parse a field map: 'question=instruction,answer=output' -> {'question': 'instruction', 'answer': 'output'}."""
    mapping = {}
    for pair in filter(None, value.split(",")):
        source, _, target = pair.partition("=")
        if not source.strip() or target.strip() not in RECORD_FIELDS:
            raise argparse.ArgumentTypeError(f"expected FIELD=TARGET pairs, TARGET one of {', '.join(RECORD_FIELDS)} "
                                             f"(e.g. question=instruction,answer=output), got {value!r}")
        mapping[source.strip()] = target.strip()
    return mapping


def parse_device(value, flag: str) -> int | str:
    """Parse a GPU index (an int, '3' or 'cuda:3'), 'cpu' or 'disk', as transformers reads a device map's values."""
    text = str(value)
    if isinstance(value, bool) or not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"{flag}: device {value!r} is not a GPU index, 'cuda:N', 'cpu' or 'disk'")
    return int(text.removeprefix("cuda:")) if text[-1].isdigit() else text


def parse_json_object(value: str, flag: str, example: str) -> dict:
    try:
        mapping = json.loads(value)
    except json.JSONDecodeError:
        mapping = None
    if not isinstance(mapping, dict) or not mapping:
        raise argparse.ArgumentTypeError(f"{flag} {value!r} is neither one of {', '.join(DEVICE_MAP_STRATEGIES)} "
                                         f"nor a JSON object, e.g. '{example}'" if flag == "--device_map" else
                                         f"{flag} {value!r} is not a JSON object, e.g. '{example}'")
    return mapping


def parse_device_map(value: str) -> str | dict[str, int | str]:
    """Parse --device_map: 'auto' (or another of DEVICE_MAP_STRATEGIES), or a JSON object of module name -> device."""
    if value in DEVICE_MAP_STRATEGIES:
        return value
    mapping = parse_json_object(value, "--device_map", '{"model.embed_tokens": 0, "model.layers.0": "disk", ...}')
    return {name: parse_device(device, "--device_map") for name, device in mapping.items()}


def parse_max_memory(value: str) -> dict[int | str, int | str]:
    """Parse a JSON object of device -> bytes (an int) or a size ('20GiB', '500MB'), accelerate's max_memory."""
    mapping = parse_json_object(value, "--max_memory", '{"0": "20GiB", "cpu": "64GiB"}')
    memory = {}
    for device, size in mapping.items():
        if not (isinstance(size, int) and size >= 0 or isinstance(size, str) and _SIZE.match(size)):
            raise argparse.ArgumentTypeError(f"--max_memory: {size!r} for {device!r} is not a size; use bytes or "
                                             "e.g. '20GiB'")
        memory[parse_device(device, "--max_memory")] = size
    return memory


def str2bool(value: str) -> bool:
    """Parse HF-style booleans: `--flag`, `--flag True`, `--flag false`, `--flag 1`."""
    if value.lower() in ("true", "1", "yes", "y"):
        return True
    if value.lower() in ("false", "0", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {value!r}")


def parse_position(position: str) -> tuple[int, int]:
    """Parse --position: `f<n>`, `l<n>` or `f<n>+l<n>` -> (first_n, last_n)."""
    match = _POSITION.match(position.strip())
    if not match:
        raise UsageError(
            f"--position {position!r} is malformed; use f<n>, l<n> or f<n>+l<n> with n >= 1, e.g. 'f1+l1'"
        )
    return int(match["f"] or match["both_f"] or 0), int(match["l"] or match["both_l"] or 0)


def parse_layers(layers: str, num_hidden_layers: int | None = None) -> list[int]:
    """Parse --layers: `"8;19"` or `"all"` -> layer indices; validated against the model's depth when it is known."""
    if layers.strip() == "all":
        if num_hidden_layers is None:
            return []
        return list(range(num_hidden_layers))
    try:
        parsed = [int(part) for part in layers.split(";") if part.strip()]
    except ValueError:
        raise UsageError(
            f"--layers {layers!r} is malformed; use integers separated by ';' (e.g. '8;19') or 'all'"
        ) from None
    if not parsed:
        raise UsageError(f"--layers {layers!r} names no layer; use e.g. '8;19' or 'all'")
    if len(set(parsed)) != len(parsed):
        raise UsageError(f"--layers {layers!r} repeats a layer; name each layer once")
    if num_hidden_layers is not None:
        bad = [layer for layer in parsed if not 0 <= layer < num_hidden_layers]
        if bad:
            raise UsageError(
                f"--layers {layers!r}: layer {bad[0]} is out of range, the model has {num_hidden_layers} "
                f"layers (0..{num_hidden_layers - 1})"
            )
    return parsed


# Not a flag's value, but read by both alpaca.args and alpaca.launcher_env: here, below both, no import circle.
def sharding_flag(args: argparse.Namespace) -> str | None:
    """Return the flag that shards the base, if one does (train.py has neither)."""
    return "--fsdp" if getattr(args, "fsdp", "") else "--deepspeed" if getattr(args, "deepspeed", None) else None


_PLAN = re.compile(r"^(?:(\d+)x)?(\d+)x(\d+(?:\.\d+)?)\s*([KMGT])(i?)B$", re.IGNORECASE)
_UNITS = {"K": 1, "M": 2, "G": 3, "T": 4}


def parse_plan(value: str) -> tuple[int, int, int]:
    """Parse --plan [NODESx]GPUSxMEMORY, e.g. '8x80GB' or '2x8x80GiB' -> (nodes, GPUs per node, bytes per GPU);
    GB are 10^9 bytes and GiB 2^30, as accelerate reads sizes."""
    match = _PLAN.match(value.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"--plan {value!r}: expected [NODESx]GPUSxMEMORY, e.g. 8x80GB or 2x8x40GiB")
    nodes, gpus, amount, unit, binary = match.groups()
    nodes, gpus = int(nodes or 1), int(gpus)
    if nodes < 1 or gpus < 1:
        raise argparse.ArgumentTypeError(f"--plan {value!r}: a world needs at least 1 node and 1 GPU a node")
    gpu_bytes = int(float(amount) * (1024 if binary else 1000) ** _UNITS[unit.upper()])
    if gpu_bytes <= 0:
        raise argparse.ArgumentTypeError(f"--plan {value!r}: the GPU memory must be positive")
    return nodes, gpus, gpu_bytes
