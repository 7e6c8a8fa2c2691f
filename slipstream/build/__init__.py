"""The build step: prepare a model for one machine, precision and set of limits, and write it as
an engine directory that `LLM(ENGINE_DIR)`, `slipstream serve --model ENGINE_DIR` and the
executor load with no conversion and no tuning (builder.py, engine_dir.py, weights.py,
manifest.py).

`slipstream.build(model, output, **engine_args)` calls builder.build: this package is callable,
since `slipstream.build` names the package once any of its modules is imported.
"""
from __future__ import annotations

import sys
import types
from typing import Any


def build(*args: Any, **kwargs: Any):
    """Build a model into an engine directory: see slipstream.build.builder.build."""
    from slipstream.build.builder import build as _build  # lazy: the engine is heavy

    return _build(*args, **kwargs)


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any):
        return build(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
