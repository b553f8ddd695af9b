"""Starting the process group, letting go of it before it is destroyed, and small collectives that keep every
rank in step when one of them fails."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import resource
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

# Its functions' default `group=group.WORLD` is the group itself when imported while one exists (transformers and
# FSDP import it): imported here, before any process group exists.
import torch.distributed.nn  # noqa: F401
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from alpaca.errors import JoinTimeout, UsageError

T = TypeVar("T")
OK, FAILED = 0, 1


def start_process_group(backend: str, timeout_s: int, device_id: torch.device | None) -> None:
    """Start the default process group of the launcher's world; a rank that waits longer than `timeout_s` for
    the others (--ddp_timeout) stops with one line saying what it waited for."""
    timeout = datetime.timedelta(seconds=timeout_s)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = attempt_store(rank, world_size, timeout) if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" \
        else None
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device_id)
    except dist.DistError as error:  # the store's waits (DistStoreError), its connections, gloo's and NCCL's
        raise JoinTimeout(f"rank {rank} waited --ddp_timeout {timeout_s}s for the {world_size} ranks to start the "
                          f"{backend} process group, which did not form ({first_line(error)}); a rank that "
                          "failed first said why above, and a slower start needs a larger --ddp_timeout") from None


def attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Return the store of this attempt's process group: hosted by rank 0, announced in torchrun's store.

    torchrun hosts one store for every attempt of a job (torch 2.13 shares its rendezvous store with the
    workers), and it keeps the keys of the attempt before: after a restart, ranks read the addresses of dead
    ranks there and fail to connect, or wait for them (pytorch/pytorch#135712, #167288). A store of rank 0's
    lives as long as its attempt; an announcement left by an attempt before names a port where nothing listens
    any more, and is read again until rank 0 of this attempt has announced its own."""
    agent_host, agent_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = dist.TCPStore(agent_host, agent_port, is_master=False, timeout=timeout)
    key, deadline = "alpaca/process_group_store", time.monotonic() + timeout.total_seconds()
    if rank == 0:
        # torchrun's store stays where rank 0 was in the first rendezvous: a later one may put rank 0 elsewhere
        host = address_towards(agent_host, agent_port)
        store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        agent_store.set(key, f"{store.port} {host}")
        return store
    while time.monotonic() < deadline:
        agent_store.set_timeout(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
        with contextlib.suppress(dist.DistStoreError):  # the wait for the key timed out
            port, host = agent_store.get(key).decode().split(" ", 1)
            if is_listening(host, int(port)):
                return dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
            time.sleep(0.1)
    raise JoinTimeout(f"rank {rank} waited --ddp_timeout {timeout.total_seconds():.0f}s for rank 0 to start the "
                      "process group's store; rank 0 did not start (its lines say why), or needs a larger "
                      "--ddp_timeout")


def address_towards(host: str, port: int) -> str:
    """This machine's address on its route to host:port, where the other ranks reach it (no packet is sent)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def is_listening(host: str, port: int) -> bool:
    """Tell whether a process listens at host:port (probed with a plain socket: a refused TCPStore connection
    logs a C++ stack trace for each retry)."""
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


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
