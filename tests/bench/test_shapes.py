"""Known model shapes: configs as documented, parameter counts, speed-of-light arithmetic."""
from __future__ import annotations

import pytest
import torch

from slipstream.bench.shapes import (
    SHAPES,
    count_parameters,
    kv_bytes_per_token,
    linear_parameters,
    materialize_shape,
    shape_config,
    weight_bytes,
)
from slipstream.config import ModelConfig


def test_llama_3_1_8b_has_8_03_billion_parameters():
    n = count_parameters(shape_config("llama-3.1-8b"))
    assert n == 8_030_261_248
    assert round(n / 1e9, 2) == 8.03


def test_llama_3_1_70b_has_70_55_billion_parameters():
    assert count_parameters(shape_config("llama-3.1-70b")) == 70_553_706_496


def test_qwen3_0_6b_parameter_count():
    assert count_parameters(shape_config("qwen3-0.6b")) == 596_049_920


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_count_matches_the_transformers_model(name, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(materialize_shape(name, tmp_path)))
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(cfg)
    assert type(model).__name__ == SHAPES[name]["architectures"][0]
    assert sum(p.numel() for p in model.parameters()) == count_parameters(shape_config(name))


def test_llama_shape_materializes_as_documented(tmp_path):
    d = materialize_shape("llama-3.1-8b", tmp_path / "llama")
    assert sorted(p.name for p in d.iterdir()) == ["config.json"]
    m = ModelConfig.from_dir(d)
    assert m.architecture == "LlamaForCausalLM"
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads,
            m.num_key_value_heads, m.intermediate_size, m.vocab_size) == \
        (4096, 32, 32, 8, 14336, 128256)
    assert m.rope_theta == 500000.0 and m.max_position_embeddings == 131072
    assert not m.tie_word_embeddings
    assert m.rope_scaling["rope_type"] == "llama3" and m.rope_scaling["factor"] == 8.0
    assert m.rope_scaling["low_freq_factor"] == 1.0 and m.rope_scaling["high_freq_factor"] == 4.0
    assert m.rope_scaling["original_max_position_embeddings"] == 8192


def test_qwen3_shape_materializes_as_documented():
    d = materialize_shape("qwen3-0.6b")  # default: a fresh temp dir
    m = ModelConfig.from_dir(d)
    assert m.architecture == "Qwen3ForCausalLM" and m.qk_norm and m.tie_word_embeddings
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads,
            m.head_dim, m.intermediate_size, m.vocab_size) == (1024, 28, 16, 8, 128, 3072, 151936)
    assert m.rope_theta == 1e6 and m.max_position_embeddings == 40960


def test_speed_of_light_matches_benchmarks_md():
    cfg = shape_config("llama-3.1-8b")
    # BENCHMARKS.md: 4.14 TB/s copy bandwidth -> 258 tok/s batch-1 bf16 bound.
    assert round(4.14e12 / weight_bytes(cfg, "bfloat16")) == 258
    assert kv_bytes_per_token(cfg, "bfloat16") == 2 * 32 * 8 * 128 * 2


def test_unknown_shape_names_the_known_ones():
    with pytest.raises(KeyError, match="llama-3.1-8b"):
        shape_config("gpt-5")
    a = shape_config("qwen3-0.6b")
    a["hidden_size"] = 1
    assert shape_config("qwen3-0.6b")["hidden_size"] == 1024  # copies, not the table itself


def test_weight_bytes_count_quantized_layers_at_their_width():
    cfg = shape_config("llama-3.1-8b")
    bf16 = weight_bytes(cfg, "bfloat16")
    linear = linear_parameters(cfg)
    assert linear == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)  # 6.98 G
    assert weight_bytes(cfg, "bfloat16", "fp8") == bf16 - linear
    assert weight_bytes(cfg, "bfloat16", "int8_wo") == weight_bytes(cfg, "bfloat16", "w8a8_sq")
    assert weight_bytes(cfg, "bfloat16", "int4_awq") == int(bf16 - linear * (2 - 0.5 - 3 / 128))
    head = 128256 * 4096
    assert weight_bytes(cfg, "bfloat16", "fp8", quantized_lm_head=True) == bf16 - linear - head
    assert weight_bytes(cfg, "bfloat16", "fp8", quantized_lm_head="int8_wo") == bf16 - linear - head
    assert (weight_bytes(cfg, "bfloat16", "int4_awq", quantized_lm_head="int4")  # group 128
            == int(bf16 - (linear + head) * (2 - 0.5 - 3 / 128)))
    assert weight_bytes(cfg, "bfloat16", "awq-or-unknown") == bf16  # unknown: model dtype
    tied = shape_config("qwen3-0.6b")  # a quantized tied head is a second, 1-byte copy
    assert (weight_bytes(tied, "bfloat16", None, quantized_lm_head=True)
            == weight_bytes(tied, "bfloat16") + 151936 * 1024)
