"""The server through the official `openai` client and raw HTTP: completions and chat, streamed
and not, n > 1, logprobs, stop strings, usage, tokenizer routes and metrics.
"""
from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.serve.server import MAX_MODEL_LEN, MODEL

PROMPT = "hello world, the quick brown fox"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def _sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_health_version_models(server, http):
    assert httpx.get(server.base_url + "/health").status_code == 200  # no key needed
    assert http.get("/version").json()["version"]
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_completion_stream_equals_full_under_greedy(openai_client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0)
    full = openai_client.completions.create(**kwargs)
    chunks = list(openai_client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and not usage_chunks[0].choices
    assert usage_chunks[0].usage.model_dump() == full.usage.model_dump()


def test_chat_stream_equals_full_under_greedy(openai_client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0.0)
    full = openai_client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    chunks = list(openai_client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_usage_counts_match_tokenizer(openai_client, http):
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    out = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7,
                                           temperature=0.0, logprobs=0,
                                           extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 7 == len(out.choices[0].logprobs.tokens)
    assert out.usage.total_tokens == len(prompt_ids) + 7
    chat_ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    chat = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                                 extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert chat.usage.completion_tokens == 5


def test_n_and_batched_prompts(openai_client):
    out = openai_client.completions.create(model=MODEL, prompt=[PROMPT, "second prompt"], n=3,
                                           max_tokens=6, temperature=0.0,
                                           extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == list(range(6))
    by_index = {c.index: c.text for c in out.choices}
    # Greedy: every sample of one prompt is the same text.
    assert by_index[0] == by_index[1] == by_index[2]
    assert by_index[3] == by_index[4] == by_index[5]
    assert out.usage.completion_tokens == 6 * 6
    chat = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2,
                                                 max_tokens=4, temperature=1.0, seed=7)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_n_streamed_choices_match_full(openai_client):
    kwargs = dict(model=MODEL, prompt=PROMPT, n=2, max_tokens=10, temperature=0.8, seed=123)
    full = openai_client.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    for chunk in openai_client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in full.choices}


def test_completion_logprobs(openai_client):
    out = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                           temperature=0.0, logprobs=3)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0.0 and 1 <= len(top) <= 3
        # Greedy picks the most likely token: its logprob is the best of the top list.
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-4)
    assert lp.text_offset == sorted(lp.text_offset)


def test_completion_echo(openai_client):
    out = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                           temperature=0.0, echo=True)
    plain = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                             temperature=0.0)
    assert out.choices[0].text == PROMPT + plain.choices[0].text


def test_chat_logprobs(openai_client):
    out = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                                temperature=0.0, logprobs=True, top_logprobs=2,
                                                extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert math.isclose(item.logprob, item.top_logprobs[0].logprob, abs_tol=1e-4)
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text(openai_client, stream):
    base = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                            temperature=0.0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    mid = len(text) // 2
    stop = text[mid:mid + 2]
    assert len(stop) == 2, f"greedy text too short to pick a stop string: {text!r}"
    expected = text[:text.index(stop)]
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0, stop=[stop],
                  extra_body={"ignore_eos": True})
    if stream:
        chunks = list(openai_client.completions.create(stream=True, **kwargs))
        got = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        out = openai_client.completions.create(**kwargs)
        got, reason = out.choices[0].text, out.choices[0].finish_reason
    assert got == expected
    assert reason == "stop"


def test_raw_http_stream_format(server, http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])


def test_tokenize_detokenize_roundtrip(http):
    ids = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == MAX_MODEL_LEN
    text = http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == PROMPT


def test_token_id_prompt(openai_client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=5,
                                              temperature=0.0)
    by_text = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                               temperature=0.0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_metrics_exposes_engine_and_latency_series(openai_client, http):
    openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    text = http.get("/metrics").text
    for name in ("slipstream_num_requests_running", "slipstream_num_requests_waiting",
                 "slipstream_kv_cache_usage_perc", "slipstream_prefix_cache_queries_total",
                 "slipstream_prefix_cache_hits_total", "slipstream_num_preemptions_total",
                 "slipstream_prompt_tokens_total", "slipstream_generation_tokens_total",
                 'slipstream_request_success_total{finished_reason="length"',
                 "slipstream_time_to_first_token_seconds_bucket",
                 "slipstream_inter_token_latency_seconds_bucket",
                 "slipstream_e2e_request_latency_seconds_bucket",
                 "slipstream_request_queue_time_seconds_bucket"):
        assert name in text, name
