"""The Hugging Face baseline: static left-padded batches, forced lengths, useful-token count."""
from __future__ import annotations

import pytest
import torch

from slipstream.bench.datasets import BenchRequest
from slipstream.bench.hf_baseline import _left_pad, generate_batch, run_hf_baseline


def _requests() -> list[BenchRequest]:
    lens = [(5, 3), (9, 6), (4, 2), (7, 5), (3, 4)]
    return [BenchRequest(list(range(10, 10 + i)), o) for i, o in lens]


def test_left_padding_puts_prompts_at_the_right_edge():
    ids, mask = _left_pad(_requests()[:2], pad_id=0, device="cpu")
    assert ids.shape == (2, 9)
    assert ids[0].tolist() == [0, 0, 0, 0, 10, 11, 12, 13, 14]
    assert mask[0].tolist() == [0] * 4 + [1] * 5 and mask[1].tolist() == [1] * 9


def test_baseline_counts_only_useful_tokens(tiny_model_dir):
    reqs = _requests()
    res = run_hf_baseline(tiny_model_dir, reqs, dtype="float32", device="cpu", batch_size=2)
    assert res.num_batches == 3 and res.num_requests == 5 and res.batch_size == 2
    assert res.useful_output_tokens == 3 + 6 + 2 + 5 + 4
    # every row of a batch runs to the batch's longest output: 2*6 + 2*5 + 1*4
    assert res.generated_tokens == 12 + 10 + 4
    assert res.total_input_tokens == 5 + 9 + 4 + 7 + 3
    assert res.output_tok_s == pytest.approx(res.useful_output_tokens / res.wall_time_s)
    assert res.peak_gpu_memory_gib is None


def test_generation_is_forced_past_eos(tiny_model_dir):
    from slipstream.bench.hf_baseline import build_hf_model

    model = build_hf_model(tiny_model_dir, "float32", "cpu")
    assert next(model.parameters()).dtype == torch.float32
    # Make EOS (id 2) the greedy choice at every step.
    model.lm_head.register_forward_hook(
        lambda mod, inp, out: out.index_fill(-1, torch.tensor([2]), 100.0))
    ids = torch.tensor([[5, 6, 7]])
    plain = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=6, pad_token_id=0)
    assert plain.shape[1] - 3 == 1  # without forcing it stops at once
    assert generate_batch(model, [BenchRequest([5, 6, 7], 6)], "cpu") == 6


def test_baseline_rejects_bad_arguments(tiny_model_dir):
    with pytest.raises(ValueError, match="batch size"):
        run_hf_baseline(tiny_model_dir, _requests(), dtype="float32", device="cpu", batch_size=0)
    with pytest.raises(ValueError, match="dtype"):
        run_hf_baseline(tiny_model_dir, _requests(), dtype="fp8", device="cpu")
