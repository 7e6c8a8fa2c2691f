"""Shared test helpers: tiny random Hugging Face checkpoints saved with save_pretrained, and the
error metrics every numerical test states its tolerance in.

`make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")` -> a directory with config.json and
model.safetensors (float32) that both transformers and slipstream can load.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel")

TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=None,
    tie_word_embeddings=False,
    # Larger than HF's 0.02 so attention is far from uniform and RoPE/bias bugs show in logits.
    initializer_range=0.15,
)


def _config_class(arch: str):
    import transformers

    names = {
        "LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
        "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config",
        "Gemma2ForCausalLM": "Gemma2Config", "Gemma3ForCausalLM": "Gemma3TextConfig",
        "Phi3ForCausalLM": "Phi3Config", "GPT2LMHeadModel": "GPT2Config",
    }
    if arch not in names:
        raise ValueError(f"make_tiny_checkpoint: unknown arch {arch!r}; known: {sorted(names)}")
    return getattr(transformers, names[arch]), getattr(transformers, arch)


def tiny_config(arch: str, **overrides: Any):
    """A transformers config object of the tiny shape; overrides win (rope_scaling accepted)."""
    config_cls, _ = _config_class(arch)
    kwargs = {**TINY_DEFAULTS, **FAMILY_DEFAULTS.get(arch, {}), **overrides}
    if "head_dim" not in overrides:  # keep hidden = heads * head_dim when the shape changes
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    if arch == "MistralForCausalLM":
        kwargs.setdefault("sliding_window", None)  # a window only where a test asks for one
    if arch == "GPT2LMHeadModel":
        kwargs = _gpt2_kwargs(kwargs)
    rope_scaling = kwargs.pop("rope_scaling", None)
    config = config_cls(**kwargs)
    if rope_scaling is not None:
        _set_rope_scaling(config, dict(rope_scaling), kwargs["rope_theta"])
    config.architectures = [arch]
    return config


# Per family, on top of TINY_DEFAULTS: each family's own features switched on at a tiny size
# (windows shorter than the test prompts, soft-capping that bites at these logit scales).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": dict(sliding_window=8, query_pre_attn_scalar=24,
                              attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                              hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    "Gemma3ForCausalLM": dict(sliding_window=8, query_pre_attn_scalar=24, sliding_window_pattern=2,
                              rope_local_base_freq=100.0, rope_theta=10000.0,
                              tie_word_embeddings=True),
    "Phi3ForCausalLM": dict(pad_token_id=0),
    "GPT2LMHeadModel": dict(tie_word_embeddings=True),  # as every GPT-2 checkpoint
}


def _gpt2_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's own config names for the tiny shape (learned positions, LayerNorm)."""
    return dict(vocab_size=kwargs["vocab_size"], n_embd=kwargs["hidden_size"],
                n_layer=kwargs["num_hidden_layers"], n_head=kwargs["num_attention_heads"],
                n_positions=kwargs["max_position_embeddings"], n_inner=kwargs["intermediate_size"],
                bos_token_id=1, eos_token_id=2, initializer_range=kwargs["initializer_range"],
                tie_word_embeddings=kwargs.get("tie_word_embeddings", True),
                activation_function=kwargs.get("activation_function", "gelu_new"))


def _set_rope_scaling(config, scaling: dict[str, Any], theta: float) -> None:
    """transformers >= 5 keeps scaling in rope_parameters; older versions in rope_scaling."""
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    params = getattr(config, "rope_parameters", None)
    if params and "full_attention" in params:  # Gemma 3: scaling on the global layers only
        params["full_attention"] = {**params["full_attention"], **scaling}
    elif hasattr(config, "rope_parameters"):  # keeps e.g. Phi-3's partial_rotary_factor
        config.rope_parameters = {**(params or {}), **scaling, "rope_theta": theta}
    else:
        config.rope_scaling = scaling


@torch.no_grad()
def make_tiny_checkpoint(tmp_path: Path, arch: str, **overrides: Any) -> Path:
    """Save a random tiny `arch` model (float32) under tmp_path; returns the directory.

    Overrides are config fields (tie_word_embeddings=True, rope_scaling={...}, num_hidden_layers
    ...), plus `seed` (default 0) for the random init. Norm weights and biases are randomised
    too (HF initialises them to 1 and 0), so tests notice when one is ignored.
    """
    seed = overrides.pop("seed", 0)
    _, model_cls = _config_class(arch)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") and arch.startswith("Gemma"):  # stored as w in (1 + w)
            param.copy_(0.2 * torch.randn(param.shape, generator=gen))
        elif name.endswith(("norm.weight", ".ln_1.weight", ".ln_2.weight", "ln_f.weight")):
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
        elif name.endswith(".bias"):
            param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    out = _fresh_dir(Path(tmp_path), f"tiny-{arch}")
    model.save_pretrained(out, safe_serialization=True)
    return out


def _fresh_dir(root: Path, stem: str) -> Path:
    path, n = root / stem, 1
    while path.exists():
        n += 1
        path = root / f"{stem}-{n}"
    path.mkdir(parents=True)
    return path


def load_hf_model(path: Path):
    """The transformers reference model of a checkpoint: float32, eager attention, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def greedy_ids(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """A transformers model's greedy continuation of each prompt, one at a time, never stopping
    early (slipstream's side runs with ignore_eos)."""
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
    return outs


def finish_after_abort(core, tokens: dict[str, list[int]], aborted: str) -> None:
    """Abort `aborted` on an EngineCore, then step it dry, adding every request's new tokens to
    `tokens`; the aborted request must never produce output again."""
    core.abort_requests([aborted])
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.request_id != aborted
            tokens[out.request_id] += out.new_token_ids


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius norms, in float64): the whole-tensor relative error."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (in float64): the worst element against the tensor's scale."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def skip_without_fp8() -> None:
    """In a `gpu` test: skip unless the GPU has FP8 tensor cores (compute capability 8.9+)."""
    import pytest

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
