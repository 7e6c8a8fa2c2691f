"""benchmarks/profile_steps.py (slipstream/bench/step_profile.py): kernel kinds and a step's
share of them (kernel_spans.py), the floors' arithmetic (step_floors.py), and a whole run on a
tiny CPU model."""

from __future__ import annotations

import json

import pytest

from slipstream.bench import kernel_spans as ks
from slipstream.bench import step_floors as sf
from slipstream.bench import step_profile as sp


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


def test_windows_spread_over_the_run():
    assert sp.window_starts(100, 4, 5) == [0, 32, 63, 95]
    assert sp.window_starts(3, 4, 5) == [0]


def test_profile_run_on_a_tiny_cpu_model(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = sp.main(
        [
            "--model",
            str(tiny_llama_dir),
            "--device",
            "cpu",
            "--workloads",
            "W2,W4",
            "--num-requests",
            "3",
            "--length-scale",
            "0.05",
            "--windows",
            "2",
            "--window-steps",
            "2",
            "--kv-cache-memory",
            str(8 << 20),
            "--output-json",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert (result["max_num_seqs"], result["max_num_tokens"]) == (128, 2048)  # chosen (CPU)
    w2, w4 = result["workloads"]
    assert (w2["input_len"], w2["output_len"], w4["input_len"]) == (6, 6, 102)
    for w in (w2, w4):
        assert w["profiled_steps"] >= 3 and w["kernels_per_step"] > 0  # aten ops on a CPU
        assert w["ms_per_step"]["prefill_gemm"] > 0 and w["floor_ms_per_step"]["prefill_gemm"] > 0
        assert w["ms_per_step"]["host_gap"] > 0 and 0 < w["normal_mode_idle_share"] <= 1
    # W4's prompts are 17x longer: more prefill GEMM work a step, and a larger floor.
    assert w4["floor_ms_per_step"]["prefill_gemm"] > w2["floor_ms_per_step"]["prefill_gemm"]
    table = capsys.readouterr().out
    assert "W4 102/6 x 3" in table and "attention decode" in table and "x floor" in table
