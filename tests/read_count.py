"""Count the bytes this process reads from safetensors files: every tensor that `safetensors.safe_open` hands
out, whole (`get_tensor`) or sliced (`get_slice(name)[...]`), whoever reads it (transformers, alpaca.sharding).

    torchrun --nproc_per_node N tests/read_count.py train_multigpu.py <flags>

runs the script and writes "safetensors bytes read: B" to stderr at exit, once per rank. Imported before
anything imports safetensors' readers, `bytes_read()` is the count so far.
"""

import os
import sys

import safetensors

_read = 0
_safe_open = safetensors.safe_open


def bytes_read() -> int:
    return _read


def _counted(tensor):
    global _read
    _read += tensor.nbytes
    return tensor


class _Slice:
    def __init__(self, tensor_slice):
        self._slice = tensor_slice

    def __getitem__(self, index):
        return _counted(self._slice[index])

    def __getattr__(self, name):
        return getattr(self._slice, name)


class _CountingOpen:
    """safe_open, with or without `with`, counting what it reads."""

    def __init__(self, *args, **kwargs):
        self._opened = _safe_open(*args, **kwargs)

    def __enter__(self):
        self._opened.__enter__()
        return self

    def __exit__(self, *exc):
        return self._opened.__exit__(*exc)

    def get_tensor(self, name):
        return _counted(self._opened.get_tensor(name))

    def get_slice(self, name):
        return _Slice(self._opened.get_slice(name))

    def __getattr__(self, name):
        return getattr(self._opened, name)


safetensors.safe_open = _CountingOpen

if __name__ == "__main__":
    import runpy

    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.stderr.write(f"safetensors bytes read: {_read}\n")
