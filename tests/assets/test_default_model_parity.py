"""Greedy generation of the default model's format: slipstream equals transformers, token for token.

Runs on the tiny checkpoint the pipeline writes (always) and on the shipped models (when
present): bf16 weights, tied embeddings, BOS added by the tokenizer, chat template.
"""

from __future__ import annotations

import pytest
import torch

from slipstream import assets

PROMPTS = ["def add(a, b):", "import os\n\nclass Config:\n    def __init__(self", "x = ["]
MAX_NEW = 16


def _hf_greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=1)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def _check_parity(model_dir) -> None:
    from transformers import AutoTokenizer

    from slipstream import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p).input_ids for p in PROMPTS]
    chat = tok.apply_chat_template([{"role": "user", "content": "Reverse a list."}],
                                   add_generation_prompt=True, tokenize=False)
    prompts.append(tok(chat, add_special_tokens=False).input_ids)
    expected = _hf_greedy(model_dir, prompts)
    llm = LLM(str(model_dir), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("name", ["default_model", "draft_model"])
def test_tiny_pipeline_checkpoint_matches_hf(tiny_run, name):
    out, _ = tiny_run
    _check_parity(out / "models" / name)


@pytest.mark.skipif(not assets.has_default_model(), reason="embedded models not trained yet")
def test_shipped_models_match_hf():
    _check_parity(assets.default_model_path())
    _check_parity(assets.default_draft_model_path())
