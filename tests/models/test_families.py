"""The families beyond Llama through the whole engine on the CPU: per-token logprobs equal to
transformers' within tolerance, and weight-only int8 at load (teacher forcing: the quantized
model scores the float model's greedy tokens)."""

from __future__ import annotations

import pytest
import torch

from slipstream import LLM, SamplingParams
from tests.helpers import load_hf_model

FAMILIES = ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel"]
PROMPTS = [list(range(5, 30)), [7, 8, 9]]  # longer than the Gemma windows, and shorter
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    return path, LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20)


def test_logprobs_match_transformers(family):
    _check_logprobs(*family)


def test_partial_rotary_decode_matches_transformers(tiny_checkpoint):
    """Phi-4-mini's partial rotary: 12 of each head's 16 dims rotate (prefill and decode)."""
    path = tiny_checkpoint("Phi3ForCausalLM", partial_rotary_factor=0.75)
    _check_logprobs(path, LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20))


def _check_logprobs(path, llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    hf = load_hf_model(path)
    for prompt, out in zip(PROMPTS, outs):
        gen = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + gen])).logits[0].float()
        want = logits.log_softmax(-1)[len(prompt) - 1 : -1]
        assert gen == want.argmax(-1).tolist()
        got = [lp[t] for lp, t in zip(out.outputs[0].logprobs, gen, strict=True)]
        ref = want.gather(1, torch.tensor(gen)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(got), ref, atol=LOGPROB_ATOL, rtol=0)


def test_int8_weight_only(family):
    path, llm = family
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    score = SamplingParams(max_tokens=1, prompt_logprobs=0)
    prompt = PROMPTS[0]
    cont = list(llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids)
    quant = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory=8 << 20, quantization="int8_wo")
    out = quant.generate([{"prompt_token_ids": prompt + cont}], score, use_tqdm=False)[0]
    lps = [out.prompt_logprobs[len(prompt) + i][t] for i, t in enumerate(cont)]
    ref = llm.generate([{"prompt_token_ids": prompt + cont}], score, use_tqdm=False)[0]
    ref_lps = [ref.prompt_logprobs[len(prompt) + i][t] for i, t in enumerate(cont)]
    diffs = [abs(a - b) for a, b in zip(lps, ref_lps)]
    assert 0 < max(diffs) < 0.1  # quantized (not the float weights), and close
