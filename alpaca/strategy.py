"""How the scripts place and step the model, chosen once: on one process (train.py) the base on its device or spread
by `--device_map` (alpaca.device_map); on N (train_multigpu.py) DDP (the default, with or without a device map per
rank), FSDP (`--fsdp`: the frozen base sharded) or DeepSpeed ZeRO (`--deepspeed`, in alpaca.zero). The loop
calls the same methods whatever runs:

    model, tokenizer = strategy.load_base(model_path, dtype, cache_dir)
    train_model = strategy.wrap(reft_model, optimizer, scheduler, saved_optimizer_state)
    for micro_step, batch in ...:                       # plus strategy.placeholders(missing) zero-weight ones
        with strategy.micro_step(last=...):             # DDP: no_sync() but on the last micro-batch
            strategy.backward(loss)
    grad_norm = strategy.step(step + 1)                 # reduce, clip, step optimizer and schedule (not a NaN step)
    strategy.first_non_finite_step()                    # at logging and save points: the first non-finite step or None
    with strategy.gathered(): ...                       # ZeRO-3: the interventions whole on every rank
    strategy.optimizer_state()                          # torch's AdamW format, however it is partitioned
    strategy.owned(parameters)                          # the elements this rank counts in a sum over ranks

Only the interventions train (a few thousand parameters, replicated on every rank but under ZeRO-3); the
base is frozen: no strategy reduces or steps it. docs/multi-gpu.md has the table of what each one does.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from alpaca import zero
from alpaca.device_map import DeviceMap
from alpaca.errors import UsageError
from alpaca.layers import decoder_layers
from alpaca.model import intervention_parameters, load_base_model
from alpaca.optim import clip_and_step, non_finite
from alpaca.quantization_flags import quantization_settings
from alpaca.sharding import load_shards, return_freed_buffers_to_the_os
from alpaca.workarounds import index_tensors_on

NO_STEP = torch.iinfo(torch.int64).max  # no non-finite step yet: above every step, for an all-reduce MIN


class Strategy:
    """What every strategy shares, and train.py's: the base loaded whole on this process's device (or spread by a
    device map), torch's backward and AdamW."""

    layout = "replicated"  # the start line: how the base is held
    shards_base = False  # a sharded base answers only when every rank runs each forward (eval, sample answers)

    def __init__(self, device: torch.device, max_grad_norm: float, device_map: DeviceMap | None = None,
                 quantization: dict | None = None) -> None:
        self.device, self.max_grad_norm, self.device_map = device, max_grad_norm, device_map
        # bitsandbytes' (alpaca.quantization_flags.quantization_settings): each process its copy
        self.quantization = quantization

    def load_base(self, model_path: str, dtype: torch.dtype, cache_dir: str | None):
        model, tokenizer = load_base_model(model_path, dtype, self.device, cache_dir, device_map=self.device_map,
                                           quantization=self.quantization)
        self.note_placement(model)
        return model, tokenizer

    def note_placement(self, model) -> None:
        """Say in the layout (the start line's, the plan's) where a device map has put the base."""
        if self.device_map is not None:
            self.placed = f"--device_map ({self.device_map.describe(model)})"
            self.layout = f"{self.layout}, on each rank by {self.placed}"

    def wrap(self, reft_model, optimizer: torch.optim.Optimizer, scheduler, optimizer_state: dict | None):
        """Place the ReFT model for training; returns the module the loss runs through. `optimizer_state` is a
        checkpoint's (torch's AdamW format), loaded once the parameters are where they train."""
        if self.device_map is not None:
            self.device_map.place(reft_model)
        self.reft_model, self.optimizer, self.scheduler = reft_model, optimizer, scheduler
        self.parameters = [parameter for _, parameter in intervention_parameters(reft_model)]
        self.watch_finiteness()
        if optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)
        return reft_model

    def placeholders(self, missing: int) -> int:
        """Count the zero-weight micro-batches a rank runs when its share of a (partial) global batch is `missing`
        micro-batches short: one for every missing one, since every forward or backward communicates."""
        return missing

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def watch_finiteness(self) -> None:
        """Set up the step's loss, summed over its micro-batches, and the first step found non-finite (NO_STEP: none),
        kept on the device: the host reads them only where it reads the device anyway."""
        self.step_loss = torch.zeros((), device=self.device)
        self.first_non_finite = torch.tensor(NO_STEP, device=self.device)

    def backward(self, loss: torch.Tensor) -> None:
        self.step_loss += loss.detach().to(self.device)
        self.differentiate(loss)

    def differentiate(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, number: int) -> torch.Tensor:
        """Clip and step once the step's micro-batches are done, unless the loss or the gradient norm is not finite
        (then the parameters and optimizer state are left as they were, and step `number` is noted); returns the
        gradient norm before clipping."""
        if dist.is_initialized():  # a loss not finite on one rank skips the step on every rank: replicas stay equal
            dist.all_reduce(self.step_loss)  # on the device: the host does not wait for it
        grad_norm, skipped = clip_and_step(self.parameters, self.optimizer, self.scheduler, self.max_grad_norm,
                                           self.step_loss)
        self.note_non_finite(skipped, number)
        return grad_norm

    def note_non_finite(self, skipped: torch.Tensor, number: int) -> None:
        self.first_non_finite = torch.where(skipped.to(self.device), self.first_non_finite.clamp(max=number),
                                            self.first_non_finite)
        self.step_loss.zero_()

    def first_non_finite_step(self) -> int | None:
        """Return the first step whose loss or gradient norm was not finite on any rank, or None: a host read, and under
        torch.distributed a collective (every rank calls it)."""
        first = self.first_non_finite.clone()
        if dist.is_initialized():
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        step = int(first.item())
        return None if step == NO_STEP else step

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Gather the interventions whole on every rank for the block, so that one rank alone can read them."""
        yield

    def optimizer_state(self) -> dict:
        """Return the optimizer state as torch's AdamW writes it, for a checkpoint. A collective for some strategies:
        every rank calls it."""
        return self.optimizer.state_dict()

    def owned(self, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        """Return the elements of the interventions' `parameters` this rank counts, each element on exactly one rank: a
        sum over them, all-reduced, is the sum over the whole parameters (a metric: docs/adapting.md (h)). No
        communication. Replicated, they count on rank 0."""
        return parameters if not dist.is_initialized() or dist.get_rank() == 0 else []


class DDP(Strategy):
    """Every rank holds the whole base; DistributedDataParallel broadcasts the interventions at construction
    and all-reduces (averages) their gradients in the backward of the step's last micro-batch."""

    layout = "replicated (DDP)"

    def wrap(self, reft_model, optimizer, scheduler, optimizer_state):
        super().wrap(reft_model, optimizer, scheduler, optimizer_state)
        # DDP neither broadcasts nor reduces the frozen base. Buffers (rotary tables, the rotation's fixed
        # base) never change: no re-broadcast before each forward. A module on several devices takes no device_ids.
        one_gpu = self.device.type == "cuda" and self.device_map is None
        self.model = DistributedDataParallel(reft_model, find_unused_parameters=False, **no_forward_buffer_sync(),
                                             device_ids=[self.device.index] if one_gpu else None)
        synchronized = {id(p) for module in reft_model.modules() for p in module.parameters(recurse=False)}
        if any(id(p) not in synchronized for p in self.parameters):
            raise RuntimeError("trainable parameters are outside the DDP module; they would diverge")
        check_replicated(self.parameters, self.device)
        return self.model

    def placeholders(self, missing: int) -> int:
        """Return one placeholder, run last (none if nothing is missing): the gradient all-reduce needs every rank once
        per step; earlier micro-steps are local."""
        return min(missing, 1)

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        # DDP all-reduces gradients once per optimizer step, on the last micro-batch.
        return contextlib.nullcontext() if last else self.model.no_sync()


class FSDP(Strategy):
    """FSDP2 over the frozen base: built on the meta device, sharded, then each rank reads only its shards from
    the safetensors files (alpaca.sharding). The interventions stay replicated; their gradients are averaged
    by one all-reduce a step (`average_gradients`). `offload`: the shards stay in CPU memory (CUDA only).
    `quantization` (4-bit): each rank holds its rows of the packed weights (alpaca.sharding.quantize_empty_base)."""

    layout = "sharded (FSDP)"
    shards_base = True

    def __init__(self, device: torch.device, max_grad_norm: float, offload: bool,
                 quantization: dict | None = None) -> None:
        if offload and device.type != "cuda":
            raise UsageError("--fsdp offload keeps the shards in CPU memory for GPUs; on CPUs drop 'offload'")
        super().__init__(device, max_grad_norm, quantization=quantization)  # 4-bit: each rank 1/N of the bytes
        self.offload = offload
        # one mesh over every rank, built before the model exists (alpaca.plan builds the model on fake tensors)
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),)) if dist.is_initialized() else None
        if device.type == "cpu":
            return_freed_buffers_to_the_os()

    def load_base(self, model_path, dtype, cache_dir):
        self.model_path, self.cache_dir = model_path, cache_dir
        return load_base_model(model_path, dtype, torch.device("meta"), cache_dir, quantization=self.quantization)

    def wrap(self, reft_model, optimizer, scheduler, optimizer_state):
        shard_base_model(reft_model.model, self.device, self.offload, self.mesh)
        load_shards(reft_model.model, self.model_path, self.device, self.cache_dir, offload=self.offload)
        reft_model.interventions.to(self.device)
        index_tensors_on(reft_model, self.device)
        # What DDP does at construction: every rank starts from rank 0's interventions.
        broadcast_from_rank_zero([*reft_model.interventions.parameters(), *reft_model.interventions.buffers()])
        super().wrap(reft_model, optimizer, scheduler, optimizer_state)
        check_replicated(self.parameters, self.device)
        return reft_model

    def step(self, number: int) -> torch.Tensor:
        average_gradients(self.parameters)
        return super().step(number)


class ZeRO(Strategy):
    """DeepSpeed ZeRO with our optimizer and schedule (alpaca.zero): stage 1 partitions the optimizer
    state, 2 the gradients too, 3 the parameters too (the frozen base's included). The engine reduces, clips
    and steps, inside the backward of the step's last micro-batch. Under ZeRO-3 the base is built on the meta
    device and each rank reads only its partitions (`partition_base`), as under FSDP."""

    def __init__(self, config: dict, path: str, device: torch.device, max_grad_norm: float,
                 dtype: torch.dtype, quantization: dict | None = None, *, timeout: datetime.timedelta) -> None:
        zero.check_for_device(config, path, device, dtype)
        super().__init__(device, max_grad_norm, quantization=quantization)  # ZeRO-1/2 only (alpaca.args)
        self.config, self.timeout = config, timeout  # the process group's (--ddp_timeout)
        self.shards_base = zero.stage(config) == 3
        self.offload = zero.offloaded(config, "offload_param")  # the base's partitions in CPU memory
        self.layout = f"{'sharded' if self.shards_base else 'replicated'} (DeepSpeed ZeRO-{zero.stage(config)})"
        if self.shards_base and device.type == "cpu":
            return_freed_buffers_to_the_os()

    def load_base(self, model_path, dtype, cache_dir):
        if not self.shards_base:
            return super().load_base(model_path, dtype, cache_dir)
        self.model_path, self.cache_dir = model_path, cache_dir
        return load_base_model(model_path, dtype, torch.device("meta"), cache_dir, reader="ZeRO-3")

    def wrap(self, reft_model, optimizer, scheduler, optimizer_state):
        self.reft_model, self.optimizer = reft_model, optimizer
        self.parameter_groups = [list(group["params"]) for group in optimizer.param_groups]  # DeepSpeed swaps them
        zero.start(self.config, reft_model.model, self.device, self.timeout,
                   trainable_elements=sum(p.numel() for group in self.parameter_groups for p in group))
        if self.shards_base:
            zero.partition_base(reft_model.model, self.model_path, self.config, self.device, self.cache_dir)
            reft_model.interventions.to(self.device)  # left on the CPU by a base built on meta
        self.engine = zero.initialize(reft_model, optimizer, scheduler, self.config)
        self.watch_finiteness()
        if optimizer_state is not None:  # into the partitions, which exist once the engine does
            zero.load_optimizer_state(self.engine, optimizer, self.parameter_groups, optimizer_state)
        with self.gathered():  # ZeRO-3 partitions them: compare them whole
            check_replicated([p for group in self.parameter_groups for p in group], self.device)
        return self.engine

    def differentiate(self, loss: torch.Tensor) -> None:
        zero.micro_step(self.engine, loss)

    def step(self, number: int) -> torch.Tensor:
        """Read the gradient norm and note a non-finite step: the engine clipped and stepped in the last micro-batch's
        backward. ZeRO-1/2 skip a step whose gradient is not finite (DeepSpeed's own overflow check) and report its norm
        as inf; a step with a non-finite loss but a finite gradient is applied, and noted, so that the run stops before
        it saves."""
        grad_norm = torch.as_tensor(self.engine.get_global_grad_norm(), device=self.device)
        self.note_non_finite(non_finite(self.step_loss, grad_norm), number)
        return grad_norm

    def gathered(self) -> contextlib.AbstractContextManager:
        return zero.gathered(self.reft_model.interventions, self.config)

    def optimizer_state(self) -> dict:
        return zero.optimizer_state(self.engine, self.optimizer, self.parameter_groups)

    def owned(self, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        """Return, under ZeRO-3, each rank's partition: outside a forward a parameter holds no elements."""
        return [zero.own_partition(p) for p in parameters] if self.shards_base else super().owned(parameters)


def shard_base_model(model, device: torch.device, offload: bool = False, mesh: DeviceMesh | None = None) -> None:
    """Shard the frozen base with FSDP2: each decoder layer is a unit, all-gathered just before it runs and freed
    after; so are untied input embeddings and LM head, the largest units of a small model. The root unit
    holds the rest (final norm; tied embeddings, one parameter, gathered for the whole forward and
    backward). Build the ReFT model first: pyvene finds its hook points by the model's class, which
    `fully_shard` replaces. `mesh`: every rank's (FSDP's, built before the model), by default a new one."""
    options = {"mesh": mesh or init_device_mesh(device.type, (dist.get_world_size(),))}
    if device.type == "cuda":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=model.dtype, reduce_dtype=torch.float32)
        if offload:
            options["offload_policy"] = CPUOffloadPolicy()
    units = decoder_layers(model)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is not embeddings.weight:
        units = [embeddings, *units, head]
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)
    if device.type == "cpu":
        for unit in [model, *units]:
            unit.register_forward_pre_hook(drop_deferred_all_gather)  # after FSDP's, which gathers the unit


def drop_deferred_all_gather(unit: torch.nn.Module, args: tuple) -> None:
    """Drop the unit's deferred all-gather buffer. FSDP2 keeps a unit's all-gather buffer (the whole unit, beside its
    gathered copy) until the next unit gathers, so that on a GPU its copy-out overlaps the next all-gather on another
    stream. A CPU has no such streams: the buffer only doubles the largest unit (a float32 LM head) for the length of
    its forward, so it is freed as soon as the unit is gathered."""
    unit._get_fsdp_state()._comm_ctx.all_gather_state = None


def broadcast_from_rank_zero(tensors: list[torch.Tensor]) -> None:
    """Broadcast `tensors` from rank 0, each made contiguous: NCCL sends contiguous tensors only (the orthogonal
    parametrization's are not)."""
    for tensor in tensors:
        sent = tensor.data.contiguous()
        dist.broadcast(sent, src=0)
        if sent is not tensor.data:
            tensor.data.copy_(sent)


def average_gradients(parameters: list[torch.Tensor]) -> None:
    """Average the gradients as DDP does, in one flat all-reduce, for replicated parameters outside DDP."""
    grads = [p.grad for p in parameters]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def no_forward_buffer_sync() -> dict[str, bool]:
    """Return DDP's option not to re-broadcast buffers before every forward: `forward_sync_buffers` since torch
    2.13, `broadcast_buffers` (deprecated there) before."""
    new_name = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    return {"forward_sync_buffers" if new_name else "broadcast_buffers": False}


def check_replicated(parameters: list[torch.Tensor], device: torch.device) -> None:
    """Check that all ranks hold identical interventions before the first step (a collective)."""
    checksum = torch.stack([p.detach().double().sum().to(device) for p in parameters])  # from every device of a map
    lowest, highest = checksum.clone(), checksum.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    if not torch.equal(lowest, highest):
        raise RuntimeError("the interventions differ across ranks after the broadcast")


def local_parameter_bytes(module: torch.nn.Module, device: torch.device | None = None) -> int:
    """Count the bytes of parameters this rank holds (on `device` only, if given): its shards of sharded parameters
    (FSDP's DTensors, ZeRO-3's partitions), none of those a device map keeps on disk (on the meta device between
    forwards), the rest whole; a bitsandbytes weight with its quantization constants."""
    def held(parameter: torch.Tensor) -> int:
        if isinstance(parameter, DTensor):
            return parameter.to_local().nbytes
        # ZeRO-3: the partition, plus the whole tensor while it is gathered (between forwards, only small
        # parameters below stage3_param_persistence_threshold stay whole)
        return (parameter.nbytes + (parameter.ds_tensor.nbytes if hasattr(parameter, "ds_tensor") else 0)
                + quantization_constant_bytes(parameter))

    def counted(parameter: torch.Tensor) -> bool:
        return parameter.device.type != "meta" if device is None else parameter.device == device

    # FSDP2's shard of a 4-bit weight has lost its quantization state; bitsandbytes' Linear4bit keeps it, whole
    sharded_constants = sum(quantization_constant_bytes(layer) for layer in module.modules()
                            if isinstance(getattr(layer, "weight", None), DTensor) and counted(layer.weight))
    return sharded_constants + sum(held(parameter) for parameter in module.parameters() if counted(parameter))


def quantization_constant_bytes(holder: torch.Tensor | torch.nn.Module) -> int:
    """Count the bytes a bitsandbytes weight (or the Linear4bit of a sharded one) keeps beside its quantized values: a
    4-bit one's QuantState (a scale per block of 64 values, and with double quantization their own scales), an 8-bit
    one's scale per row (SCB)."""
    state = getattr(holder, "quant_state", None)
    if state is not None:
        return sum(value.nbytes for value in state.as_dict(packed=True).values() if isinstance(value, torch.Tensor))
    scales = getattr(holder, "SCB", None)
    return scales.nbytes if isinstance(scales, torch.Tensor) else 0


def choose_strategy(args, device: torch.device, dtype: torch.dtype, gpus: list[int],
                    distributed: bool | None = None) -> Strategy:
    """Choose --deepspeed, --fsdp or DDP, from the flags, DDP with --device_map over this process's `gpus` or not; one
    process (train.py; not `distributed`, which defaults to whether a process group exists): the plain strategy.
    Refused combinations were refused while parsing, the bitsandbytes quantizations of the base that cannot be
    sharded among them (8-bit under --fsdp, ZeRO-3)."""
    quantization = quantization_settings(args)
    if getattr(args, "deepspeed", None):
        return ZeRO(args.deepspeed_config, args.deepspeed, device, args.max_grad_norm, dtype, quantization,
                    timeout=datetime.timedelta(seconds=args.ddp_timeout))
    if getattr(args, "fsdp", None):
        return FSDP(device, args.max_grad_norm, offload="offload" in args.fsdp.split(), quantization=quantization)
    device_map = (None if args.device_map is None
                  else DeviceMap(args.device_map, args.max_memory, args.offload_folder, gpus))
    distributed = dist.is_initialized() if distributed is None else distributed
    return (DDP if distributed else Strategy)(device, args.max_grad_norm, device_map, quantization)
