"""ModelRunner: paging, chunked prefill, mixed batches, sampling output, prompt logprobs, sizing.

The reference is Hugging Face transformers on the same tiny random checkpoint; our KV cache is
addressed through shuffled, non-contiguous block tables so every step exercises real paging.
"""
from __future__ import annotations

import random

import pytest
import torch

from slipstream.engine.args import EngineArgs
from slipstream.engine.request import Request
from slipstream.runner.model_runner import CPU_DEFAULT_KV_BYTES, ModelRunner
from slipstream.sampling_params import SamplingParams
from slipstream.scheduler.output import ScheduledSeq, SchedulerOutput
from tests.helpers import load_hf_model, max_rel_err

BLOCK = 4
NUM_BLOCKS = 96
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_hf_model(ckpt)


def make_runner(path, **kw) -> ModelRunner:
    args = dict(model=str(path), device="cpu", dtype="float32", block_size=BLOCK)
    runner = ModelRunner(EngineArgs(**{**args, **kw}).create_engine_config())
    runner.load_model()
    runner.initialize_kv_cache(NUM_BLOCKS)
    return runner


@pytest.fixture
def runner(ckpt):
    return make_runner(ckpt)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def shuffled_blocks(n: int, seed: int, pool: list[int]) -> list[int]:
    """n distinct block ids drawn from `pool` (and removed from it), in random order."""
    rng = random.Random(seed)
    picked = rng.sample(pool, n)
    for b in picked:
        pool.remove(b)
    return picked


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def test_chunked_prefill_over_shuffled_blocks(runner, hf):
    prompt = prompt_of(45, seed=0)
    blocks = shuffled_blocks(12, seed=1, pool=list(range(NUM_BLOCKS)))
    req = Request("r", prompt, SamplingParams())
    ref = hf_logits(hf, prompt)
    start = 0
    for size in (5, 16, 1, 11, 12):  # chunk ends at 5, 21, 22, 33, 45
        seq = ScheduledSeq(req, prompt[start:start + size], start, blocks, needs_sample=True)
        logits, _ = runner.forward_logits(SchedulerOutput([seq]))
        start += size
        assert logits.shape == (1, 512)
        assert max_rel_err(logits[0], ref[start - 1]) < REL_TOL, f"chunk ending at {start}"
    one_shot = make_runner(runner.config.model_path)
    whole = ScheduledSeq(Request("w", prompt, SamplingParams()), prompt, 0, list(range(12)), True)
    assert max_rel_err(logits, one_shot.forward_logits(SchedulerOutput([whole]))[0]) < REL_TOL


def test_mixed_prefill_and_decode_batch(runner, hf):
    pool = list(range(NUM_BLOCKS))
    p_a, p_b, p_c = prompt_of(30, 2), prompt_of(9, 3), prompt_of(20, 4)
    blocks = {r: shuffled_blocks(10, seed=i, pool=pool) for i, r in enumerate("abc")}
    reqs = {r: Request(r, p, SamplingParams()) for r, p in zip("abc", (p_a, p_b, p_c))}
    # Step 1: a's first 17 tokens (no sample), b's whole prompt but its last token.
    runner.forward_logits(SchedulerOutput([
        ScheduledSeq(reqs["a"], p_a[:17], 0, blocks["a"], False),
        ScheduledSeq(reqs["b"], p_b[:8], 0, blocks["b"], False),
    ]))
    # Step 2: b decodes its last token, a finishes its prompt, c arrives whole; all sampled.
    logits, inputs = runner.forward_logits(SchedulerOutput([
        ScheduledSeq(reqs["b"], p_b[8:], 8, blocks["b"], True),
        ScheduledSeq(reqs["a"], p_a[17:], 17, blocks["a"], True),
        ScheduledSeq(reqs["c"], p_c, 0, blocks["c"], True),
    ]))
    assert inputs.meta.num_tokens == 1 + 13 + 20
    for row, prompt in enumerate((p_b, p_a, p_c)):
        assert max_rel_err(logits[row], hf_logits(hf, prompt)[-1]) < REL_TOL


def test_decode_steps_match_transformers(runner, hf):
    tokens = prompt_of(10, 5)
    blocks = shuffled_blocks(5, seed=6, pool=list(range(NUM_BLOCKS)))
    req = Request("d", tokens[:7], SamplingParams())
    runner.forward_logits(SchedulerOutput([ScheduledSeq(req, tokens[:7], 0, blocks, True)]))
    ref = hf_logits(hf, tokens)
    for pos in range(7, 10):  # one decode token per step
        logits, inputs = runner.forward_logits(
            SchedulerOutput([ScheduledSeq(req, [tokens[pos]], pos, blocks, True)]))
        assert inputs.meta.is_pure_decode
        assert max_rel_err(logits[0], ref[pos]) < REL_TOL


def test_execute_model_greedy_samples_only_needs_sample(runner, hf):
    pytest.importorskip("slipstream.sampling.sampler")
    p_a, p_b = prompt_of(12, 7), prompt_of(25, 8)
    a = Request("a", p_a, SamplingParams(temperature=0.0, logprobs=2))
    b = Request("b", p_b, SamplingParams(temperature=0.0))
    out = runner.execute_model(SchedulerOutput([
        ScheduledSeq(a, p_a, 0, [5, 3, 40], True),
        ScheduledSeq(b, p_b[:10], 0, [8, 1, 17, 60, 2, 33, 9], False),
    ]))
    expected = int(hf_logits(hf, p_a)[-1].argmax())
    assert out.sampled_token_ids == {"a": [expected]}
    assert set(out.logprobs) == {"a"} and expected in out.logprobs["a"][0]
    assert out.prompt_logprobs == {}
    assert runner.execute_model(SchedulerOutput()).sampled_token_ids == {}


def test_prompt_logprobs_across_chunks(runner, hf):
    prompt = prompt_of(23, 9)
    req = Request("p", prompt, SamplingParams(prompt_logprobs=3))
    blocks = shuffled_blocks(6, seed=10, pool=list(range(NUM_BLOCKS)))
    entries: list = []
    for start, end in ((0, 9), (9, 10), (10, 23)):
        out = runner.execute_model(SchedulerOutput(
            [ScheduledSeq(req, prompt[start:end], start, blocks, needs_sample=False)]))
        entries += out.prompt_logprobs["p"]
        assert len(entries) == min(end + 1, len(prompt))
    ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
    assert entries[0] is None
    for pos in range(1, len(prompt)):
        entry, row = entries[pos], ref[pos - 1]
        top = row.topk(3).indices.tolist()
        assert set(entry) == set(top) | {prompt[pos]}
        for token, lp in entry.items():
            assert abs(lp - row[token].item()) < 1e-4
    req.output_token_ids.append(1)  # recompute after preemption: nothing re-emitted
    out = runner.execute_model(SchedulerOutput(
        [ScheduledSeq(req, prompt[:9], 0, blocks, needs_sample=False)]))
    assert out.prompt_logprobs == {}


def test_kv_cache_sizing(ckpt):
    runner = ModelRunner(EngineArgs(model=str(ckpt), device="cpu", dtype="float32",
                                    block_size=8).create_engine_config())
    # 2 (k, v) * 2 layers * 8 tokens * 2 kv heads * 16 dims * 4 bytes
    per_block = 2 * 2 * 8 * 2 * 16 * 4
    assert runner.kv_cache_bytes_per_block() == per_block
    assert runner.determine_num_blocks() == CPU_DEFAULT_KV_BYTES // per_block
    budget = ModelRunner(runner.config.replace(
        cache=runner.config.cache.__class__(block_size=8, kv_cache_memory=per_block * 10 + 5)))
    assert budget.determine_num_blocks() == 10
    bf16 = ModelRunner(runner.config.replace(dtype="bfloat16"))
    assert bf16.kv_cache_bytes_per_block() == per_block // 2
    runner.initialize_kv_cache(7)
    assert len(runner.kv_caches) == 2
    for k, v in runner.kv_caches:
        assert k.shape == v.shape == (7, 8, 2, 16) and k.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.gpu_alone  # profiles the free memory: a neighbour's allocations would change it
def test_cuda_profiled_budget_and_parity(ckpt):
    """Run on a GPU: `python -m pytest -q -m gpu tests/runner/test_model_runner.py`."""
    cpu = make_runner(ckpt)
    gpu = ModelRunner(EngineArgs(model=str(ckpt), device="cuda", dtype="float32",
                                 block_size=BLOCK, max_num_tokens=512).create_engine_config())
    gpu.load_model()
    num_blocks = gpu.determine_num_blocks()
    assert num_blocks > NUM_BLOCKS
    gpu.initialize_kv_cache(num_blocks)
    prompt = prompt_of(45, 11)
    seq = ScheduledSeq(Request("g", prompt, SamplingParams()), prompt, 0, list(range(12)), True)
    ours = gpu.forward_logits(SchedulerOutput([seq]))[0].cpu()
    assert max_rel_err(ours, cpu.forward_logits(SchedulerOutput([seq]))[0]) < 1e-3
