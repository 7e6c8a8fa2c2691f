"""Tensor parallelism for the families beyond Llama: Gemma 2 / 3 (vocab-parallel embedding
scaled once after its all-reduce, GeGLU, soft-capping, sliding windows), Phi-3 (q/k/v and
gate/up fused in the checkpoint, each rank taking its rows of every shard) and GPT-2 (Conv1D
[in, out] tensors, fused c_attn, replicated learned positions). Two gloo worker ranks serve
every engine of the module; each case compares tensor_parallel_size 2 with one rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream import LLM, SamplingParams
from tests.parallel.pools import kept_pool

PROMPTS = [[1, 5, 9, 33, 7, 250, 11, 40, 41, 42], [1, 100, 200, 300, 17]]  # past Gemma's window of 8
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
ENGINE = dict(device="cpu", kv_cache_memory=4 << 20, max_model_len=64, max_num_seqs=2)


@pytest.fixture(scope="module")
def pool():
    yield from kept_pool(2)


def _generate(path: Path, **kwargs):
    llm = LLM(str(path), **ENGINE, **kwargs)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def _chosen(outputs) -> list[list[tuple[int, float]]]:
    """Each step's (token, its logprob)."""
    out = []
    for o in outputs:
        c = o.outputs[0]
        out.append(
            [
                (t, float(getattr(step[t], "logprob", step[t])))
                for t, step in zip(c.token_ids, c.logprobs, strict=True)
            ]
        )
    return out


CASES = [
    ("Gemma2ForCausalLM", {}, None),
    ("Gemma3ForCausalLM", {"num_key_value_heads": 1}, None),  # one KV head, replicated
    ("Phi3ForCausalLM", {}, None),
    ("Phi3ForCausalLM", {}, "int8_wo"),
    ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75}, None),  # Phi-4-mini's partial RoPE
    ("GPT2LMHeadModel", {}, None),
]


def _case_id(arch: str, overrides: dict, quant: str | None) -> str:
    family = arch.split("For")[0].removesuffix("LMHeadModel")
    return f"{family}-{quant or 'float'}" + ("-partial" if "partial_rotary_factor" in overrides else "")


@pytest.mark.parametrize("arch,overrides,quant", CASES, ids=[_case_id(*c) for c in CASES])
def test_tp2_equals_one_rank(pool, tiny_checkpoint, arch, overrides, quant) -> None:
    path = tiny_checkpoint(arch, **overrides)
    want = _chosen(_generate(path, quantization=quant))
    got = _chosen(_generate(path, quantization=quant, tensor_parallel_size=2))
    assert [[t for t, _ in seq] for seq in got] == [[t for t, _ in seq] for seq in want]
    if quant:  # row-parallel layers quantize each rank's half-rows: scales of their own
        return
    worst = max(
        abs(a - b) for sg, sw in zip(got, want, strict=True) for (_, a), (_, b) in zip(sg, sw, strict=True)
    )
    assert worst < 1e-4


def test_fused_checkpoint_tensor_windows_read_each_ranks_rows(tmp_path) -> None:
    """A lazy window of a memory-mapped tensor (one fused shard), narrowed again (one rank's
    rows), reads the same values as narrowing the whole tensor twice."""
    import torch
    from safetensors.torch import save_file

    from slipstream.parallel.checkpoint_slices import checkpoint_part, iterate_safetensor_slices

    whole = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)  # q 8 rows | k 2 | v 2
    save_file({"qkv": whole, "conv": whole.t().contiguous()}, str(tmp_path / "m.safetensors"))
    lazy = dict(iterate_safetensor_slices([tmp_path / "m.safetensors"], lambda name: False))
    k = checkpoint_part(lazy["qkv"], 0, 8, 2)
    assert k.shape == (2, 5)
    assert torch.equal(k.narrow(0, 1, 1), whole[9:10])
    assert torch.equal(k.materialize(), whole[8:10])
    conv_q = checkpoint_part(lazy["conv"], 1, 0, 8)  # [in, out]: shards along dim 1
    assert torch.equal(conv_q.narrow(1, 4, 4), whole.t()[:, 4:8])
    assert torch.equal(conv_q[1:3], whole.t()[1:3, :8])


def test_prequantized_fused_checkpoint_splits(pool, tiny_checkpoint, tmp_path) -> None:
    """An AWQ Phi-3: the fused qkv_proj / gate_up_proj tensors are packed eight values an int32
    along the output dim, so each shard's part is cut in proportion before the rank's rows."""
    from tests.quantization.test_int4 import _write_layout

    src = tiny_checkpoint("Phi3ForCausalLM", hidden_size=128, intermediate_size=256)
    path = _write_layout(src, tmp_path / "awq", "awq")
    want = [[t for t, _ in seq] for seq in _chosen(_generate(path))]
    assert [[t for t, _ in seq] for seq in _chosen(_generate(path, tensor_parallel_size=2))] == want
