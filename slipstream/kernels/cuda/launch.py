"""CUDA C++ kernels compiled at run time with NVRTC (the library every CUDA build of PyTorch
ships), launched through the driver with programmatic dependent launch (kernels/runtime/pdl.py).

For kernels Triton cannot express (kernels/cuda/w4_stream.cu: per-warp register streaming on the
int8 tensor cores). Sources live next to this file and include no CUDA headers, so NVRTC needs
no include path. Compiled modules are cached per (source, defines, device).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: an enum id, padding to 8, then a 64-byte union (its first int is the
    # programmatic-serialization flag).
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: CUDA error {result} ({(name.value or b'?').decode()})")


class CudaKernel:
    """One compiled kernel: launch(grid, block, shared_mem, args, pdl) on the current stream."""

    def __init__(self, func: ctypes.c_void_p, shared_mem: int):
        self.func = func
        if shared_mem > 48 * 1024:
            _check(_driver().cuFuncSetAttribute(
                func, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem),
                "cuFuncSetAttribute")
        self.shared_mem = shared_mem

    def launch(self, grid: int, block: int, args: list, pdl: bool) -> None:
        """args: tensors (passed as pointers), ints (C int) and floats (C float)."""
        values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor)
                  else ctypes.c_float(a) if isinstance(a, float) else ctypes.c_int(a)
                  for a in args]
        params = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1
        cfg = _LaunchConfig(grid, 1, 1, block, 1, 1, self.shared_mem,
                            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                            ctypes.pointer(attr), 1 if pdl else 0)
        _check(_driver().cuLaunchKernelEx(ctypes.byref(cfg), self.func, params, None),
               "cuLaunchKernelEx")


@functools.cache
def compile_kernel(source: str, name: str, defines: tuple[tuple[str, int], ...], device: int,
                   shared_mem: int) -> CudaKernel:
    """NVRTC-compile kernels/<source> with -D defines for `device` and load `name`."""
    # Imported here: a private torch API that some builds lack; the ImportError reaches
    # w4_stream.maybe_stream, which falls back to the Triton kernels.
    from torch.cuda._utils import _cuda_load_module, _nvrtc_compile

    text = (Path(__file__).parent / source).read_text()
    major, minor = torch.cuda.get_device_capability(device)
    options = [f"-D{k}={v}" for k, v in defines]
    with torch.cuda.device(device):
        key = _binary_key(text, name, options, f"{major}{minor}")
        found = _read_binary(key)
        if found is None:
            found = _nvrtc_compile(text, name, f"{major}{minor}", None, options)
            _write_binary(key, *found)
        binary, mangled = found
        kernels = _cuda_load_module(binary, [mangled or name])
    func = next(iter(kernels.values())).func
    return CudaKernel(func, shared_mem)


# Where compiled binaries are looked up, in order; new ones are written to the last. Set at
# engine start (engine/startup.py): a built engine's folder, then the cache directory.
_BINARY_DIRS: list[Path] = []


def set_binary_dirs(dirs: list[Path]) -> None:
    _BINARY_DIRS[:] = [Path(d) for d in dirs]


def _binary_key(text: str, name: str, options: list[str], arch: str) -> str:
    """What the binary depends on: source, kernel, defines, GPU architecture, torch / CUDA."""
    parts = [text, name, *options, arch, torch.__version__, str(torch.version.cuda)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _read_binary(key: str) -> tuple[bytes, str | None] | None:
    for d in _BINARY_DIRS:
        binary, meta = d / f"{key}.bin", d / f"{key}.json"
        if binary.is_file() and meta.is_file():
            try:
                return binary.read_bytes(), json.loads(meta.read_text())["mangled"]
            except (OSError, ValueError, KeyError):
                continue
    return None


def _write_binary(key: str, binary: bytes, mangled: str | None) -> None:
    """Keep a compiled binary for the next start (a failure to write is only logged)."""
    if not _BINARY_DIRS:
        return
    d = _BINARY_DIRS[-1]
    try:
        d.mkdir(parents=True, exist_ok=True)
        for suffix, data in ((".bin", bytes(binary)),
                             (".json", json.dumps({"mangled": mangled}).encode())):
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, d / f"{key}{suffix}")
    except OSError as exc:
        logger.warning("could not keep a compiled CUDA kernel in %s: %s", d, exc)
