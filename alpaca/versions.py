"""The torch these scripts are tested with, checked before anything heavy is imported: standard library only."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

from alpaca.errors import UsageError

# requirements.txt pins the newest; the oldest is what GPU images ship (NGC's and cloud images' torch), run on an
# H200 by benchmarks/gpu_check.sh.
OLDEST_TESTED_TORCH = (2, 11)
NEWEST_TESTED_TORCH = (2, 13)


def installed_torch() -> tuple[str, tuple[int, int]] | None:
    """Return the installed torch's version and its major and minor numbers, read without importing torch; None where
    its package metadata says none (a source build, a vendored copy): such a torch is not checked."""
    try:
        installed = version("torch")
    except PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)", installed)
    return (installed, (int(match[1]), int(match[2]))) if match else None


def check_torch(shards_4bit: bool = False) -> None:
    """Refuse, in one line before any weight loads, a torch older than the oldest tested, naming the range: older ones
    differ in what the scripts call (torch 2.10's varlen_attn takes no scale: a TypeError at the first step). With
    `shards_4bit` (--fsdp --load_in_4bit) refuse torch 2.11 too, whose FSDP2 cannot shard a 4-bit base's packed
    (uint8) bytes: it makes each shard a parameter that requires a gradient, which an integer tensor cannot (a
    RuntimeError), and its GPU mixed-precision policy casts them to bf16 (a wrong forward, silently, on an H200);
    torch 2.12's source leaves integer shards alone (2.13, the pin, runs the tests)."""
    found = installed_torch()
    if found is None:
        return
    installed, major_minor = found
    if major_minor < OLDEST_TESTED_TORCH:
        oldest, newest = (".".join(map(str, v)) for v in (OLDEST_TESTED_TORCH, NEWEST_TESTED_TORCH))
        raise UsageError(f"torch {installed} is older than {oldest}, the oldest these scripts are tested with "
                         f"({oldest} to {newest}); pip install 'torch>={oldest}'")
    if shards_4bit and major_minor < (2, 12):
        raise UsageError(f"--fsdp --load_in_4bit needs torch 2.12 or newer (torch {installed}'s FSDP2 handles the "
                         "packed 4-bit bytes as floating-point weights); pip install 'torch>=2.12', or drop --fsdp: "
                         "DDP holds the whole 4-bit base on each GPU")
