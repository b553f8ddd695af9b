"""Letting go of the process group before it is destroyed, and small collectives that keep every rank in step
when one of them fails."""

from __future__ import annotations

import gc
import os
import resource
import sys
import traceback
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

# Its functions' default `group=group.WORLD` is the group itself when imported while one exists (transformers and
# FSDP import it): imported here, before any process group exists.
import torch.distributed.nn  # noqa: F401
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from alpaca.errors import UsageError

T = TypeVar("T")
OK, FAILED = 0, 1


def let_go_of_process_group() -> None:
    """Let go of what still holds the process group: called in the `finally` around everything that uses the
    group, right before destroy_process_group (after which a gc.collect() frees FSDP's sharded modules, which can
    become collectable only once the group is gone).

    destroy_process_group frees the group only once nothing else holds it, and a group that survives it keeps
    gloo's threads running into interpreter exit, where they can abort a process that has finished ("terminate
    called without an active exception").
    """
    ending = sys.exc_info()[1]  # in a `finally`: the stop signal or error that ends the block, if one does
    if ending is not None:  # its traceback keeps the block's locals (DDP)
        traceback.clear_frames(ending.__traceback__)
    _clear_sharding_prop_cache()  # DTensor's caches keep FSDP's device mesh, which keeps the group
    gc.collect()  # the block's objects in reference cycles


def bound_device(gpus: list[int]) -> torch.device | None:
    """Return the GPU to bind the process group to (init_process_group's `device_id`): the rank's one GPU. A rank
    spanning several (DDP over a device map) is bound to none: NCCL takes only tensors on the bound GPU, and DDP
    broadcasts and reduces each parameter on its own GPU (an intervention on the group's second one)."""
    return torch.device("cuda", gpus[0]) if len(gpus) == 1 else None


def agree(status: int, device: torch.device) -> int:
    """All-reduce a status code by MAX: every rank learns whether any rank failed (and acts as a barrier)."""
    code = torch.tensor([status], dtype=torch.int32, device=device)
    dist.all_reduce(code, op=dist.ReduceOp.MAX)
    return int(code.item())


def run_checked(fn: Callable[[], T], device: torch.device, participate: bool = True) -> T | None:
    """Run `fn` on the participating ranks (all by default), then tell every rank whether it worked.

    A failure is raised on the rank where it happened; the other ranks leave quietly with the same exit
    code instead of waiting at the next collective until the timeout.
    """
    result, error = None, None
    if participate:
        try:
            result = fn()
        except (Exception, SystemExit) as caught:  # noqa: BLE001 - re-raised below, after telling the others
            error = caught
    status = OK if error is None else error.exit_code if isinstance(error, UsageError) else FAILED
    agreed = agree(status, device)
    if error is not None:
        raise error
    if agreed != OK:
        sys.exit(agreed)
    return result


def main_rank_result(fn: Callable[[], T], device: torch.device) -> T:
    """Run `fn` on rank 0 alone (it owns the output directory), its result sent to every rank: other nodes need
    not see rank 0's disk. A failure stops every rank at once."""
    result = [run_checked(fn, participate=dist.get_rank() == 0, device=device)]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def first_on_local_main(fn: Callable[[], T], device: torch.device) -> T:
    """Run `fn` on each node's local rank 0 first (it fills a cache: model conversion, tokenization), then on
    the others, which find the cache. A failure on the first ones stops every rank at once."""
    local_main = os.environ["LOCAL_RANK"] == "0"
    result = run_checked(fn, participate=local_main, device=device)
    return result if local_main else fn()


def gather_rank_report(tokens_per_s: float, base_bytes: int, device) -> str:
    """Gather the tokens/s, peak memory and base parameter bytes of every rank, on every rank (a collective)."""
    peak_memory = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                   else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    per_rank = torch.tensor([tokens_per_s, peak_memory, base_bytes], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(per_rank) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, per_rank)
    rates = ", ".join(f"rank {r}: {t:.0f} tok/s, peak {m / 2**30:.2f} GiB, base {b / 2**20:.1f} MiB"
                      for r, (t, m, b) in enumerate(row.tolist() for row in gathered))
    return f"{sum(row[0].item() for row in gathered):.0f} tokens/s in all ({rates})"
