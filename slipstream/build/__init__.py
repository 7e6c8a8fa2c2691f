"""The build step: prepare a model for one machine, precision and set of limits, and write it as
an engine directory that `LLM(ENGINE_DIR)`, `slipstream serve ENGINE_DIR` and the executor load
with no conversion and no tuning (builder.py, engine_dir.py, weights.py, manifest.py)."""
from __future__ import annotations

from typing import Any


def build(*args: Any, **kwargs: Any):
    """slipstream.build.builder.build (imported on first use: the engine is heavy)."""
    from slipstream.build.builder import build as _build

    return _build(*args, **kwargs)


build.__doc__ = "Build a model into an engine directory; see slipstream.build.builder.build."
