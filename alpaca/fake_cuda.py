"""Fake CUDA devices in one CPU process, for alpaca.plan: GPUs that hold fake tensors only (FakeTensorMode), so that
the scripts' own step runs at any world size with no GPU and no memory allocated at the model's size.

A CPU build of torch knows no CUDA device: a small library (fake_cuda.cpp, compiled once into the cache) registers
CUDA's hooks and a device guard whose streams and events do nothing, and must be loaded before torch is (LD_PRELOAD),
so `run_with_fake_cuda` starts the command again with it. torch.cuda's Python functions call the CUDA runtime; the
few that FSDP2 and torch.distributed call are answered here (`answer_torch_cuda`). A CUDA build plans on its own
devices' fake tensors and needs neither.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import traceback
import types
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from alpaca.errors import PlannedFailure, UsageError
from alpaca.manifest import cache_root, sha256

PRELOADED = "REFT_ALPACA_FAKE_CUDA"  # set in the command started again with the library loaded
SOURCE = Path(__file__).with_name("fake_cuda.cpp")
LIBRARY = "libfakecuda.so"
DEVICES = 8  # fake_cuda.cpp's device count: a node's GPUs


def run_with_fake_cuda(cache_dir: str | None) -> None:
    """Return in a process that has CUDA devices (a CUDA build, or this command started again with the library
    preloaded); otherwise build the library and start the command again."""
    if torch.backends.cuda.is_built():
        return
    preloaded = os.environ.get("LD_PRELOAD", "").split()
    if os.environ.get(PRELOADED) == "1":
        # loaded already; the processes it starts (a compiler, ninja) get only what the user preloaded
        os.environ["LD_PRELOAD"] = " ".join(entry for entry in preloaded if Path(entry).name != LIBRARY)
        return
    library = build_library(cache_dir)
    environment = {**os.environ, PRELOADED: "1", "LD_PRELOAD": " ".join([str(library), *preloaded])}
    sys.stdout.flush()
    os.execve(sys.executable, sys.orig_argv, environment)


def build_library(cache_dir: str | None) -> Path:
    """Compile fake_cuda.cpp against this torch once, into the cache (about 3 s): a directory of this torch and this
    source."""
    directory = cache_root(cache_dir) / f"fake-cuda-torch-{torch.__version__}-{sha256(SOURCE)[:12]}"
    library = directory / LIBRARY
    if library.exists():
        return library
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise UsageError("--plan on a CPU build of torch compiles a small library of fake CUDA devices: install a C++ "
                         "compiler (g++), or plan on a machine with CUDA's torch")
    directory.mkdir(parents=True, exist_ok=True)
    torch_dir = Path(torch.__file__).parent
    partial = directory / f"libfakecuda.so.{os.getpid()}"
    command = [compiler, "-O1", "-w", "-shared", "-fPIC", "-std=c++17", f"-I{torch_dir / 'include'}", str(SOURCE),
               f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(partial)]
    built = subprocess.run(command, capture_output=True, text=True)
    if built.returncode != 0:
        reason = (built.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"--plan could not compile its fake CUDA devices ({compiler}): {reason}")
    partial.replace(library)
    return library


def current() -> torch.device:
    return torch.device("cuda", torch._C._accelerator_getDeviceIndex())


class Stream(torch.Stream):
    """torch.cuda.Stream as the device guard makes it: an id, no queue."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        return super().__new__(cls, device=current(), priority=priority)


class Event(torch.Event):
    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return super().__new__(cls, device=current(), enable_timing=enable_timing)


def answer_torch_cuda(gpu_bytes: int, count: int) -> None:
    """Answer the torch.cuda functions FSDP2, torch.distributed and accelerate call, on a CPU build (whose torch.cuda
    calls the CUDA runtime it lacks), as a node of `count` GPUs of `gpu_bytes` each, free, with compute capability 9.0
    would; and make `record_stream` a no-op on fake tensors (it has no fake kernel)."""
    if torch.backends.cuda.is_built():
        return
    cuda = torch.cuda
    cuda._lazy_init = lambda: None
    cuda.is_initialized = lambda: True
    cuda.current_device = lambda: current().index
    cuda.device_count = lambda: count
    cuda.mem_get_info = lambda device=None: (gpu_bytes, gpu_bytes)
    cuda.Stream, cuda.Event = Stream, Event
    cuda.current_stream = cuda.default_stream = lambda device=None: torch.accelerator.current_stream(current())
    cuda.stream = lambda stream: contextlib.nullcontext() if stream is None else stream
    cuda.synchronize = lambda device=None: None
    cuda.get_device_capability = lambda device=None: (9, 0)
    properties = types.SimpleNamespace(name="planned GPU", major=9, minor=0, total_memory=gpu_bytes)
    cuda.get_device_properties = lambda device=None: properties
    global _RECORD_STREAM  # the library must outlive this call
    _RECORD_STREAM = torch.library.Library("aten", "IMPL")
    _RECORD_STREAM.impl("record_stream", lambda tensor, stream: None, "Meta")


@contextlib.contextmanager
def fake_tensor_mode() -> Iterator[FakeTensorMode]:
    """Enter a FakeTensorMode in which modules can move their fake parameters (`module.to`, `to_empty`).

    torch swaps a fake parameter with its moved copy (torch.utils.swap_tensors), which refuses a tensor that is
    weakly referenced, and the mode's memo of the tensors it made holds such a reference to each: while the mode
    is on, the tensors are forgotten by the memo just before they are swapped."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swap_tensors = torch.utils.swap_tensors

    def forget_and_swap(first: torch.Tensor, second: torch.Tensor) -> None:
        memo = mode.fake_tensor_converter.tensor_memo
        for key, tensor in list(memo.items()):
            if tensor is first or tensor is second:
                del memo[key]
        swap_tensors(first, second)

    torch.utils.swap_tensors = forget_and_swap
    try:
        with mode:
            yield mode
    finally:
        torch.utils.swap_tensors = swap_tensors


class HostReads(TorchDispatchMode):
    """Answer the host's reads of fake values (`.item()`, `torch.equal`), which have no value to read: 1 for a number
    (AdamW divides by what its step count gives), False for a flag, equal for a comparison. A plan reads no
    value; the shapes and so the memory never depend on these."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            tensor = args[0]
            return False if tensor.dtype == torch.bool else 1.0 if tensor.is_floating_point() else 1
        if func is torch.ops.aten.equal.default:
            return True
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def gpu_attention_kernels() -> Iterator[None]:
    """Run SDPA on fake CUDA tensors with the kernels a GPU picks: flash attention in half precision without a mask
    (grouped key and value heads taken as they are), else memory-efficient attention, which takes no grouped heads:
    with them a GPU runs the math path, as the CPU build does for every CUDA tensor, holding every head's full
    attention matrix (in float32). Replaced as a function, not by a TorchFunctionMode: a recomputed layer
    (--gradient_checkpointing) runs on the autograd engine's device thread, which does not see the modes of this
    one."""
    sdpa = F.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        if query.is_cuda and attn_mask is None and query.dtype in (torch.float16, torch.bfloat16):
            return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                      scale=scale)[0]
        if query.is_cuda and key.shape[-3] == query.shape[-3]:
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, query.requires_grad, dropout_p, is_causal, scale=scale)[0]
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


@functools.wraps(DistributedDataParallel, assigned=(), updated=())  # its signature, which the strategy reads
def ddp_on_the_fake_group(module: torch.nn.Module, **options) -> DistributedDataParallel:
    """torch's DDP, where its C++ parts would read a fake tensor's data or the fake group's results: the check that
    every rank's parameters have the same shapes (a plan has one rank), the order its buckets are rebuilt in after
    the first step (the same bytes in another order), and its runtime statistics (timed with CUDA events, which the
    CPU build has no timer of). Its gradient all-reduce runs as a comm hook doing what its own does: the fake
    group's futures hold no tensor for the reducer to read back."""
    with mock.patch("torch.nn.parallel.distributed._verify_param_shape_across_processes"):
        ddp = DistributedDataParallel(module, **options)
    ddp.register_comm_hook(None, ddp_gradient_all_reduce)
    ddp.reducer = mock.Mock(wraps=ddp.reducer, _rebuild_buckets=lambda: False)
    ddp.logger = mock.Mock()
    return ddp


def ddp_gradient_all_reduce(state, bucket):  # no annotation: DDP checks it, and this module makes it a string
    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    averaged = torch.futures.Future()
    averaged.set_result(buffer.div_(dist.get_world_size()))
    return averaged


COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
OUTSIDE = (f"{os.sep}torch{os.sep}", f"{os.sep}alpaca{os.sep}fake_cuda.py")


class NCCLDeviceRule(TorchDispatchMode):
    """Hold every collective that reaches the process group to NCCL's rule: its tensors on `bound`, the GPU the
    rank's group is bound to (init_process_group's device_id), or, a group bound to none, on one of the rank's `gpus`.
    gloo on CPU takes a CPU tensor or another device's, NCCL raises: a collective breaking the rule ends the plan with
    one line naming the call site (the first frame outside torch). DDP's reducer, FSDP2's all-gathers
    and reduce-scatters and torch.distributed's functions all pass through here."""

    def __init__(self, bound: torch.device | None, gpus: list[int]) -> None:
        super().__init__()
        self.devices = [bound] if bound is not None else [torch.device("cuda", gpu) for gpu in gpus]
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.count += 1
            tensors = [value for value in torch.utils._pytree.tree_leaves((args, kwargs))
                       if isinstance(value, torch.Tensor)]
            stray = next((tensor for tensor in tensors if tensor.device not in self.devices), None)
            if stray is not None:
                name, devices = func.__name__.split(".")[0], " or ".join(map(str, self.devices))
                raise PlannedFailure(f"a collective ({name}) at {call_site()} is given a tensor on {stray.device}, "
                                     f"where NCCL takes only the rank's {devices}: it would fail on GPUs")
        return func(*args, **kwargs)


def call_site() -> str:
    """The innermost frame of the stack outside torch and this file: the code that issued the collective."""
    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename for part in OUTSIDE):
            return f"{os.path.relpath(frame.filename)}:{frame.lineno} ({frame.name})"
    return "the backward (autograd's device thread: DDP's or FSDP2's gradient communication)"
