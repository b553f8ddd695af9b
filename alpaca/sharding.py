"""--fsdp and ZeRO-3 without a full copy of the base on any rank: build it on the meta device, shard (or
partition) it, then fill each rank's part straight from the checkpoint's safetensors files.

    model = empty_base_model(path, dtype, cache_dir)     # parameters on meta, buffers computed on the CPU
    reft_model = build_reft_model(model, ...)             # pyvene finds its hooks by the model's class
    shard_base_model(model, device)                       # alpaca.strategy: fully_shard, still on meta
    load_shards(model, path, device, cache_dir)           # allocate the local shards, read only their slices

ZeRO-3 (alpaca.zero.partition_base) partitions each tensor flat instead, and reads each rank's range of
elements with `read_elements`.

With --load_in_4bit (`quantize_empty_base`) the meta base's linear layers become bitsandbytes' Linear4bit, each
weight shaped as its packed 4-bit bytes; each rank then reads one whole weight at a time, quantizes it as
transformers does and keeps its rows of the packed bytes (`read_quantized_rows`).

Under DDP the weights stay file-backed (a memory map, shared by the ranks through the page cache); a
sharded rank instead holds its shards as private memory, so it must never hold more than its shards plus
the unit it gathers for the moment. Each rank reads only the rows of each tensor that it owns, converting
only those to the training dtype.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import os
from functools import partial
from pathlib import Path

import torch
from accelerate import init_empty_weights
from huggingface_hub import snapshot_download
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM

from alpaca.errors import UsageError


def empty_base_model(model_name_or_path: str, dtype: torch.dtype, cache_dir: str | None = None,
                     reader: str = "--fsdp"):
    """Build the base model with its parameters on the meta device (no memory) and its buffers computed on the
    CPU as usual (rotary tables: small, and not all of them are in the checkpoint). Frozen, eval mode.
    `reader` is the flag that reads it in parts (--fsdp, ZeRO-3), named by the errors."""
    safetensors_index(model_name_or_path, cache_dir, reader)  # no safetensors: say so now, not after the sharding
    config = AutoConfig.from_pretrained(model_name_or_path, cache_dir=cache_dir)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # accelerate's meta parameters come untied: lm_head would be a second, unloaded tensor
    model.requires_grad_(False)
    model.eval()
    return model


def quantize_empty_base(model, config) -> None:
    """Quantize the meta base for --fsdp with --load_in_4bit: transformers' bitsandbytes quantizer turns the meta base's
    linear layers into Linear4bit, the layers and settings `from_pretrained(quantization_config=config)` quantizes; each
    weight then takes the shape of its packed bytes (bitsandbytes' (n + 1) // 2 x 1 uint8), which fully_shard shards by
    rows."""
    import bitsandbytes as bnb
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
    quantizer.preprocess_model(model, device_map=None)
    quantizer.postprocess_model(model)  # the config on the model, as from_pretrained leaves it (nothing is loaded)
    model.hf_quantizer = quantizer
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight, values_per_element = module.weight, 2 * module.quant_storage.itemsize
            packed = torch.empty((weight.numel() + 1) // values_per_element, 1, dtype=module.quant_storage,
                                 device="meta")
            module.weight = bnb.nn.Params4bit(packed, requires_grad=False, blocksize=weight.blocksize,
                                              compress_statistics=weight.compress_statistics,
                                              quant_type=weight.quant_type, quant_storage=module.quant_storage,
                                              module=module, bnb_quantized=True)


def safetensors_index(model_name_or_path: str, cache_dir: str | None = None,
                      reader: str = "--fsdp") -> dict[str, Path]:
    """Map each tensor name of the checkpoint to the safetensors file that holds it: from a local directory,
    or from a hub name's cached snapshot (downloaded once per node by the first caller)."""
    directory = Path(os.path.expanduser(model_name_or_path))
    if not directory.is_dir():
        directory = Path(snapshot_download(model_name_or_path, cache_dir=cache_dir,
                                           allow_patterns=["*.safetensors", "*.safetensors.index.json"]))
    index_file = directory / "model.safetensors.index.json"
    if index_file.exists():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UsageError(f"{reader} reads each rank's shards from safetensors files; {model_name_or_path} has none "
                         f"(convert it with save_pretrained, or train without {reader})")
    index = {}
    for file in files:
        with safe_open(file, framework="pt") as opened:
            index.update(dict.fromkeys(opened.keys(), file))
    return index


def load_shards(model: torch.nn.Module, model_name_or_path: str, device: torch.device,
                cache_dir: str | None = None, offload: bool = False) -> None:
    """Allocate the local shards of a model sharded on the meta device (`fully_shard`) and fill them, each
    rank reading only its own slice of each tensor: on `device`, or with `offload` in CPU memory (FSDP's
    CPUOffloadPolicy moves them to `device` for each forward). Buffers go to `device` either way (FSDP moves
    none: a rotary table left on the CPU would be copied over at every forward), with the values computed at
    construction unless the checkpoint has them. Tied parameters stay tied (one parameter, filled once). The
    weights of a 4-bit base (`quantize_empty_base`) are read whole, one at a time, and quantized
    (`read_quantized_rows`)."""
    index = checkpoint_index(model, model_name_or_path, cache_dir, "--fsdp")
    quantized = {f"{name}.weight": module for name, module in model.named_modules() if hasattr(module, "quant_storage")}
    buffers = dict(model.named_buffers())
    shards_device = torch.device("cpu") if offload else device
    model.to_empty(device=shards_device)  # uninitialized memory for the local shards only (and the buffers)
    place_buffers(model, buffers, index, device)
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # tied parameters appear once, under their first name
            read = read_rows
            if name in quantized:
                read = partial(read_quantized_rows, module=quantized[name], config=model.config.quantization_config,
                               device=shards_device)
            if isinstance(parameter, DTensor):
                local = parameter.to_local()
                # local shape and offset of a DTensor's local part, as torch's distributed checkpoint computes them
                shape, offset = compute_local_shape_and_global_offset(parameter.shape, parameter.device_mesh,
                                                                      parameter.placements)
                if any(start for start in offset[1:]) or tuple(local.shape) != tuple(shape):
                    raise NotImplementedError(f"{name}: only row-wise shards (FSDP's Shard(0)) are read")
                rows = read(index[name], name, slice(offset[0], offset[0] + shape[0]))
                if local.numel():
                    local.copy_(rows)
            else:
                parameter.copy_(read(index[name], name))
    check_loaded(model)


def checkpoint_index(model: torch.nn.Module, model_name_or_path: str, cache_dir: str | None,
                     reader: str) -> dict[str, Path]:
    """Return safetensors_index, checked to hold every parameter of `model` under its name."""
    index = safetensors_index(model_name_or_path, cache_dir, reader)
    missing = [name for name, _ in model.named_parameters() if name not in index]
    if missing:
        more = f" and {len(missing) - 1} more" if missing[1:] else ""
        raise UsageError(f"{reader} reads each rank's shards from safetensors files by tensor name; "
                         f"{model_name_or_path} lacks {missing[0]!r}{more} (a checkpoint that transformers "
                         f"converts while loading): train without {reader}")
    return index


def place_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor], index: dict[str, Path],
                  device: torch.device) -> None:
    """Place each of `buffers` (name: the value computed at construction) onto `device` in `model`, with the
    checkpoint's value where it has one."""
    for name, buffer in buffers.items():
        module_name, _, buffer_name = name.rpartition(".")
        placed = buffer.to(device)
        if name in index:
            placed.copy_(read_rows(index[name], name))
        model.get_submodule(module_name)._buffers[buffer_name] = placed


def read_rows(file: Path, name: str, rows: slice | None = None) -> torch.Tensor:
    """Read tensor `name` of a safetensors file, or only its `rows`. safe_open maps the whole file; the pages a
    read touches count in this rank's resident memory until the map is closed. So one map per read: the file
    pages resident at once are one slice's."""
    with safe_open(file, framework="pt") as opened:
        tensor_slice = opened.get_slice(name)
        return tensor_slice[:] if rows is None else tensor_slice[rows]


def read_quantized_rows(file: Path, name: str, rows: slice | None = None, *, module, config,
                        device: torch.device) -> torch.Tensor:
    """Return the packed 4-bit bytes of weight `name` of bitsandbytes' Linear4bit `module`, or only their `rows`: the
    whole tensor read, cast to the compute dtype and quantized on `device` as transformers' loader does it (the
    same bytes as `--load_in_4bit` on one process); NF4's scales run along the flattened tensor, so no rank can
    quantize its rows alone. The module keeps the quantization state (the scales), whole: FSDP2's gathered
    weight is a plain tensor, to which bitsandbytes' Linear4bit gives the module's state back at each forward."""
    import bitsandbytes as bnb

    whole = read_rows(file, name).to(module.compute_dtype)
    weight = bnb.nn.Params4bit(whole, requires_grad=False, compress_statistics=config.bnb_4bit_use_double_quant,
                               quant_type=config.bnb_4bit_quant_type, quant_storage=module.quant_storage,
                               module=module).to(device)  # sets module.quant_state
    return weight.data if rows is None else weight.data[rows]


def read_elements(file: Path, name: str, start: int, stop: int) -> torch.Tensor:
    """Return elements [start, stop) of tensor `name` flattened (a ZeRO-3 partition), read as the whole rows that
    hold them: at most part of a row more on either side."""
    with safe_open(file, framework="pt") as opened:
        tensor_slice = opened.get_slice(name)
        shape = tensor_slice.get_shape()
        if not shape:  # a scalar
            return opened.get_tensor(name).reshape(1)[start:stop]
        row = math.prod(shape[1:])
        first = start // row
        held = tensor_slice[first:-(-stop // row)].reshape(-1)
    return held[start - first * row:stop - first * row]


def check_loaded(model: torch.nn.Module) -> None:
    left_on_meta = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left_on_meta:
        raise RuntimeError(f"{len(left_on_meta)} tensors of the base were never loaded, e.g. {left_on_meta[0]}")


def return_freed_buffers_to_the_os() -> None:
    """Return the buffers a rank frees to the OS (glibc's mmap threshold). Sharded on the CPU, each rank all-gathers
    every unit into fresh host memory and frees it after use. glibc serves large allocations with mmap and unmaps them
    when freed, but raises its mmap threshold to the size of each such chunk freed: from the second unit on, the
    gathered units come from the heap, which keeps what is freed (more than a model copy per rank within two steps).
    Setting the threshold fixes it (and turns that adjustment off); at 64 KiB, what a step frees is returned (a larger
    threshold keeps part of a model copy from step to step). Set as the strategy is chosen, before the data and the
    model load: a heap grown before it is set serves the partitions and keeps what they free."""
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    if libc is not None and hasattr(libc, "mallopt"):  # glibc; other allocators return memory themselves
        m_mmap_threshold = -3
        libc.mallopt(m_mmap_threshold, 64 << 10)
