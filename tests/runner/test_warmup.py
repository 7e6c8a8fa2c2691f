"""The start-up warm-up compiles the attention kernel variants the first requests need (a Triton
compile takes about a second while a request waits: W6's TTFT p99 was 1.1 s)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slipstream.kernels.attention import paged as pa
from slipstream.runner.model_runner import _warmup_seqs, warmup_batches


def _variant(batch: list[tuple[int, int]]) -> tuple:
    """The attention kernel's compile-time choices for a batch of (tokens fed, cached) seqs, on
    an H200 (132 SMs) with Llama-3.1-8B's heads (8 KV heads of 4 queries, head_dim 128)."""
    meta = SimpleNamespace(num_seqs=len(batch), num_tokens=sum(n for n, _ in batch),
                           max_query_len=max(n for n, _ in batch),
                           max_seq_len=max(n + start for n, start in batch))
    cfg = pa.choose_config(meta, 8, 4, 128, torch.device("cuda"), torch.bfloat16)
    decode_kernel = meta.max_query_len <= 1 and cfg.num_splits == 1
    return (decode_kernel, cfg.num_splits > 1, cfg.block_m, cfg.block_n, cfg.num_warps,
            cfg.num_stages)


@pytest.mark.parametrize("block_size", [16, 32])
def test_warmup_covers_first_requests_attention(monkeypatch, block_size: int) -> None:
    monkeypatch.setattr(pa, "num_sms", lambda device: 132)
    compiled = {_variant(batch) for batch in warmup_batches(block_size)}
    first_requests = [
        [(467, 0)],  # W6's prompt alone: split across the KV range (few programs)
        [(7, 0)], [(150, 0)], [(2048, 0)],  # short, medium, a whole token budget
        [(467, 0), (1, 500)],  # a prompt beside a running decode
        [(1, 30)],  # a short decode outside the CUDA graphs
    ]
    for batch in first_requests:
        assert _variant(batch) in compiled, batch


def test_warmup_seqs_use_separate_blocks() -> None:
    seqs = _warmup_seqs([(17, 0), (1, 16), (32, 96)], 16)
    assert [s.block_ids for s in seqs] == [[0, 1], [2, 3], list(range(4, 13))]  # 128 + 1 slots
    assert [(s.num_tokens, s.start_pos) for s in seqs] == [(17, 0), (1, 16), (32, 96)]
    assert all(len(s.request.prompt_token_ids) == s.start_pos + s.num_tokens for s in seqs)


def test_engine_start_runs_the_greedy_choices(tiny_llama_dir, monkeypatch) -> None:
    """Start-up runs the sampler's greedy argmax and the multi-step argmax + advance once (their
    Triton kernels compile then, not on a first greedy request)."""
    from slipstream import LLM
    from slipstream.runner import cuda_graphs
    from slipstream.sampling import sampler

    calls = []
    real_argmax, real_ops = sampler._argmax, cuda_graphs._greedy_ops

    def counting_ops(device):
        advance, argmax = real_ops(device)
        return (lambda *a, **kw: (calls.append("advance"), advance(*a, **kw))[1]), argmax

    monkeypatch.setattr(sampler, "_argmax", lambda x: (calls.append("argmax"), real_argmax(x))[1])
    monkeypatch.setattr(cuda_graphs, "_greedy_ops", counting_ops)
    path = tiny_llama_dir
    LLM(str(path), kv_cache_memory=16 << 20)  # decode_steps 8: the multi-step path exists
    assert "argmax" in calls and "advance" in calls
    calls.clear()
    LLM(str(path), kv_cache_memory=16 << 20, decode_steps=1)
    assert calls == ["argmax"] * calls.count("argmax") and calls  # no multi-step path
