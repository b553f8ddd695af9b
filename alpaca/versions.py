"""The torch these scripts are tested with, checked before anything heavy is imported: standard library only."""

from __future__ import annotations

import re
from importlib.metadata import version

from alpaca.errors import UsageError

# requirements.txt pins the newest; the oldest is what GPU images ship (NGC's and cloud images' torch), run on an
# H200 by benchmarks/gpu_check.sh. Between them alpaca.workarounds bridges what changed (torch 2.11's varlen_attn
# and fully_shard).
OLDEST_TESTED_TORCH = (2, 11)
NEWEST_TESTED_TORCH = (2, 13)


def check_torch() -> None:
    """Refuse a torch older than the oldest tested, in one line naming the range, before any weight loads: older ones
    differ in what the scripts call (torch 2.10's varlen_attn takes no scale: a TypeError at the first step)."""
    installed = version("torch")
    major_minor = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", installed).groups())
    if major_minor < OLDEST_TESTED_TORCH:
        oldest, newest = (".".join(map(str, v)) for v in (OLDEST_TESTED_TORCH, NEWEST_TESTED_TORCH))
        raise UsageError(f"torch {installed} is older than {oldest}, the oldest these scripts are tested with "
                         f"({oldest} to {newest}); pip install 'torch>={oldest}'")
