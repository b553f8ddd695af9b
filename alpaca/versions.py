"""The torch these scripts are tested with, checked before anything heavy is imported: standard library only."""

from __future__ import annotations

import re
from importlib.metadata import version

from alpaca.errors import UsageError

# requirements.txt pins the newest; the oldest is what GPU images ship (NGC's and cloud images' torch), run on an
# H200 by benchmarks/gpu_check.sh.
OLDEST_TESTED_TORCH = (2, 11)
NEWEST_TESTED_TORCH = (2, 13)


def torch_version() -> tuple[int, int]:
    """Return the installed torch's major and minor version, read without importing torch."""
    return tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", version("torch")).groups())


def check_torch(shards_4bit: bool = False) -> None:
    """Refuse, in one line before any weight loads, a torch older than the oldest tested, naming the range: older ones
    differ in what the scripts call (torch 2.10's varlen_attn takes no scale: a TypeError at the first step). With
    `shards_4bit` (--fsdp --load_in_4bit) refuse torch 2.11 too, whose FSDP2 cannot shard a 4-bit base's packed
    (uint8) bytes: it makes each shard a parameter that requires a gradient, which an integer tensor cannot (a
    RuntimeError), and its GPU mixed-precision policy casts them to bf16 (a wrong forward, silently); torch 2.12
    leaves integer shards alone."""
    installed = version("torch")
    if torch_version() < OLDEST_TESTED_TORCH:
        oldest, newest = (".".join(map(str, v)) for v in (OLDEST_TESTED_TORCH, NEWEST_TESTED_TORCH))
        raise UsageError(f"torch {installed} is older than {oldest}, the oldest these scripts are tested with "
                         f"({oldest} to {newest}); pip install 'torch>={oldest}'")
    if shards_4bit and torch_version() < (2, 12):
        raise UsageError(f"--fsdp --load_in_4bit needs torch 2.12 or newer (torch {installed}'s FSDP2 handles the "
                         "packed 4-bit bytes as floating-point weights); pip install 'torch>=2.12', or drop --fsdp: "
                         "DDP holds the whole 4-bit base on each GPU")
