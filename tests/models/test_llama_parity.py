"""Logits of a whole prompt equal Hugging Face transformers' (float32, eager) within 1e-4.

Every supported architecture, plus llama3 RoPE scaling, tied embeddings, Qwen2 q/k/v bias and
Qwen3 q/k norm (the last two are simply the Qwen2/Qwen3 cases: the factory randomises biases
and norm weights so an ignored one changes the logits).
"""
from __future__ import annotations

import pytest
import torch

from slipstream.engine.args import EngineArgs
from slipstream.engine.request import Request
from slipstream.runner.input_batch import prepare_inputs
from slipstream.runner.model_runner import ModelRunner
from slipstream.sampling_params import SamplingParams
from slipstream.scheduler.output import ScheduledSeq
from tests.helpers import load_hf_model, max_rel_err

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)]}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
CASES = [
    ("LlamaForCausalLM", {}),
    ("MistralForCausalLM", {}),
    ("Qwen2ForCausalLM", {}),
    ("Qwen3ForCausalLM", {}),
    ("LlamaForCausalLM", {"rope_scaling": LLAMA3}),
    ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    ("Qwen3ForCausalLM", {"tie_word_embeddings": True, "rope_scaling": LLAMA3}),
    ("LlamaForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 4}),  # plain MHA
    ("LlamaForCausalLM", {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 8}),
    # Sliding windows shorter than the prompt: every layer (Mistral), layers past the first (Qwen2)
    ("MistralForCausalLM", {"sliding_window": 16}),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 12,
                          "max_window_layers": 1}),
    # tests/helpers.FAMILY_DEFAULTS: windows of 8, soft-capping, query_pre_attn_scalar 24
    ("Gemma2ForCausalLM", {}),
    ("Gemma3ForCausalLM", {}),
    ("Gemma3ForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    ("Phi3ForCausalLM", {}),  # q/k/v and gate/up fused in the checkpoint
    # The 45-token prompt stays inside the original context (see tests/layers/test_rotary.py)
    ("Phi3ForCausalLM", {"original_max_position_embeddings": 64, "rope_scaling": LONGROPE}),
    ("Phi3ForCausalLM", {"sliding_window": 10}),
    # Partial rotary (Phi-4-mini): 12 of the 16 dims of each head rotate, the rest pass through
    ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75}),
    ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
                         "rope_scaling": {**LONGROPE, "short_factor": LONGROPE["short_factor"][:6],
                                          "long_factor": LONGROPE["long_factor"][:6]}}),
    ("LlamaForCausalLM", {"rope_scaling": YARN}),
    ("Qwen2ForCausalLM", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}),
    ("GPT2LMHeadModel", {}),
    ("GPT2LMHeadModel", {"activation_function": "gelu", "tie_word_embeddings": False}),
]
REL_TOL = 1e-4


def make_runner(path, block_size: int = 4, num_blocks: int = 64) -> ModelRunner:
    config = EngineArgs(model=str(path), device="cpu", dtype="float32",
                        block_size=block_size).create_engine_config()
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    return runner


def full_logits(runner: ModelRunner, prompt: list[int], block_ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, one prefill step through the paged cache."""
    req = Request("r", prompt, SamplingParams())
    seq = ScheduledSeq(req, prompt, 0, block_ids, needs_sample=True)
    inputs = prepare_inputs([seq], runner.block_size, runner.device)
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
        return runner.model.compute_logits(hidden)


def hf_logits(path, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return load_hf_model(path)(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("arch,overrides", CASES,
                         ids=[f"{a}-{'-'.join(o) or 'base'}" for a, o in CASES])
def test_prompt_logits_match_transformers(tiny_checkpoint, arch, overrides):
    path = tiny_checkpoint(arch, **overrides)
    runner = make_runner(path)
    prompt = torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = full_logits(runner, prompt, block_ids=list(range(12)))
    ref = hf_logits(path, prompt)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert max_rel_err(ours, ref) < REL_TOL


def test_rope_scaling_changes_logits(tiny_checkpoint):
    """Guards the test above: with llama3 scaling dropped our logits must move."""
    import dataclasses

    path = tiny_checkpoint("LlamaForCausalLM", rope_scaling=LLAMA3)
    runner = make_runner(path)
    assert runner.config.model.rope_scaling["rope_type"] == "llama3"
    prompt = list(range(3, 48))
    scaled = full_logits(runner, prompt, list(range(12)))
    unscaled_cfg = runner.config.replace(
        model=dataclasses.replace(runner.config.model, rope_scaling=None))
    plain = ModelRunner(unscaled_cfg)
    plain.load_model()
    plain.initialize_kv_cache(64)
    assert max_rel_err(full_logits(plain, prompt, list(range(12))), scaled) > 1e-2


def test_l2_prefetch_tables_cover_o_then_gate_up(tiny_llama_dir):
    """attach_l2_prefetch: each layer's attention gets spans over all of its o_proj, then the same
    leading share of its gate/up tensors, within the budget; 0 detaches."""
    runner = make_runner(tiny_llama_dir)
    model = runner.model
    layer = model.model.layers[0]
    o_w, gu_w = layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight
    o_bytes = o_w.numel() * o_w.element_size()
    budget = o_bytes + (gu_w.numel() * gu_w.element_size()) // 4
    assert model.attach_l2_prefetch(budget) == budget
    for layer in model.model.layers:
        table = layer.self_attn.attn.l2_prefetch.tolist()
        o_w, gu_w = layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight
        assert table[0][0] == o_w.data_ptr() and sum(n for _, n in table) == budget
        assert sum(n for a, n in table if a < o_w.data_ptr() + o_bytes
                   and a >= o_w.data_ptr()) == o_bytes
        assert any(a == gu_w.data_ptr() for a, _ in table)
    assert model.attach_l2_prefetch(0) == 0
    assert all(layer.self_attn.attn.l2_prefetch is None for layer in model.model.layers)


def test_gpt2_openai_checkpoint_names(tiny_checkpoint, tmp_path):
    """OpenAI's GPT-2 files: no `transformer.` prefix, causal-mask buffers saved as tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("GPT2LMHeadModel")
    tensors = load_file(src / "model.safetensors")
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()
               if k != "lm_head.weight"}
    renamed["h.0.attn.bias"] = torch.ones(1, 1, 8, 8)
    shutil.copy(src / "config.json", tmp_path / "config.json")
    save_file(renamed, tmp_path / "model.safetensors")
    prompt = list(range(3, 30))
    ours = full_logits(make_runner(tmp_path), prompt, list(range(8)))
    assert max_rel_err(ours, hf_logits(src, prompt)) < REL_TOL


def test_gemma_config_without_tie_flag_ties(tiny_checkpoint, tmp_path):
    """Gemma's configs often omit tie_word_embeddings: the head is the embedding all the same."""
    import json
    import shutil

    src = tiny_checkpoint("Gemma2ForCausalLM")
    shutil.copytree(src, tmp_path / "g", dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    cfg.pop("tie_word_embeddings", None)
    (tmp_path / "g" / "config.json").write_text(json.dumps(cfg))
    prompt = list(range(3, 20))
    ours = full_logits(make_runner(tmp_path / "g"), prompt, list(range(8)))
    assert max_rel_err(ours, hf_logits(src, prompt)) < REL_TOL


def test_gemma_written_checkpoint_keeps_norm_weights(tiny_checkpoint):
    """Norms hold 1 + w once loaded; a checkpoint written from the model has w again."""
    from safetensors.torch import load_file

    from slipstream.quantization.checkpoint import checkpoint_tensors

    src = tiny_checkpoint("Gemma3ForCausalLM")
    written = checkpoint_tensors(make_runner(src).model)
    original = load_file(src / "model.safetensors")
    norms = [n for n in original if n.endswith("norm.weight")]
    assert len(norms) == 2 * 6 + 1  # 4 + q/k a layer, the final norm
    for name in norms:
        torch.testing.assert_close(written[name].float(), original[name], atol=1e-6, rtol=0)


def test_written_float_checkpoint_is_the_original(tiny_checkpoint):
    """A float model written back (benchmarks/startup.py writes its random checkpoints so) has
    the checkpoint's tensors under their names: fused q/k/v and gate/up split again."""
    from safetensors.torch import load_file

    from slipstream.quantization.checkpoint import checkpoint_tensors

    src = tiny_checkpoint("LlamaForCausalLM")
    written = checkpoint_tensors(make_runner(src).model)
    original = load_file(src / "model.safetensors")
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name


@torch.no_grad()
def test_gemma3_multimodal_checkpoint_served_as_text(tmp_path):
    """Gemma3ForConditionalGeneration: its language model's logits on a text prompt, the vision
    tower and projector skipped, the settings read from text_config."""
    from transformers import Gemma3Config, SiglipVisionConfig
    from transformers import Gemma3ForConditionalGeneration as HFGemma3

    from tests.helpers import tiny_config

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=tiny_config("Gemma3ForCausalLM").to_dict(),
                          vision_config=vision.to_dict(), mm_tokens_per_image=4)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    hf = HFGemma3(config).float().eval()
    for name, param in hf.named_parameters():
        if name.endswith("norm.weight"):
            param.normal_(0.0, 0.2)
    hf.save_pretrained(tmp_path)
    prompt = list(range(3, 40))
    ours = full_logits(make_runner(tmp_path), prompt, list(range(10)))
    ref = hf(torch.tensor([prompt])).logits[0].float()
    assert max_rel_err(ours, ref) < REL_TOL
