"""The server with multi-step decoding (`--decode-steps 8`, pipelined by default) and with
`--async-scheduling`: greedy text equal to the offline engine's single-step text under
concurrency, and clients hanging up mid-stream leave every KV block free."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from slipstream import LLM, SamplingParams
from tests.serve.server import MAX_MODEL_LEN, MODEL, start_server, stop_server
from tests.serve.test_load import _cancel_mid_stream, wait_engine_idle


@pytest.fixture(scope="module", params=[["--decode-steps", "8"], ["--async-scheduling"]],
                ids=["decode-steps-8", "async-scheduling"])
def multi_step_server(request, tiny_chat_model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve_logs") / "multi_step.log"
    handle = start_server(tiny_chat_model_dir, log_path, extra=request.param)
    yield handle
    assert stop_server(handle) == 0, handle.log_tail()


async def _greedy(client: httpx.AsyncClient, prompt: str, max_tokens: int, stream: bool) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    if not stream:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]
    text = ""
    async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += "".join(c["text"] for c in event["choices"])
    return text


def test_greedy_text_matches_the_single_step_engine(multi_step_server, tiny_chat_model_dir):
    rng = random.Random(3)
    prompts = [f"prompt {i}: " + "ab" * rng.randint(0, 8) for i in range(24)]
    lengths = [rng.randint(1, 40) for _ in prompts]
    offline = LLM(str(tiny_chat_model_dir), device="cpu", dtype="float32", decode_steps=1,
                  max_model_len=MAX_MODEL_LEN)
    want = [o.outputs[0].text for o in offline.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
        use_tqdm=False)]

    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=multi_step_server.base_url,
                                     headers=multi_step_server.headers, timeout=120.0) as client:
            return await asyncio.gather(*(_greedy(client, p, n, i % 2 == 0)
                                          for i, (p, n) in enumerate(zip(prompts, lengths))))

    assert asyncio.run(main()) == want


def test_hanging_up_mid_stream_frees_everything(multi_step_server):
    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=multi_step_server.base_url,
                                     headers=multi_step_server.headers, timeout=120.0) as client:
            return await asyncio.gather(*(_cancel_mid_stream(client, i) for i in range(20)))

    assert all(seen >= 2 for seen in asyncio.run(main()))
    with httpx.Client(base_url=multi_step_server.base_url, headers=multi_step_server.headers,
                      timeout=30.0) as http:
        idle, state = wait_engine_idle(http, 30.0)
    assert idle, state
