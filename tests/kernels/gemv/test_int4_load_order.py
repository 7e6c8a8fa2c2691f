"""Where ptxas puts the whole-K int4 loop's loads (sm_90a, compiled here without a GPU by the
Triton wheel's own ptxas: tools/sass_loop.py, in a process of its own since the tests run
Triton's interpreter).

The loop keeps the next tile's words in flight during this tile's products: it turns two
buffers, each refilled right after its own products and before the other buffer's
(gemv_int4._w4_whole_k_loop_kernel). Written as one rotating buffer, ptxas issued the requests
after the products and every step waited out a whole load latency (session 27). This test
checks the order the two buffers are meant to give, for the tiles the tuner picks.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _loop_ops(*args: str) -> list[str]:
    """The loop kernel's sm_90a opcodes in order (sass_loop.py w4loop ARGS --ops: its main
    loop's)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "tools/sass_loop.py", "w4loop", *args, "--ops"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if run.returncode and "ptxas" in run.stderr.lower() and "not found" in run.stderr.lower():
        pytest.skip("no ptxas in this Triton")
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()


@pytest.mark.parametrize("args", [("--block-n", "4", "--num-warps", "2", "--gate-out"),
                                  ("--block-n", "2", "--num-warps", "4", "--whole-k", "14336")],
                         ids=["gate_up-n4-w2-gate-out", "down-n2-w4"])
def test_each_refill_is_in_flight_during_the_other_buffers_products(args):
    ops = _loop_ops(*args)
    words = [i for i, op in enumerate(ops) if op.startswith("LDG.E.128")]
    stores = [i for i, op in enumerate(ops) if op.startswith("STG")]
    # packed bf16 arithmetic (ptxas also uses HFMA2.MMA on registers as a move)
    products = [i for i, op in enumerate(ops) if "BF16_V2" in op]
    assert len(words) == 16 and len(stores) == 2  # a thread's 8 word loads per buffer
    first, second = words[:8], words[8:]
    # buffer 0's refill: after its tile's products and store, before buffer 1's products
    second_products = [i for i in products if i > stores[0]]
    assert len(second_products) > 200
    assert stores[0] < min(first) and max(first) < min(second_products)
    # buffer 1's refill: after the second tile's store (in flight during the next turn's first)
    assert min(second) > stores[1]
