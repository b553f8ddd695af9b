"""--plan under --device_map: the base placed on the plan's fake GPUs as transformers places it for training
(alpaca.model.load_base_model), its memory read on each GPU of the rank."""

from __future__ import annotations

import warnings
from unittest import mock

import torch
from transformers.integrations.accelerate import _get_device_map, accelerate_dispatch, expand_device_map

from alpaca.device_map import DeviceMap
from alpaca.errors import UsageError


def place_by_device_map(model, device_map: DeviceMap, model_path: str, dtype: torch.dtype,
                        cache_dir: str | None) -> None:
    """Place the base, built on the meta device, as `from_pretrained(device_map=...)` does: transformers' map of the
    flags (`DeviceMap.from_pretrained_kwargs`: over this rank's GPUs, and this host's CPU memory where a named map
    is not given --max_memory), each tensor allocated (fake) where the map puts it, and accelerate's hooks where it
    spans devices (transformers' own `_get_device_map` and `accelerate_dispatch`). A map with 'disk' is refused:
    accelerate writes those weights to --offload_folder, and a fake tensor has none to write."""
    placement = device_map.from_pretrained_kwargs(model_path, dtype, cache_dir, model=model)
    devices = _get_device_map(model, placement["device_map"], placement.get("max_memory"), None)
    if "disk" in devices.values():
        raise UsageError("--plan does not plan a --device_map with modules on 'disk': accelerate writes their weights "
                         "to --offload_folder; give the map (or --max_memory) room for them on the GPUs or the CPU")
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, device in expand_device_map(devices, list(tensors)).items():
        tensor_to_device(model, name, device, value=torch.empty_like(tensors[name], device=device))
    model.tie_weights()  # the placed parameters are new ones: a tied head would keep the meta embeddings
    if len(set(devices.values())) > 1:
        # accelerate keys its copies of tied weights by data pointer, which is 0 for every fake tensor (and torch
        # warns at each read): each tensor would be taken for a tied one. Without the map a tied weight is copied
        # to each device that runs it, as accelerate does the first time.
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        with mock.patch("accelerate.big_modeling.find_tied_parameters", lambda model: []):
            accelerate_dispatch(model, None, devices, device_map.offload_folder, None, False)


def fullest_gpu(peaks: dict[torch.device, int]) -> torch.device:
    """Return the GPU whose peak is highest: a rank's verdict is its fullest GPU's."""
    return max(peaks, key=lambda device: (peaks[device], -device.index))


def tensor_to_device(module: torch.nn.Module, tensor_name: str, device: int | str | torch.device,
                     value: torch.Tensor | None = None, **options) -> None:
    """accelerate's `set_module_tensor_to_device` for a fake tensor: put `value` (or the tensor there) on `device` as
    the module's parameter or buffer `tensor_name` (dotted). accelerate's own remakes a parameter by its class, which
    for a fake parameter is FakeTensor, which cannot be built so."""
    module_name, _, name = tensor_name.rpartition(".")
    module = module.get_submodule(module_name)
    placed = (getattr(module, name) if value is None else value).to(device)
    if name in module._parameters:
        module._parameters[name] = torch.nn.Parameter(placed, requires_grad=False)
    else:
        module._buffers[name] = placed


def accelerate_on_fake_tensors() -> mock._patch:
    """Let accelerate's hooks move fake tensors (`tensor_to_device`), as a device map's forward does (a module on
    the CPU brought to its GPU and back)."""
    return mock.patch("accelerate.hooks.set_module_tensor_to_device", tensor_to_device)
