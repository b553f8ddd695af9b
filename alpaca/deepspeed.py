"""--deepspeed CONFIG.json: DeepSpeed ZeRO stage 1 or 2 in place of DDP.

The config is HF's (`examples/deepspeed/zero2.json`): "auto" values are filled from our flags, and values
that disagree with the flags are refused. The optimizer and the schedule are ours (the flags), so are the
step plan, the batches and the token-weighted loss: DeepSpeed partitions (ZeRO-1: the optimizer state,
ZeRO-2: and the gradients), reduces, clips and steps.

ZeRO-3 is refused for now: it trains the same model as DDP here, but reading the interventions for the
output hangs. LoReFT's rotation is a parametrization, computed by calling a module, and ZeRO-3 fetches
that module's parameter with a collective that only the saving rank reaches.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from alpaca.args import UsageError


def load_config(args, world_size: int) -> dict:
    """The DeepSpeed config of --deepspeed, its "auto" values filled from the flags. Needs no torch work:
    called while the arguments are checked, before anything is loaded or written."""
    path = args.deepspeed
    where = f"--deepspeed {path}"
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise UsageError(f"{where}: cannot read it ({error.strerror}); pass a DeepSpeed JSON config such as "
                         "examples/deepspeed/zero2.json") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"{where}: invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{where}: a DeepSpeed config is a JSON object, got {type(config).__name__}")
    zero = config.setdefault("zero_optimization", {})
    stage = zero.get("stage")
    if stage == 3:
        raise UsageError(f"{where}: ZeRO-3 is not supported yet; use stage 1 or 2 (examples/deepspeed/zero2.json), "
                         "or --fsdp to shard the base")
    if stage not in (1, 2):
        raise UsageError(f"{where}: zero_optimization.stage {stage!r} does not exist here; use 1 or 2 (stage 0 is "
                         "plain data parallelism: train without --deepspeed)")
    from_flags = {
        "train_micro_batch_size_per_gpu": (args.per_device_train_batch_size, "--per_device_train_batch_size"),
        "gradient_accumulation_steps": (args.gradient_accumulation_steps, "--gradient_accumulation_steps"),
        "train_batch_size": (args.per_device_train_batch_size * world_size * args.gradient_accumulation_steps,
                             f"--per_device_train_batch_size x {world_size} processes x --gradient_accumulation_steps"),
        "gradient_clipping": (args.max_grad_norm, "--max_grad_norm"),
    }
    for key, (value, flag) in from_flags.items():
        given = config.get(key, "auto")
        if given != "auto" and given != value:
            raise UsageError(f'{where}: {key} {given} disagrees with {flag} ({value}); set it to "auto"')
        config[key] = value
    for section, flags in (("optimizer", "--learning_rate, --weight_decay, --adam_*"),
                           ("scheduler", "--lr_scheduler_type, --warmup_steps, --warmup_ratio")):
        fixed = {key: value for key, value in config.pop(section, {}).get("params", {}).items() if value != "auto"}
        if fixed:
            raise UsageError(f'{where}: {section} {json.dumps(fixed)}: the {section} comes from {flags}; set its '
                             'values to "auto" or drop the section')
    for precision in ("fp16", "bf16"):
        if config.pop(precision, {}).get("enabled", False) not in ("auto", False):
            raise UsageError(f'{where}: {precision}.enabled: the dtype comes from --dtype (--bf16, --fp16); set it to '
                             '"auto"')
    config.setdefault("steps_per_print", 2**62)  # our progress bar and metrics.jsonl report the steps
    config.setdefault("wall_clock_breakdown", False)
    return config


def check_for_device(config: dict, path: str, device: torch.device) -> None:
    """Offloading moves ZeRO's state from GPUs to the CPU: meaningless on a CPU."""
    offload = config["zero_optimization"].get("offload_optimizer", {}).get("device", "none")
    if offload != "none" and device.type != "cuda":
        raise UsageError(f'--deepspeed {path}: zero_optimization.offload_optimizer moves state from GPUs to the CPU; '
                         'on CPUs set its "device" to "none" (examples/deepspeed/zero2.json)')


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


def initialize(reft_model, optimizer, scheduler, config: dict):
    """The DeepSpeed engine around the ReFT model, with our optimizer and schedule."""
    import warnings

    import deepspeed

    # DeepSpeed's ZeRO-2 calls collectives under their deprecated names at every step
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed",
                            category=FutureWarning)
    deepspeed.utils.logger.setLevel("WARNING")
    engine, *_ = deepspeed.initialize(model=ReftModule(reft_model), optimizer=optimizer, lr_scheduler=scheduler,
                                      config=config)
    return engine


def micro_step(engine, loss: torch.Tensor) -> None:
    """Backward of one micro-batch. `loss` is already scaled for the whole step (token-weighted over the
    global batch), so the engine must not divide it by the accumulation steps again. step() after every
    micro-batch is DeepSpeed's protocol: it steps the optimizer and the schedule (and clips) at the
    accumulation boundary only."""
    engine.backward(loss, scale_wrt_gas=False)
    engine.step()

