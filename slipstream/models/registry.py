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
    "MixtralForCausalLM": ("slipstream.models.moe", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("slipstream.models.moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("slipstream.models.moe", "Qwen3MoeForCausalLM"),
    # Pooling models (pooling/): encoders, headless decoders, classifiers.
    "BertModel": ("slipstream.models.bert", "BertModel"),
    "BertForSequenceClassification": ("slipstream.models.bert", "BertForSequenceClassification"),
    **{f"{family}Model": ("slipstream.models.llama_pooling", "LlamaHeadlessModel")
       for family in ("Llama", "Mistral", "Qwen2", "Qwen3")},
    **{f"{family}ForSequenceClassification": ("slipstream.models.llama_pooling",
                                              "LlamaForSequenceClassification")
       for family in ("Llama", "Mistral", "Qwen2", "Qwen3")},
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


def check_parallel_support(arch: str, tp_size: int, pp_size: int) -> None:
    """ValueError when the family cannot be split as asked (a class says so with
    `supports_tensor_parallel` / `supports_pipeline_parallel` = False)."""
    cls = get_model_class(arch)
    if tp_size > 1 and not getattr(cls, "supports_tensor_parallel", True):
        raise ValueError(f"{arch} does not support tensor parallelism: use "
                         "tensor_parallel_size 1")
    if pp_size > 1 and not getattr(cls, "supports_pipeline_parallel", True):
        raise ValueError(f"{arch} does not support pipeline parallelism: use "
                         "pipeline_parallel_size 1")
