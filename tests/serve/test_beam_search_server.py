"""/v1/completions with use_beam_search on the session's server: the n best beams of best_of
equal transformers' beam search, usage counted, streamed deltas that join to the unstreamed
choices, and the fields beam search refuses."""
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
    ({"temperature": 0.7}, "temperature"),
    ({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 11}, "best_of"),
    ({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop")])
def test_beam_search_refuses_what_it_cannot_honour(http, extra, param):
    body = {"model": MODEL, "prompt": "hello", "use_beam_search": True, "max_tokens": 4, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_streamed_beams_join_to_the_unstreamed_choices(http, openai_client):
    """Two prompts, echo and usage: each choice's deltas join to exactly its unstreamed text;
    the settled start streams before the search ends (several deltas per choice)."""
    prompts = ["hello world", "the quick brown"]
    extra = {"use_beam_search": True, "best_of": 3, "ignore_eos": True, "length_penalty": 0.5}
    kw = dict(model=MODEL, prompt=prompts, max_tokens=8, n=2, echo=True, extra_body=extra)
    full = openai_client.completions.create(**kw)
    chunks = list(openai_client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw))
    texts: dict[int, list[str]] = {}
    reasons: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts.setdefault(choice.index, []).append(choice.text)
        if choice.finish_reason is not None:
            assert choice.index not in reasons  # one finish per choice, at its end
            reasons[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2, 3]
    for c in full.choices:
        assert "".join(texts[c.index]) == c.text
        assert reasons[c.index] == c.finish_reason
    assert texts[2][0].startswith("the quick brown")  # echo comes first
    assert max(len([t for t in parts if t]) for parts in texts.values()) > 2
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
