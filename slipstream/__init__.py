"""slipstream: an LLM inference engine on PyTorch and Triton.

Importing the package does no CUDA work; heavy modules load on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "slipstream.llm",
    "SamplingParams": "slipstream.sampling_params",
    "PoolingParams": "slipstream.pooling.params",
    "BeamSearchParams": "slipstream.sampling.beam_search",
    "RequestOutput": "slipstream.outputs",
    "CompletionOutput": "slipstream.outputs",
    "RequestMetrics": "slipstream.outputs",
    "EngineCore": "slipstream.engine.core",
    "EngineConfig": "slipstream.config",
    "default_model_path": "slipstream.assets",
}

__all__ = sorted(_LAZY) + ["__version__"]

if TYPE_CHECKING:
    from slipstream.config import EngineConfig  # noqa: F401
    from slipstream.engine.core import EngineCore  # noqa: F401
    from slipstream.llm import LLM  # noqa: F401
    from slipstream.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: F401
    from slipstream.pooling.params import PoolingParams  # noqa: F401
    from slipstream.sampling.beam_search import BeamSearchParams  # noqa: F401
    from slipstream.sampling_params import SamplingParams  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'slipstream' has no attribute {name!r}")
