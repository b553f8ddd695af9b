"""Small collectives that keep every rank in step when one of them fails."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from alpaca.args import UsageError

T = TypeVar("T")
OK, FAILED, USAGE_ERROR = 0, 1, 2


def agree(status: int, device: torch.device) -> int:
    """All-reduce MAX of a status code: every rank learns whether any rank failed (and acts as a barrier)."""
    code = torch.tensor([status], dtype=torch.int32, device=device)
    dist.all_reduce(code, op=dist.ReduceOp.MAX)
    return int(code.item())


def run_checked(fn: Callable[[], T], participate: bool, device: torch.device) -> T | None:
    """Run `fn` on the participating ranks, then tell every rank whether it worked.

    A failure is raised on the rank where it happened; the other ranks leave quietly with the same exit
    code instead of waiting at the next collective until the timeout.
    """
    result, error = None, None
    if participate:
        try:
            result = fn()
        except (Exception, SystemExit) as caught:  # noqa: BLE001 - re-raised below, after telling the others
            error = caught
    status = OK if error is None else USAGE_ERROR if isinstance(error, UsageError) else FAILED
    agreed = agree(status, device)
    if error is not None:
        raise error
    if agreed != OK:
        sys.exit(agreed)
    return result


def first_on_local_main(fn: Callable[[], T], local_rank: int, device: torch.device) -> T:
    """`fn` on each node's local rank 0 first (it fills a cache: model conversion, tokenization), then on
    the others, which find the cache. A failure on the first ones stops every rank at once."""
    result = run_checked(fn, participate=local_rank == 0, device=device)
    return result if local_rank == 0 else fn()
