"""The model's decoder layers, where the interventions act and what FSDP, ZeRO-3's prefetch and activation
checkpointing work by; a leaf module, which every module that needs them imports."""

from __future__ import annotations

import torch

from alpaca.errors import UsageError


def decoder_layer_list(model) -> str:
    """Return the dotted name of the model's list of decoder layers, found as transformers finds a model's parts: the
    `ModuleList` in its decoder (`get_decoder()`: the language model of a multimodal one) whose blocks are its
    `_no_split_modules` (the blocks HF's device map keeps whole and its FSDP wrapping wraps)."""
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    lists = [name for name, module in decoder.named_modules() if isinstance(module, torch.nn.ModuleList) and len(module)
             and all(type(layer).__name__ in blocks for layer in module)]
    if len(lists) != 1:
        raise UsageError(f"{type(model).__name__} has no list of decoder layers (a ModuleList of its "
                         "_no_split_modules blocks), where the interventions act; pass a decoder-only causal LM")
    return ".".join(name for name in (prefix, lists[0]) if name)


def decoder_layers(model) -> torch.nn.ModuleList:
    """Return the repeated blocks: --fsdp's units and --gradient_checkpointing's recomputed regions."""
    return model.get_submodule(decoder_layer_list(model))


def offloaded(module) -> bool:
    """Tell whether accelerate brings the module's weights in for each forward and drops them after (a map put it on
    disk, or on the CPU of a process with GPUs): an AlignDevicesHook with `offload` on it or a submodule."""
    hooks = [submodule._hf_hook for submodule in module.modules() if hasattr(submodule, "_hf_hook")]
    return any(getattr(single, "offload", False) for hook in hooks
               for single in getattr(hook, "hooks", [hook]))  # a SequentialHook holds several
