"""--deepspeed CONFIG.json: DeepSpeed ZeRO (stage 1, 2 or 3) in place of DDP.

The config is HF's (`examples/deepspeed/`): "auto" values are filled from our flags (the bucket sizes of
ZeRO-3 from the model's hidden size, as HF does), and values that disagree with the flags are refused. The
optimizer and the schedule are ours (the flags), so are the step schedule, the batches and the token-weighted
loss: DeepSpeed partitions (ZeRO-1: the optimizer state, ZeRO-2: and the gradients, ZeRO-3: and the
parameters, the frozen base's included), reduces, clips and steps.

Under ZeRO-3 no rank loads the whole base: it is built on the meta device and each rank reads its partitions
from the safetensors files (`partition_base`). A module's parameters exist whole only while it runs, gathered
by a collective that DeepSpeed starts from hooks on the module: every rank must run every forward (evaluation,
sample answers), and the interventions are gathered on every rank before rank 0 alone reads them for an output
or a checkpoint. Two of DeepSpeed's ways cost a frozen base memory for nothing, and `partition_base` changes
them: a tied embedding stays gathered from its first use in a step to the step, as under --fsdp, and a frozen
linear keeps no input for the backward (`keep_tied_embeddings_gathered`, `frozen_weight_linear`).

Checkpoints are ours (alpaca.checkpoint), never DeepSpeed's (its loader unpickles arbitrary objects): the
optimizer state is written as torch's AdamW writes it without DeepSpeed, full per parameter, assembled from
and spread back to the partitions with DeepSpeed's public safe_get/safe_set functions. So a checkpoint written
without DeepSpeed resumes under it (tested from train.py's); the other way is the same format, untested.

On a bf16 base the interventions are float32 as everywhere (alpaca.workarounds.compute_in_float32), so every
trainable parameter, every flat group and the optimizer state are float32; the config's "bf16" section is
dropped (alpaca.deepspeed_config), so DeepSpeed casts nothing: the frozen base stays in bf16 (partitioned in
bf16 under ZeRO-3). fp16 would need loss scaling, which these scripts do not run: refused with one line.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import itertools
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.utils import parametrize

from alpaca.deepspeed_config import stage
from alpaca.errors import UsageError
from alpaca.layers import decoder_layers
from alpaca.sharding import check_loaded, checkpoint_index, place_buffers, read_elements


def deepspeed_package():
    """Import DeepSpeed at its first use: its import takes seconds and logs a line, and only --deepspeed runs
    need it (alpaca.strategy imports this module for every run)."""
    import deepspeed
    import deepspeed.runtime.zero.linear  # noqa: F401 - ZeRO-3's linear function, looked up as an attribute

    return deepspeed


def offloaded(config: dict, section: str) -> bool:
    return config["zero_optimization"].get(section, {}).get("device", "none") != "none"


def check_for_device(config: dict, path: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse what the device or the dtype cannot run. Offloading moves ZeRO's state from GPUs to the CPU: meaningless
    on a CPU. A float16 base would need loss scaling (see the module's docstring)."""
    if dtype == torch.float16:
        raise UsageError(f"--deepspeed {path}: a float16 base needs loss scaling, which these scripts do not run "
                         "under DeepSpeed; pass --dtype bfloat16 (or float32)")
    for section in ("offload_optimizer", "offload_param"):
        if offloaded(config, section) and device.type != "cuda":
            example = "zero3.json" if stage(config) == 3 else "zero2.json"
            raise UsageError(f'--deepspeed {path}: zero_optimization.{section} moves state from GPUs to the CPU; '
                             f'on CPUs set its "device" to "none" (examples/deepspeed/{example})')


class ReftModule(torch.nn.Module):
    """The ReFT model as DeepSpeed needs it: base and interventions as ordinary submodules.

    pyvene's IntervenableModel overrides named_parameters() to list the interventions' only: DeepSpeed,
    handed the ReFT model itself, would neither see nor broadcast the base."""

    def __init__(self, reft_model):
        super().__init__()
        self.base = reft_model.model
        self.interventions = reft_model.interventions
        self._reft_model = [reft_model]  # in a list: not a submodule, its modules are registered above

    def forward(self, *args, **kwargs):
        return self._reft_model[0](*args, **kwargs)


# The bucket and persistence sizes that HF's "auto" derives from the model's hidden size h, by HF's rules
MODEL_AUTO = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
              "stage3_param_persistence_threshold": lambda h: 10 * h}


def one_layer_parameters(model) -> int:
    """Count the parameters of one decoder layer: our "auto" for stage3_max_reuse_distance (HF fills none). A module's
    parameters stay gathered when they are used again within that many, as a layer recomputed for the backward
    under --gradient_checkpointing is; DeepSpeed's default, 1e9, is about one layer of a 70B model (0.86e9),
    and all of any model below 1B parameters, which it then keeps gathered from the forward to the backward."""
    return sum(parameter.numel() for parameter in decoder_layers(model)[0].parameters())


def fill_model_sized(config: dict, model, trainable_elements: int) -> None:
    """Fill the config's model-sized "auto" values (MODEL_AUTO, and `one_layer_parameters`), and keep the reduce
    bucket within the `trainable_elements`: DeepSpeed allocates it whole in float32, twice with overlap_comm, however
    few gradients it holds (HF's 5e8 is 4 GB a rank for a few thousand values), and one bucket of all the
    gradients is already a single reduction a step."""
    zero = config["zero_optimization"]
    for key, rule in MODEL_AUTO.items():
        if zero.get(key) == "auto":
            zero[key] = rule(model.config.get_text_config(decoder=True).hidden_size)
    if zero.get("stage3_max_reuse_distance") == "auto":
        zero["stage3_max_reuse_distance"] = one_layer_parameters(model)
    zero["reduce_bucket_size"] = min(int(zero.get("reduce_bucket_size", trainable_elements)), trainable_elements)


def partition_bytes(tensor: torch.Tensor, world_size: int) -> int:
    """Count a rank's bytes of a tensor partitioned by ZeRO: ceil(numel / world) elements (the last partition
    padded). `tensor` may be whole, meta or a sharded DTensor: only its global size is read."""
    return -(-tensor.numel() // world_size) * tensor.element_size()


def planned_base_bytes(config: dict, base: list[torch.Tensor], world_size: int) -> int:
    """Count the GPU bytes of a rank's ZeRO-3 base, for a plan (alpaca.plan), where DeepSpeed's engine cannot run (it
    needs real tensors): each tensor's partition (`partition_bytes`), and the whole tensor too where it stays
    gathered (up to stage3_param_persistence_threshold elements, filled by `fill_model_sized`); none with
    offload_param."""
    if offloaded(config, "offload_param"):
        return 0
    persistent = int(config["zero_optimization"].get("stage3_param_persistence_threshold", 1e5))  # DeepSpeed's default
    return sum(partition_bytes(t, world_size) + (t.numel() <= persistent) * t.numel() * t.element_size() for t in base)


def planned_prefetch_bytes(config: dict, dtype: torch.dtype) -> int:
    """Count the GPU bytes ZeRO-3's prefetcher may hold gathered ahead of the module that runs, for a plan: its bucket,
    stage3_prefetch_bucket_size elements of the base's dtype (0 in examples/deepspeed/zero3.json)."""
    return int(config["zero_optimization"].get("stage3_prefetch_bucket_size", 5e7)) * dtype.itemsize  # its default


def planned_reused_bytes(model, config: dict) -> int:
    """Count the GPU bytes of the largest module ZeRO-3 keeps gathered from its forward into its backward, for a plan:
    a module used again within stage3_max_reuse_distance elements stays gathered (the LM head across the loss, where
    it has no more elements than that distance)."""
    reuse = int(config["zero_optimization"].get("stage3_max_reuse_distance", 1e9))  # DeepSpeed's default
    modules = [list(module.parameters(recurse=False)) for module in model.modules()]
    return max((sum(p.numel() * p.element_size() for p in parameters) for parameters in modules
                if 0 < sum(p.numel() for p in parameters) <= reuse), default=0)


def planned_trainable_bytes(config: dict, trainable: list[torch.Tensor], world_size: int) -> tuple[int, int]:
    """Count, at their most, the GPU bytes of a rank's ZeRO engine for the trainable parameters, for a plan: the
    parameters and their gradient whole (under stage 3 gathered for their forward and backward, besides their
    partitions), this rank's partitions of the float32 copy, the gradient and AdamW's two moments, unless
    offload_optimizer keeps those in CPU memory; and the reduce bucket (`fill_model_sized`: at most every trainable
    value), twice with overlap_comm. Returns (the parameters' states, the buckets)."""
    whole = sum(t.numel() * t.element_size() for t in trainable)
    partitions = sum(partition_bytes(t, world_size) for t in trainable)
    on_gpu = not offloaded(config, "offload_optimizer")
    states = 2 * whole + partitions * (stage(config) == 3) + 4 * partitions * on_gpu
    bucket = int(config["zero_optimization"]["reduce_bucket_size"]) * 4  # float32 gradients
    return states, bucket * (2 if config["zero_optimization"].get("overlap_comm") else 1)


def start(config: dict, model, device: torch.device, timeout: datetime.timedelta, trainable_elements: int) -> None:
    """Prepare what DeepSpeed needs before its first call: the config's model-sized values (`fill_model_sized`), its
    view of the process group, whose collectives wait `timeout` (the group's, --ddp_timeout), and on a CPU no compiler
    run."""
    deepspeed = deepspeed_package()
    if device.type == "cpu":
        # DeepSpeed's CPU backend JIT-compiles (g++) a shared-memory all-reduce as it starts, for its inference
        # all-reduce alone, which training never calls. (Looked up by name: the attribute deepspeed.comm.torch
        # is torch itself.)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    fill_model_sized(config, model, trainable_elements)
    # DeepSpeed's ZeRO-2 calls collectives under their deprecated names at every step
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed",
                            category=FutureWarning)
    deepspeed.utils.logger.setLevel("WARNING")
    # over our process group, as deepspeed.initialize does; zero.Init reads the world size from it
    deepspeed.init_distributed(deepspeed.accelerator.get_accelerator().communication_backend_name())
    # ZeRO's collectives run on DeepSpeed's clone of the world group, which it makes with torch's default timeout
    # for the backend, not the group's: made here, with the group's, in place of DeepSpeed's own.
    importlib.import_module("deepspeed.utils.groups")._WORLD_GROUP = dist.new_group(
        ranks=range(dist.get_world_size()), timeout=timeout)


def partition_base(model, model_name_or_path: str, config: dict, device: torch.device,
                   cache_dir: str | None = None) -> None:
    """Partition a base built on the meta device (`load_base_model(..., meta)`) into ZeRO-3's partitions, each rank
    reading only its own from the safetensors files: no rank ever holds the whole base.

    DeepSpeed's way to partition a built module (`zero.Init(module=...)`) allocates each tensor whole,
    broadcasts it from rank 0 and keeps this rank's partition: here one module at a time, on uninitialized
    memory, so the largest module (the embeddings) is whole for a moment, as in every forward. Each rank then
    fills its partition, elements [r n, (r + 1) n) of the flattened tensor (DeepSpeed's layout; the last
    partition padded), from the files."""
    deepspeed = deepspeed_package()
    index = checkpoint_index(model, model_name_or_path, cache_dir, "ZeRO-3")
    place_buffers(model, dict(model.named_buffers()), index, device)
    for module in reversed(list(model.modules())):  # children first: zero.Init converts a module's whole subtree
        empty = [parameter for parameter in module.parameters(recurse=False) if parameter.is_meta]
        if empty:  # (a tied parameter is converted once, in the first module met)
            for parameter in empty:  # in place: the same object, still tied (meta cannot take new `.data`)
                torch.utils.swap_tensors(parameter, torch.nn.Parameter(torch.empty_like(parameter, device=device),
                                                                       requires_grad=parameter.requires_grad))
            deepspeed.zero.Init(module=module, config_dict_or_path=config, dtype=model.dtype)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            partition = parameter.ds_tensor
            start = partition.numel() * dist.get_rank()
            stop = min(start + partition.numel(), parameter.ds_numel)
            if start < stop:
                partition[:stop - start].copy_(read_elements(index[name], name, start, stop))
    check_loaded(model)
    keep_tied_embeddings_gathered(model)
    # ZeRO-3's linear function is installed by zero.Init, for the whole process
    if torch.nn.functional.linear is deepspeed.runtime.zero.linear.zero3_linear_wrap:
        torch.nn.functional.linear = frozen_weight_linear()


def keep_tied_embeddings_gathered(model) -> None:
    """Keep a tied embedding gathered from its first use to the step. A tied embedding (often the largest tensor) is
    used by the first module of each forward, by the last one and by the first of the backward. DeepSpeed gathers it for
    each, the last two on top of every activation of the step; marked persistent, as DeepSpeed marks parameters below
    stage3_param_persistence_threshold, it is gathered at its first use and partitioned again at the step, as
    --fsdp's root unit holds it (alpaca.strategy.shard_base_model). No more memory where the step peaks, which
    holds it gathered either way, and two all-gathers fewer a micro-batch. `ds_persist` is private: DeepSpeed
    is pinned (alpaca.deepspeed_config.TESTED_DEEPSPEED)."""
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is embeddings.weight:
        embeddings.weight.ds_persist = True


def frozen_weight_linear():
    """Return a ZeRO-3 linear that saves no input for a frozen weight. DeepSpeed's ZeRO-3 linear
    ("memory_efficient_linear": it saves the parameter, not a view of the gathered weight, so that the backward gathers
    it again) saves the input for the weight's gradient also where the weight is frozen: one activation per linear of
    every layer the gradient flows through. This one keeps it only for a weight that needs a gradient, as torch's linear
    does; the rest is DeepSpeed's (0.19.8)."""
    LinearFunctionForZeroStage3 = deepspeed_package().runtime.zero.linear.LinearFunctionForZeroStage3

    class FrozenWeightLinear(LinearFunctionForZeroStage3):
        @staticmethod
        def setup_context(ctx, inputs, output):
            LinearFunctionForZeroStage3.setup_context(ctx, inputs, output)
            input, weight, bias = inputs
            ctx.save_for_backward(input if weight.requires_grad else None, weight, bias)  # replaces DeepSpeed's

    def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return FrozenWeightLinear.apply(input, weight, bias)

    return linear


def initialize(reft_model, optimizer, scheduler, config: dict):
    """Build the DeepSpeed engine around the ReFT model, with our optimizer and schedule. Under ZeRO-3 it
    partitions the interventions across the ranks (`partition_base` has partitioned the base)."""
    deepspeed = deepspeed_package()
    engine, *_ = deepspeed.initialize(model=ReftModule(reft_model), optimizer=optimizer, lr_scheduler=scheduler,
                                      config=config)
    return engine


def micro_step(engine, loss: torch.Tensor) -> None:
    """Run the backward of one micro-batch. `loss` is already scaled for the whole step (token-weighted over the
    global batch), so the engine must not divide it by the accumulation steps again. step() after every
    micro-batch is DeepSpeed's protocol: it steps the optimizer and the schedule (and clips) at the
    accumulation boundary only."""
    engine.backward(loss, scale_wrt_gas=False)
    engine.step()


@contextlib.contextmanager
def gathered(module: torch.nn.Module, config: dict | None) -> Iterator[None]:
    """Gather the whole parameters of `module` on every rank for the block, under ZeRO-3 (collectives every
    rank reaches), so that one rank alone can read them. Inside, gradients are off and parametrized weights
    are cached; below stage 3 it does nothing.

    A parametrized weight (LoReFT's rotation) is computed by calling a module, whose hooks would gather its
    parameters again, on the reading rank alone: every rank computes each such weight here, and the
    reading rank finds it in torch's parametrization cache."""
    if config is None or stage(config) != 3:
        yield
        return
    deepspeed = deepspeed_package()
    with parametrize.cached(), torch.no_grad():
        for submodule in module.modules():
            if parametrize.is_parametrized(submodule):
                for name in submodule.parametrizations:
                    getattr(submodule, name)
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            yield


ADAM_STATE = ("exp_avg", "exp_avg_sq")  # torch AdamW's per-parameter tensors, besides its step count


def link_optimizer_state(engine) -> None:
    """Relink each parameter to its slice of the optimizer state. ZeRO-1/2 link each parameter to its slice of the
    optimizer state once, at the first step of the first group, when AdamW has not yet created the other groups' state
    (DeepSpeed 0.19): the later groups' read as missing. Linked again, every group's is there. ZeRO-3 reads the state
    where it is. The method is private, with no public equivalent: alpaca.deepspeed_config refuses any DeepSpeed but
    TESTED_DEEPSPEED."""
    zero_optimizer = engine.optimizer
    if hasattr(zero_optimizer, "_lazy_init_hp_params_optimizer_state"):
        zero_optimizer._hp_optimizer_states_linked = False
        zero_optimizer._lazy_init_hp_params_optimizer_state()


def own_partition(parameter: torch.nn.Parameter) -> torch.Tensor:
    """Return this rank's elements of a ZeRO-3 parameter (flat): its partition without the padding the last partitions
    get, which DeepSpeed leaves uninitialized."""
    size = parameter.ds_tensor.ds_numel  # every partition's, padded
    start = size * parameter.ds_zero_partition_rank
    return parameter.ds_tensor.narrow(0, 0, max(0, min(size, parameter.ds_numel - start)))


def optimizer_state(engine, optimizer: torch.optim.Optimizer, parameter_groups: list[list[torch.nn.Parameter]]) -> dict:
    """Return what `optimizer.state_dict()` is without DeepSpeed (torch's AdamW: per parameter, numbered in the order
    of `parameter_groups`, its step, exp_avg and exp_avg_sq), assembled from the partitions. A collective:
    every rank calls it. `optimizer` is ours, which DeepSpeed steps on its flat partitions."""
    safe_get_full_optimizer_state = deepspeed_package().utils.safe_get_full_optimizer_state
    groups, start = [], 0
    for group, members in zip(optimizer.param_groups, parameter_groups, strict=True):
        groups.append({**{key: value for key, value in group.items() if key != "params"},
                       "params": list(range(start, start + len(members)))})
        start += len(members)
    partition_states = list(optimizer.state.values())  # empty before the first step: AdamW creates it then
    if not partition_states:
        return {"state": {}, "param_groups": groups}
    step = partition_states[0]["step"]  # the partitions step together
    link_optimizer_state(engine)
    state = {index: {"step": step.cpu().clone(),
                     **{key: safe_get_full_optimizer_state(parameter, key).cpu() for key in ADAM_STATE}}
             for index, parameter in enumerate(itertools.chain(*parameter_groups))}
    return {"state": state, "param_groups": groups}


def load_optimizer_state(engine, optimizer: torch.optim.Optimizer, parameter_groups: list[list[torch.nn.Parameter]],
                         saved: dict) -> None:
    """Spread an optimizer state of `optimizer_state` (or of torch's AdamW under DDP: the same format) over
    the partitions. A collective: every rank calls it."""
    safe_set_full_optimizer_state = deepspeed_package().utils.safe_set_full_optimizer_state
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        group.update({key: value for key, value in saved_group.items() if key != "params"})
    if not saved["state"]:
        return
    # AdamW creates its state at its first step: a resumed run fills it before, so it creates it. ZeRO-3 keeps
    # its flat partitions out of the optimizer's groups between steps.
    partitions = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None) or [
        partition for group in optimizer.param_groups for partition in group["params"]]
    step = saved["state"][0]["step"]
    # torch's fused and capturable AdamW keep the step count on the device, the others on the CPU
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    for partition in partitions:
        optimizer.state[partition] = {"step": step.clone().to(partition.device) if on_device else step.clone(),
                                      **{key: torch.zeros_like(partition) for key in ADAM_STATE}}
    link_optimizer_state(engine)
    for index, parameter in enumerate(itertools.chain(*parameter_groups)):
        for key in ADAM_STATE:
            safe_set_full_optimizer_state(parameter, saved["state"][index][key].to(partitions[0].device), key)
