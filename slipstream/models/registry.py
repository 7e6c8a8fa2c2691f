"""HF architecture name -> model class, imported lazily so unused families cost nothing."""
from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("slipstream.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("slipstream.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("slipstream.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("slipstream.models.llama", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("slipstream.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("slipstream.models.gemma", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("slipstream.models.gemma", "Gemma3ForConditionalGeneration"),
    "Phi3ForCausalLM": ("slipstream.models.phi3", "Phi3ForCausalLM"),
    "GPT2LMHeadModel": ("slipstream.models.gpt2", "GPT2LMHeadModel"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(arch: str) -> type[nn.Module]:
    """The class for an HF `architectures[0]` name; ValueError naming it if unsupported."""
    if arch not in _MODELS:
        raise ValueError(f"unsupported model architecture {arch!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    module, name = _MODELS[arch]
    return getattr(importlib.import_module(module), name)
