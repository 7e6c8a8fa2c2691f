"""benchmarks/profile_steps.py (bench/step_profile.py): windows over a run, and a whole run on a
tiny CPU model (its parts: test_kernel_spans.py, test_step_floors.py)."""

from __future__ import annotations

import json

from slipstream.bench import step_profile as sp


def test_windows_spread_over_the_run():
    assert sp.window_starts(100, 4, 5) == [0, 32, 63, 95]
    assert sp.window_starts(3, 4, 5) == [0]
    assert sp.window_starts(10, 4, 4) == [0, 4]  # 0, 2, 4, 6 would overlap


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
