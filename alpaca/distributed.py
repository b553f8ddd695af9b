"""The process group's life, and small collectives that keep every rank in step when one of them fails."""

from __future__ import annotations

import contextlib
import datetime
import gc
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist

from alpaca.errors import UsageError

T = TypeVar("T")
OK, FAILED = 0, 1


@contextlib.contextmanager
def process_group(backend: str, timeout_s: float, device: torch.device) -> Iterator[None]:
    """The default process group for the block: created, then destroyed however the block ends.

    destroy_process_group frees the group only once nothing else holds it, and a group that survives it
    keeps gloo's threads running into interpreter exit, where they can abort a process that has finished
    ("terminate called without an active exception"). So what holds it is released first.
    """
    # Its functions' default `group=group.WORLD` is the group itself when imported while one exists
    # (transformers and FSDP import it): import it before.
    import torch.distributed.nn  # noqa: F401
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    try:
        yield
    except BaseException as error:  # a stop signal or an error: its traceback keeps the block's locals (DDP)
        traceback.clear_frames(error.__traceback__)
        raise
    finally:
        _clear_sharding_prop_cache()  # DTensor's caches keep FSDP's device mesh, which keeps the group
        gc.collect()  # the block's objects in reference cycles
        dist.destroy_process_group()
        gc.collect()  # in ~1 FSDP run of 14 on CPU, the sharded modules became collectable only here


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
    status = OK if error is None else error.exit_code if isinstance(error, UsageError) else FAILED
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


def shard_base_model(model, device: torch.device, offload: bool = False) -> None:
    """FSDP2 over the frozen base: each decoder layer is a unit, all-gathered just before it runs and freed
    after; so are untied input embeddings and LM head, the largest units of a small model. The root unit
    holds the rest (final norm; tied embeddings, one parameter, gathered for the whole forward and
    backward). Build the ReFT model first: pyvene finds its hook points by the model's class, which
    `fully_shard` replaces.

    The interventions are not sharded: a few thousand parameters, replicated, whose gradients
    `average_gradients` all-reduces once per step. The base is frozen, so FSDP never reduces gradients.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from alpaca.model import decoder_layers
    from alpaca.sharding import return_freed_buffers_to_the_os

    options = {}
    if device.type == "cpu":
        return_freed_buffers_to_the_os()
    if device.type == "cuda":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=model.dtype, reduce_dtype=torch.float32)
        if offload:
            options["offload_policy"] = CPUOffloadPolicy()
    elif offload:
        raise UsageError("--fsdp offload keeps the shards in CPU memory for GPUs; on CPUs drop 'offload'")
    units = decoder_layers(model)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is not embeddings.weight:
        units = [embeddings, *units, head]
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)


def local_parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds: its shards of sharded parameters (FSDP's DTensors, ZeRO-3's
    partitions), the rest whole."""
    from torch.distributed.tensor import DTensor

    def held(parameter: torch.Tensor) -> int:
        if isinstance(parameter, DTensor):
            return parameter.to_local().nbytes
        # ZeRO-3: the partition, plus the whole tensor while it is gathered (between forwards, only small
        # parameters below stage3_param_persistence_threshold stay whole)
        return parameter.nbytes + (parameter.ds_tensor.nbytes if hasattr(parameter, "ds_tensor") else 0)

    return sum(held(parameter) for parameter in module.parameters())


def broadcast_from_rank_zero(tensors: list[torch.Tensor]) -> None:
    """What DDP does at construction, for modules outside DDP: every rank starts from rank 0's values.
    NCCL sends contiguous tensors only (the orthogonal parametrization's are not)."""
    for tensor in tensors:
        sent = tensor.data.contiguous()
        dist.broadcast(sent, src=0)
        if sent is not tensor.data:
            tensor.data.copy_(sent)


def no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's option not to re-broadcast buffers before every forward: `forward_sync_buffers` since torch
    2.13, `broadcast_buffers` (deprecated there) before."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    new_name = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    return {"forward_sync_buffers" if new_name else "broadcast_buffers": False}


def average_gradients(parameters: list[torch.Tensor], world_size: int) -> None:
    """DDP's gradient averaging, in one flat all-reduce, for replicated parameters outside DDP."""
    grads = [p.grad for p in parameters]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= world_size
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)
