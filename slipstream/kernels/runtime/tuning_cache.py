"""The start-up tuners' choices, saved and read back: per shape, the kernel config that measured
fastest on this GPU.

Each tuner registers its in-memory table (`register`). `snapshot()` turns every table into JSON
(keys of ints, bools, strings and torch dtypes; values None, a string or a frozen config
dataclass of slipstream.kernels), `restore()` fills the tables back, so a shape already measured
is never timed again. A built engine carries its snapshot (build/); without a build the tables
persist in a file under the cache directory (envs.CACHE_DIR) named after the GPU and the
versions of slipstream, torch, Triton and CUDA: another GPU or version starts afresh.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from slipstream import envs

logger = logging.getLogger(__name__)

FORMAT = 1
_TABLES: dict[str, dict] = {}
_ALLOWED_MODULES = "slipstream.kernels."  # config classes are looked up only under here


def register(name: str, table: dict) -> dict:
    """Make `table` (key tuple -> choice) part of every snapshot under `name`; returns it."""
    _TABLES[name] = table
    return table


def _import_tuners() -> None:
    """Import the modules whose tuners register tables (Triton ones may be absent)."""
    for module in ("slipstream.kernels.triton_ops", "slipstream.kernels.gemv.int8",
                   "slipstream.kernels.gemv.int4", "slipstream.kernels.gemm.int8",
                   "slipstream.kernels.gemm.int4"):
        try:
            importlib.import_module(module)
        except ImportError:
            continue


def _encode(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        return {"config": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}}
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    if isinstance(value, dict) and "dtype" in value:
        return getattr(torch, value["dtype"])
    if isinstance(value, dict) and "config" in value:
        module, _, name = value["config"].partition(":")
        if not module.startswith(_ALLOWED_MODULES):
            raise ValueError(f"tuning cache names a class outside slipstream.kernels: {module}")
        cls = getattr(importlib.import_module(module), name)
        return cls(**value["fields"])
    return value


def snapshot() -> dict[str, Any]:
    """Every registered table as JSON-ready data."""
    _import_tuners()
    tables = {name: [[_encode(k), _encode(v)] for k, v in table.items()]
              for name, table in _TABLES.items() if table}
    return {"format": FORMAT, "tables": tables}


def restore(data: dict[str, Any]) -> int:
    """Fill the registered tables from a snapshot (entries already measured here win); returns
    how many entries were added. Entries that no longer decode (a config class changed) are
    skipped: those shapes are simply measured again."""
    if data.get("format") != FORMAT:
        return 0
    _import_tuners()
    added = 0
    for name, entries in data.get("tables", {}).items():
        table = _TABLES.get(name)
        if table is None:
            continue
        for key, value in entries:
            try:
                k, v = _decode(key), _decode(value)
            except (AttributeError, TypeError, ValueError, ImportError):
                continue
            if k not in table:
                table[k] = v
                added += 1
    return added


def environment_key(device: torch.device) -> str:
    """What a tuning result depends on besides the shape: GPU, compute capability, versions."""
    from slipstream import __version__

    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    parts = [name, f"sm{major}{minor}", f"slipstream{__version__}", f"torch{torch.__version__}",
             f"triton{triton_version}", f"cuda{torch.version.cuda}"]
    return re.sub(r"[^A-Za-z0-9.+_-]+", "_", "-".join(parts))


def cache_dir() -> Path | None:
    """The persistent cache directory, or None when the operator turned it off."""
    raw = envs.CACHE_DIR.get()
    if raw.lower() == "off":
        return None
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "slipstream"


def cache_file(device: torch.device) -> Path | None:
    root = cache_dir()
    return None if root is None else root / "tuning" / f"{environment_key(device)}.json"


def load_file(path: Path) -> int:
    """restore() from a JSON file; 0 when it is absent or unreadable (a warning)."""
    if not path.is_file():
        return 0
    try:
        return restore(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        logger.warning("ignoring tuning cache %s: %s", path, exc)
        return 0


def save_file(path: Path) -> None:
    """Merge this process's tables into the JSON file (atomically replaced); a failure to write
    (read-only home, full disk) is a warning, never an error."""
    try:
        load_file(path)  # keep what other processes measured meanwhile
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(snapshot(), f)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not write the tuning cache %s: %s", path, exc)


def num_entries() -> int:
    """How many choices the registered tables hold."""
    return sum(len(t) for t in _TABLES.values())
