"""bench/step_floors.py: the floor of each part of a step from its counted work."""

from __future__ import annotations

import pytest

from slipstream.bench import step_floors as sf

MODEL = sf.ModelShape(
    linear_params=1000,
    head_params=100,
    weight_bytes_per_param=2.0,
    layers=2,
    heads=4,
    head_dim=8,
    hidden=32,
    intermediate=64,
    kv_bytes_per_token=256,
    act_bytes=2,
)
PEAKS = sf.Peaks(gemm_flops=1e6, bf16_flops=1e6, copy_bytes=1e5)


def test_floors_count_the_work_of_a_mixed_step():
    work = sf.StepWork(prefill=[(10, 0)], decode_ctx=[50, 30], sampled=3)
    f = sf.floors(work, MODEL, PEAKS)
    # GEMMs: 2 * 12 tokens * 1000 + 2 * 3 rows * 100 FLOPs = 24,600 -> 24.6 ms, longer than
    # the 2,200 weight bytes' 22 ms; 10 of the 12 tokens are prefill.
    assert f["prefill_gemm"] == pytest.approx(0.0246 * 10 / 12)
    assert f["decode_gemm"] == pytest.approx(0.0246 * 2 / 12)
    # Decode attention reads 80 tokens of K/V; prefill: 4 * 2 * 4 * 8 * 10 * 5.5 FLOPs.
    assert f["decode_attention"] == pytest.approx(80 * 256 / 1e5)
    assert f["prefill_attention"] == pytest.approx(4 * 2 * 4 * 8 * 10 * 5.5 / 1e6)
    assert f["small"] == pytest.approx(12 * 2 * 2 * (4 * 32 + 3 * 64) / 1e5)
    assert sf.floors(sf.StepWork(), MODEL, PEAKS)["decode_gemm"] == 0.0
