"""The flags of a bitsandbytes-quantized base (QReFT), for training and generation: added to a parser, checked
against what they combine with, and turned into BitsAndBytesConfig's arguments. Standard library only, as
alpaca.args."""

from __future__ import annotations

import argparse

from alpaca.deepspeed_config import stage
from alpaca.errors import UsageError
from alpaca.flag_values import str2bool

# --bnb_4bit_quant_type: bitsandbytes' 4-bit data types (BitsAndBytesConfig's names).
QUANT_TYPES = ("nf4", "fp4")


def add_quantization_flags(group) -> None:
    """Add the flags of bitsandbytes' quantization of the frozen base as it loads, by transformers' BitsAndBytesConfig
    names; the compute dtype is --dtype's. For training and generation."""
    group.add_argument("--load_in_4bit", type=str2bool, nargs="?", const=True, default=False,
                       help="load the frozen base quantized to 4 bits by bitsandbytes (QReFT; docs/big-models.md)")
    group.add_argument("--load_in_8bit", type=str2bool, nargs="?", const=True, default=False,
                       help="load the frozen base quantized to 8 bits by bitsandbytes (LLM.int8)")
    group.add_argument("--bnb_4bit_quant_type", default=None, choices=QUANT_TYPES,
                       help="with --load_in_4bit, the 4-bit data type; default nf4")
    group.add_argument("--bnb_4bit_use_double_quant", type=str2bool, nargs="?", const=True, default=False,
                       help="with --load_in_4bit, quantize the quantization constants too (~0.4 bit a parameter less)")


def quantization_flag(args: argparse.Namespace) -> str | None:
    """Return the flag that quantizes the base, if one does."""
    return "--load_in_4bit" if args.load_in_4bit else "--load_in_8bit" if args.load_in_8bit else None


def quantization_settings(args: argparse.Namespace) -> dict | None:
    """Return BitsAndBytesConfig's arguments of the quantization flags (the compute dtype added where the model loads),
    or None for a base in --dtype."""
    if args.load_in_4bit:
        return {"load_in_4bit": True, "bnb_4bit_quant_type": args.bnb_4bit_quant_type,
                "bnb_4bit_use_double_quant": args.bnb_4bit_use_double_quant}
    return {"load_in_8bit": True} if args.load_in_8bit else None


def validate_quantization(args: argparse.Namespace) -> None:
    """Check what a bitsandbytes-quantized base combines with (docs/big-models.md says why each refusal): the 4-bit
    options resolved (nf4 by default) and refused without --load_in_4bit, so that a run's saved flags say exactly
    how its base was quantized."""
    quantized = quantization_flag(args)
    if args.load_in_4bit and args.load_in_8bit:
        raise UsageError("--load_in_4bit and --load_in_8bit are exclusive; pick one")
    given_4bit_option = next((f"--{name}" for name in ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant")
                              if getattr(args, name)), None)
    if given_4bit_option and not args.load_in_4bit:
        raise UsageError(f"{given_4bit_option} sets how --load_in_4bit quantizes the base; add --load_in_4bit, or "
                         "drop it")
    if args.load_in_4bit and args.bnb_4bit_quant_type is None:
        args.bnb_4bit_quant_type = "nf4"
    if not quantized:
        return
    if args.dtype == "float64":
        raise UsageError(f"{quantized} computes in float32, bfloat16 or float16, not float64; pick one of those with "
                         "--dtype, or drop the quantization")
    fsdp_words = getattr(args, "fsdp", "").split()
    if fsdp_words and args.load_in_8bit:
        raise UsageError("--load_in_8bit and --fsdp do not combine: bitsandbytes keeps an 8-bit weight's row scales on "
                         "the weight, which FSDP2's gathered weight loses; use --load_in_4bit with --fsdp, or DDP "
                         "(docs/big-models.md)")
    if "offload" in fsdp_words:
        raise UsageError(f"{quantized} with --fsdp offload: the shards would sit in CPU memory and their quantization "
                         "constants with them, not on the GPU that computes; drop 'offload' (docs/big-models.md)")
    if getattr(args, "deepspeed", None) and stage(args.deepspeed_config) == 3:
        raise UsageError(f"{quantized} and ZeRO-3 do not combine: these scripts shard a quantized base under --fsdp "
                         "only; use --fsdp with --load_in_4bit, ZeRO-1/2 (examples/deepspeed/zero2.json) or DDP "
                         "(docs/big-models.md)")
    if args.device_map is not None and (args.offload_folder is not None
                                        or isinstance(args.device_map, dict) and "disk" in args.device_map.values()):
        raise UsageError(f"{quantized} with --device_map: bitsandbytes cannot offload quantized layers to disk; "
                         "place every module on a GPU or the CPU and drop --offload_folder (docs/big-models.md)")
    if getattr(args, "torch_compile", False):  # generate.py has no such flag
        raise UsageError(f"--torch_compile is not yet tested with {quantized} (bitsandbytes' kernels); drop one "
                         "of them")
