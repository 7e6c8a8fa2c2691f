"""End to end: greedy output equals Hugging Face transformers token for token.

Every supported architecture, prompts of very different lengths submitted together; also with a
tiny token budget (chunked prefill), a KV budget small enough to force preemption, and repeated
prefixes (prefix-cache hits).
"""
from __future__ import annotations

import random

import pytest
import torch

from slipstream import LLM, SamplingParams
from tests.helpers import greedy_ids

ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
MAX_NEW = 12


def hf_greedy(path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return greedy_ids(model, prompts, max_new)


def random_prompts(n: int, vocab: int, seed: int, lengths=(1, 3, 17, 40, 75, 130)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def greedy(max_new: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


def test_greedy_matches_hf_mixed_lengths(checkpoint):
    prompts = random_prompts(6, 500, seed=1)
    expected = hf_greedy(checkpoint, prompts, MAX_NEW)
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", max_num_tokens=512)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_chunked_prefill_preemption_and_prefix_hits(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    shared = random_prompts(1, 500, seed=7, lengths=(48,))[0]
    prompts = random_prompts(5, 500, seed=2) + [shared + [5, 6], shared + [9]]
    expected = hf_greedy(path, prompts, MAX_NEW)
    # 16-token budget: long prompts prefill over many steps beside running decodes.
    # 16 blocks of 8 tokens cannot hold every sequence at once: preemption must happen.
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_tokens=16, block_size=8,
              kv_cache_memory=_bytes_for_blocks(path, 16, 8), max_num_seqs=8)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    # Run the shared-prefix prompts again: their full blocks come from the prefix cache.
    again = llm.generate(prompts[-2:], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected[-2:]
    assert llm.get_stats()["prefix_cache_hits"] > 0
    assert again[0].num_cached_tokens >= 40


def _bytes_for_blocks(path, num_blocks: int, block_size: int) -> int:
    import json

    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * head_dim * 4
    return num_blocks * per_block
