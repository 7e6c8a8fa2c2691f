"""benchmarks/bench_host.py: the engine's host loop with a stub runner finishes every request
with its full output and reports the step count of W2's schedule (waves of prefill + decode)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host.py"


def test_bench_host_small_batch(tmp_path):
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, str(SCRIPT), "--num-requests", "24", "--input-len", "16",
                    "--output-len", "20", "--max-num-seqs", "8", "--repeat", "1",
                    "--output-json", str(out)], check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    # 3 waves of 8: one prefill step each, then 20 tokens: 1 from the prefill, then 8 + 8 + 3.
    assert result["engine_steps"] == 3 * 4
    assert result["queued_decodes"] == 3 * 2  # the 8 and the 3 follow the first 8 unread
    assert result["host_s"] > 0 and len(result["runs"]) == 1
    phases = result["phases_s"]
    assert set(phases) == {"schedule", "plan", "update", "outputs"}
    assert 0 < sum(phases.values()) <= result["host_s"]
