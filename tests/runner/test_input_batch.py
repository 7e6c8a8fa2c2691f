"""input_batch: the flat padding-free batch arrays for a mixed prefill/decode step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from slipstream.engine.request import Request
from slipstream.runner.input_batch import build_host_batch, prepare_inputs
from slipstream.sampling_params import SamplingParams
from slipstream.scheduler.output import ScheduledSeq


def seq(rid: str, tokens: list[int], start: int, blocks: list[int], sample: bool) -> ScheduledSeq:
    req = Request(rid, list(range(start)) + tokens, SamplingParams())
    return ScheduledSeq(req, tokens, start, blocks, sample)


def mixed_step() -> list[ScheduledSeq]:
    return [
        seq("a", [10, 11, 12, 13, 14], 0, [7, 2], True),  # whole 5-token prompt
        seq("b", [20], 6, [3, 9], True),  # decode at position 6
        seq("c", [30, 31, 32], 2, [5, 1, 4], False),  # middle chunk of a long prompt
    ]


def test_host_batch_arrays():
    hb = build_host_batch(mixed_step(), block_size=4)
    assert hb.input_ids.dtype == np.int64 and hb.input_ids.tolist() == \
        [10, 11, 12, 13, 14, 20, 30, 31, 32]
    assert hb.positions.tolist() == [0, 1, 2, 3, 4, 6, 2, 3, 4]
    assert hb.query_start_loc.dtype == np.int32 and hb.query_start_loc.tolist() == [0, 5, 6, 9]
    assert hb.seq_lens.tolist() == [5, 7, 5]
    assert hb.block_tables.dtype == np.int32
    assert hb.block_tables.tolist() == [[7, 2, 0], [3, 9, 0], [5, 1, 4]]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert hb.slot_mapping.tolist() == [28, 29, 30, 31, 8, 38, 22, 23, 4]
    assert hb.logits_indices.tolist() == [4, 5]  # last token of a and b; c is not sampled
    assert hb.sample_seq_indices == [0, 1]


def test_fixed_width_block_table_and_too_few_blocks():
    hb = build_host_batch(mixed_step(), block_size=4, max_blocks_per_seq=6)
    assert hb.block_tables.shape == (3, 6)
    with pytest.raises(ValueError, match="blocks cannot hold"):
        build_host_batch([seq("x", [1, 2, 3], 4, [0], True)], block_size=4)
    with pytest.raises(ValueError, match="zero sequences"):
        build_host_batch([], block_size=4)


def test_block_table_longer_than_the_fixed_width_is_cut():
    # Blocks reserved past what the step needs (multi-step lookahead) beyond the padded width.
    hb = build_host_batch([seq("a", [1], 3, [4, 5, 6, 7], True), seq("b", [2], 0, [8], True)],
                          block_size=4, max_blocks_per_seq=2)
    assert hb.block_tables.tolist() == [[4, 5], [8, 0]]


def test_prepare_inputs_metadata():
    inputs = prepare_inputs(mixed_step(), block_size=4, device=torch.device("cpu"))
    meta = inputs.meta
    assert meta.num_seqs == 3 and meta.num_tokens == 9
    assert meta.max_query_len == 5 and meta.max_seq_len == 7 and not meta.is_pure_decode
    assert meta.query_start_loc.dtype == torch.int32 and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc_cpu == [0, 5, 6, 9] and meta.seq_lens_cpu == [5, 7, 5]
    assert inputs.input_ids.dtype == torch.int64 and inputs.positions.dtype == torch.int64
    assert inputs.logits_indices.tolist() == [4, 5]
