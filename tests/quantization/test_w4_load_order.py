"""Where ptxas puts the whole-K int4 loop's loads (sm_90a, compiled here without a GPU by the
Triton wheel's own ptxas: benchmarks/sass_loop.py, in a process of its own since the tests run
Triton's interpreter).

The loop requests the next tile before this tile's products so that the two overlap. Left to
itself, ptxas moves the products above those loads: the next tile is requested only after
them, and each step waits out the whole load latency. The `early` configs fence the products
behind a barrier placed after the loads (gemv_int4._zero_after_loads). This test checks the
order that the fence is meant to give.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _loop_ops(*args: str, kernel: str = "w4loop") -> list[str]:
    """A kernel's sm_90a opcodes in order (sass_loop.py KERNEL ARGS --ops: its main loop's)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "benchmarks/sass_loop.py", kernel, *args, "--ops"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if run.returncode and "ptxas" in run.stderr.lower() and "not found" in run.stderr.lower():
        pytest.skip("no ptxas in this Triton")
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()


@pytest.mark.parametrize("args", [("--block-n", "4", "--num-warps", "2"),
                                  ("--block-n", "8", "--num-warps", "4", "--gate-out")],
                         ids=["n4-w2", "n8-w4-gate-out"])
def test_early_loop_requests_the_next_tile_before_its_products(args):
    ops = _loop_ops(*args, "--early")
    fence = next(i for i, op in enumerate(ops) if op.startswith("BAR.RED.POPC"))
    loads = [i for i, op in enumerate(ops) if op.startswith("LDG")]
    # packed bf16 arithmetic (ptxas also uses HFMA2.MMA on registers as a move)
    products = [i for i, op in enumerate(ops) if "BF16_V2" in op]
    # a thread's 8 16-byte word loads, 8 zeros and 8 scales (n4 w2 and n8 w4 alike)
    assert len(loads) == 24 and max(loads) < fence
    assert len(products) > 200 and min(products) > fence


def test_without_the_fence_ptxas_issues_the_word_loads_late():
    """The reason for the fence: if this starts failing, ptxas keeps the loads where Triton
    writes them, and the `early` configs only cost their barrier."""
    ops = _loop_ops("--block-n", "4", "--num-warps", "2")
    words = [i for i, op in enumerate(ops) if op.startswith("LDG.E.128")]
    assert len(words) == 8 and min(words) > len(ops) // 2
