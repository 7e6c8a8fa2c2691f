"""/v1/completions with use_beam_search on the session's server: the n best beams of best_of
equal transformers' beam search, usage counted, and the fields beam search refuses."""
from __future__ import annotations

import pytest
import torch

from tests.serve.server import MODEL


@torch.no_grad()
def test_beam_search_completion_matches_transformers(http, openai_client, tiny_chat_model_dir):
    from transformers import AutoTokenizer

    from tests.helpers import load_hf_model

    prompt = [5, 17, 99, 250, 8, 41, 3]
    body = {"model": MODEL, "prompt": prompt, "use_beam_search": True, "n": 2, "best_of": 3,
            "max_tokens": 6, "ignore_eos": True, "length_penalty": 0.5}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    hf = load_hf_model(tiny_chat_model_dir)
    g = hf.generate(torch.tensor([prompt]), num_beams=3, do_sample=False, early_stopping=True,
                    max_new_tokens=6, num_return_sequences=3, eos_token_id=None, pad_token_id=0,
                    length_penalty=0.5)
    tok = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    want = [tok.decode(row[len(prompt):], skip_special_tokens=True,
                       clean_up_tokenization_spaces=False) for row in g[:2]]
    assert [c["text"] for c in out["choices"]] == want
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"] == {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19}
    # The openai client sends vLLM's extra fields through extra_body.
    res = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, n=2,
                                           extra_body={"use_beam_search": True, "best_of": 3,
                                                       "ignore_eos": True, "length_penalty": 0.5})
    assert [c.text for c in res.choices] == want


@pytest.mark.parametrize("extra,param", [
    ({"stream": True}, "stream"), ({"temperature": 0.7}, "temperature"),
    ({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 11}, "best_of"),
    ({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop")])
def test_beam_search_refuses_what_it_cannot_honour(http, extra, param):
    body = {"model": MODEL, "prompt": "hello", "use_beam_search": True, "max_tokens": 4, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
