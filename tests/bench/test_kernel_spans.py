"""bench/kernel_spans.py: kernels sorted by kind, and a step's share of them."""

from __future__ import annotations

import pytest

from slipstream.bench import kernel_spans as ks
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


@pytest.mark.parametrize(
    "name, kind",
    [
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", "gemm"),
        ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "gemm"),
        ("_w4_gemv_kernel", "gemm"),
        ("aten::addmm", "gemm"),
        ("_paged_attn_kernel", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("_add_rms_norm_kernel", "small"),
        ("_act_and_mul_kernel", "small"),
        ("_final_argmax_kernel", "small"),
    ],
)
def test_kernel_kinds(name, kind):
    assert ks.classify(name) == kind


def test_a_steps_kernels_are_split_by_kind_and_side():
    work = sf.StepWork(prefill=[(10, 0)], decode_ctx=[50, 30], sampled=3)
    spans = [
        ks.Span("gemm", 100, 160, "gemm"),
        ks.Span("attn", 160, 180, "attention"),
        ks.Span("norm", 170, 190, "small"),  # overlaps the attention: busy once
        ks.Span("next step", 400, 410, "gemm"),
    ]
    parts = ks.attribute((90, 300), spans, work, sf.floors(work, MODEL, PEAKS))
    assert parts["prefill_gemm"] + parts["decode_gemm"] == pytest.approx(60e-6)
    assert parts["prefill_gemm"] == pytest.approx(50e-6)
    f = sf.floors(work, MODEL, PEAKS)
    share = f["prefill_attention"] / (f["prefill_attention"] + f["decode_attention"])
    assert parts["prefill_attention"] == pytest.approx(20e-6 * share)
    assert parts["small"] == pytest.approx(20e-6)
    assert parts["host_gap"] == pytest.approx((210 - 90) * 1e-6)  # 210 us of 300 - 90 idle
    assert ks.busy_time(spans[:3]) == 90
