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

# Gemma: windows of 8 tokens (tests/helpers.FAMILY_DEFAULTS), so most prompts outgrow them.
ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
         "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel"]
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


# (arch, config overrides, KV blocks of 8 tokens). Mistral with a window on every layer: blocks
# behind it are released as requests advance, so fewer blocks are needed to force preemption.
ENGINE_CASES = [("LlamaForCausalLM", {}, 16), ("Qwen3ForCausalLM", {}, 16),
                ("MistralForCausalLM", {"sliding_window": 12}, 7), ("Gemma2ForCausalLM", {}, 16),
                ("GPT2LMHeadModel", {}, 16)]


@pytest.mark.parametrize("arch,overrides,num_blocks", ENGINE_CASES,
                         ids=[a for a, _, _ in ENGINE_CASES])
def test_chunked_prefill_preemption_and_prefix_hits(arch, overrides, num_blocks,
                                                    tiny_checkpoint):
    path = tiny_checkpoint(arch, **overrides)
    shared = random_prompts(1, 500, seed=7, lengths=(48,))[0]
    prompts = random_prompts(5, 500, seed=2) + [shared + [5, 6], shared + [9]]
    expected = hf_greedy(path, prompts, MAX_NEW)
    # 16-token budget: long prompts prefill over many steps beside running decodes.
    # The blocks cannot hold every sequence at once: preemption must happen.
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_tokens=16, block_size=8,
              kv_cache_memory=_bytes_for_blocks(path, num_blocks, 8), max_num_seqs=8)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    # Run the shared-prefix prompts again: their full blocks come from the prefix cache.
    again = llm.generate(prompts[-2:], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected[-2:]
    assert llm.get_stats()["prefix_cache_hits"] > 0
    if num_blocks >= 16:  # a 7-block cache keeps no 48-token prefix (the windowed test below does)
        assert again[0].num_cached_tokens >= 40


def test_sliding_window_holds_window_blocks(tiny_checkpoint):
    """Every layer slides (Mistral): a 300-token request in 16-token chunks holds at most the
    blocks of the window behind a chunk plus the chunk, so it runs in a cache of 8 blocks (64
    tokens) with the same tokens as transformers; full attention would need 39."""
    window, block, chunk = 12, 8, 16
    path = tiny_checkpoint("MistralForCausalLM", sliding_window=window)
    prompt = random_prompts(1, 500, seed=11, lengths=(300,))[0]
    expected = hf_greedy(path, [prompt], MAX_NEW)
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_tokens=chunk, block_size=block,
              kv_cache_memory=_bytes_for_blocks(path, 8, block), decode_steps=1)
    kv = llm.engine.scheduler.kv
    held: list[int] = []
    allocate = kv.allocate_slots

    def recording(request, *args, **kwargs):
        ok = allocate(request, *args, **kwargs)
        held.append(kv.num_held_blocks(request.request_id))
        return ok

    kv.allocate_slots = recording
    out = llm.generate([prompt], greedy(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[0]
    bound = -(-(window - 1 + chunk) // block) + 1
    assert max(held) <= bound == kv.peak_blocks(len(prompt) + MAX_NEW, chunk) == 5
    assert kv.num_blocks_for(len(prompt) + MAX_NEW) == 39  # what full attention holds
    assert llm.get_stats()["num_free_blocks"] == llm.get_stats()["num_total_blocks"] == 8
    full = tiny_checkpoint("MistralForCausalLM")  # no window: the prompt cannot fit
    llm = LLM(str(full), dtype="float32", device="cpu", max_num_tokens=chunk, block_size=block,
              kv_cache_memory=_bytes_for_blocks(full, 8, block))
    with pytest.raises(ValueError, match="needs 38 KV blocks"):
        llm.generate([prompt], greedy(), use_tqdm=False)


def _bytes_for_blocks(path, num_blocks: int, block_size: int) -> int:
    from slipstream.config import ModelConfig

    m = ModelConfig.from_dir(path)  # the standard names (GPT-2's config has its own)
    per_block = 2 * m.num_hidden_layers * block_size * m.num_key_value_heads * m.head_dim * 4
    return num_blocks * per_block
