"""benchmarks/run_gpu_suite.sh: every workload runs under its cap, failures are reported and the
summary table comes last (a stub stands in for python, so no engine or GPU is needed)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "run_gpu_suite.sh"

STUB = """#!/usr/bin/env bash
# Fake `python -m slipstream.bench.cli`: writes a minimal result; W3 fails. Else real python.
if [[ "$2" == slipstream.bench.cli ]]; then
  prev=""; for a in "$@"; do
    [[ $prev == --output-json ]] && out=$a; [[ $prev == --label ]] && label=$a; prev=$a
  done
  echo "$*" >> "$(dirname "$out")/calls.txt"
  [[ $label == W3 ]] && exit 3
  exec {py} -c "import json, sys; json.dump(dict(mode='throughput', workload='$label',
    model=dict(shape='s'), num_requests=1, output_tok_s=123.0, total_tok_s=200.0,
    baseline=None, ratio_vs_baseline=None), open('$out', 'w'))"
fi
exec {py} "$@"
"""


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and coreutils timeout")
def test_suite_runs_every_workload_and_prints_the_summary_last(tmp_path):
    stub = tmp_path / "stubpy"
    stub.write_text(STUB.replace("{py}", sys.executable))
    stub.chmod(0o755)
    results = tmp_path / "results"
    env = {**os.environ, "PYTHON": str(stub), "SUITE_BUDGET_S": "300", "W3_REQUESTS": "7"}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(SCRIPT), str(results)], cwd=SCRIPT.parents[1], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "W1: ok" in out and "W2: ok" in out and "W5: ok" in out
    assert "W3: FAILED rc=3" in out and "W3 ran 7 requests" in out
    tail = out[out.rindex("== slipstream GPU suite summary"):].splitlines()
    assert [line.split()[0] for line in tail[2:]] == ["W1", "W2", "W5"]
    calls = (results / "calls.txt").read_text().splitlines()
    assert len(calls) == 4 and "--num-requests 4000" in calls[1] and "--baseline hf" in calls[1]
    assert "--num-requests 7" in calls[2] and "--dataset w5" in calls[3]
    assert json.loads((results / "W2.json").read_text())["workload"] == "W2"
    assert (results / "suite.log").is_file()


def test_suite_skips_what_the_budget_cannot_hold(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    env = {**os.environ, "PYTHON": sys.executable, "SUITE_BUDGET_S": "10"}
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], cwd=SCRIPT.parents[1], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.count("SKIPPED") == 4
