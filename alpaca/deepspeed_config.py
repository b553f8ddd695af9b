"""--deepspeed CONFIG.json read and checked against the flags: standard library only, so a mistake in the
config is one line before torch is imported (alpaca.zero runs the engine)."""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from alpaca.errors import UsageError

# alpaca.zero reads private parts of DeepSpeed's ZeRO optimizers (see link_optimizer_state and
# load_optimizer_state there), checked against this version only (requirements.txt pins it).
TESTED_DEEPSPEED = "0.19.8"


def load_config(args, world_size: int) -> dict:
    """Load the DeepSpeed config of --deepspeed, its "auto" values filled from the flags. Needs no torch work:
    called while the arguments are checked, before anything is loaded or written."""
    path = args.deepspeed
    where = f"--deepspeed {path}"
    try:
        installed = version("deepspeed")
    except PackageNotFoundError:
        installed = None
    if installed != TESTED_DEEPSPEED:
        found = f"DeepSpeed {installed} is installed" if installed else "DeepSpeed is not installed"
        raise UsageError(f"{where}: {found}, and these scripts are tested with DeepSpeed {TESTED_DEEPSPEED} only (they "
                         f"read private parts of its ZeRO optimizers); pip install deepspeed=={TESTED_DEEPSPEED}")
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
    if stage not in (1, 2, 3):
        raise UsageError(f"{where}: zero_optimization.stage {stage!r} does not exist here; use 1, 2 or 3 (stage 0 is "
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


def stage(config: dict) -> int:
    return config["zero_optimization"]["stage"]
