"""Checkpoint tensors read lazily from memory-mapped safetensors, so a distributed rank reads
only the slice it keeps (safetensors' get_slice) and never materialises the whole model."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointSlice:
    """One checkpoint tensor, not read yet: its shape and dtype, `narrow` and basic slicing
    (which read just those bytes), `materialize()` (reads it all)."""

    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())
        self.dtype = _DTYPES.get(self._slice.get_dtype())

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * self.dim()
        index[dim] = slice(start, start + length)
        return self[tuple(index)]

    def __getitem__(self, index) -> torch.Tensor:
        if not self.shape:  # a 0-d scale
            return self.materialize()[index]
        return self._slice[index]

    def materialize(self) -> torch.Tensor:
        if not self.shape:
            return self._slice[...]
        return self[tuple(slice(None) for _ in self.shape)]

    def part(self, dim: int, start: int, length: int) -> CheckpointSlice:
        """Rows [start, start + length) of dim, still not read: a fused tensor's one shard,
        which the rank then narrows to its own rows (one read of just those)."""
        return _NarrowedSlice(self, dim, start, length)


class _NarrowedSlice(CheckpointSlice):
    """A CheckpointSlice seen through a window of one dim; indexing reads through the base."""

    def __init__(self, base: CheckpointSlice, dim: int, start: int, length: int):
        self._base, self._dim, self._start = base, dim, start
        self.shape = base.shape[:dim] + torch.Size([length]) + base.shape[dim + 1:]
        self.dtype = base.dtype

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (self.dim() - len(index))
        window = index[self._dim]
        if not isinstance(window, slice) or window.step not in (None, 1):
            raise TypeError("a checkpoint slice's window takes plain slices only")
        start, stop, _ = window.indices(self.shape[self._dim])
        shifted = slice(self._start + start, self._start + stop)
        return self._base[index[:self._dim] + (shifted,) + index[self._dim + 1:]]


def materialize(tensor) -> torch.Tensor:
    """The tensor itself, or a CheckpointSlice read whole."""
    return tensor.materialize() if isinstance(tensor, CheckpointSlice) else tensor


def checkpoint_part(tensor, dim: int, start: int, length: int):
    """Rows [start, start + length) of dim: a view of a tensor, a lazy window of a slice."""
    if isinstance(tensor, CheckpointSlice):
        return tensor.part(dim, start, length)
    return tensor.narrow(dim, start, length)


def iterate_safetensor_slices(files: Iterable[Path], skip: Callable[[str], bool]
                              ) -> Iterator[tuple[str, CheckpointSlice]]:
    """(name, CheckpointSlice) for each tensor not skipped, file by file."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if not skip(name):
                    yield name, CheckpointSlice(f, name)
