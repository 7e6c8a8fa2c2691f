"""slipstream: an LLM inference engine on PyTorch and Triton.

Importing the package does no CUDA work; heavy modules load on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "slipstream.llm",
    "AsyncLLM": "slipstream.engine.async_llm",
    "EngineArgs": "slipstream.engine.args",
    "Executor": "slipstream.engine.executor",
    "Response": "slipstream.engine.executor",
    "SamplingParams": "slipstream.sampling_params",
    "PoolingParams": "slipstream.pooling.params",
    "BeamSearchParams": "slipstream.sampling.beam_search",
    "RequestOutput": "slipstream.outputs",
    "CompletionOutput": "slipstream.outputs",
    "RequestMetrics": "slipstream.outputs",
    "EngineCore": "slipstream.engine.core",
    "EngineConfig": "slipstream.config",
    "default_model_path": "slipstream.assets",
    "LoRARequest": "slipstream.lora.request",
}

__all__ = sorted(_LAZY) + ["__version__", "build"]

if TYPE_CHECKING:
    from slipstream.build import build  # noqa: F401
    from slipstream.config import EngineConfig  # noqa: F401
    from slipstream.engine.args import EngineArgs  # noqa: F401
    from slipstream.engine.async_llm import AsyncLLM  # noqa: F401
    from slipstream.engine.core import EngineCore  # noqa: F401
    from slipstream.engine.executor import Executor, Response  # noqa: F401
    from slipstream.llm import LLM  # noqa: F401
    from slipstream.lora.request import LoRARequest  # noqa: F401
    from slipstream.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: F401
    from slipstream.pooling.params import PoolingParams  # noqa: F401
    from slipstream.sampling.beam_search import BeamSearchParams  # noqa: F401
    from slipstream.sampling_params import SamplingParams  # noqa: F401


def __getattr__(name: str) -> Any:
    if name == "build":  # the subpackage, callable: slipstream.build(model, output, ...)
        import importlib

        return importlib.import_module("slipstream.build")
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'slipstream' has no attribute {name!r}")
