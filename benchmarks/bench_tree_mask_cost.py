"""What the tree variant of the attention kernel costs a step that verifies no tree (one GPU,
~20 s).

An engine that can draft trees captures every prefill graph with the tree variant
(runner/prefill_graphs.py), so its plain prefill and decode steps run it with a mask of -1
(plain causal) on every row. Per batch (Llama-3.1-8B heads, bf16, page 16) this times the
attention kernel without a mask and with all rows -1, and a tree verification (rows of a
medusa-like tree) for scale; each call is a CUDA-graph replay, as in the engine.

    python benchmarks/bench_tree_mask_cost.py [--output-json $OUT/tree_mask.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import triton.testing

from slipstream.bench.attn_batch import make_batch
from slipstream.kernels.attention import paged as pa
from slipstream.speculative import tree

HQ, HKV, D = 32, 8, 128
# (name, query lengths, sequence lengths): prompts padded to graph sizes, a prompt beside
# decodes, and verification-sized chunks after long contexts.
CASES = [
    ("prefill 64", [64], [64]),
    ("prefill 256", [256], [256]),
    ("prefill 512", [512], [512]),
    ("prompt 200 + 7 decodes", [200] + [1] * 7, [200] + [1000] * 7),
    ("chunk 21 after 1000, x1", [21], [1021]),
    ("chunk 21 after 1000, x8", [21] * 8, [1021] * 8),
]


def _time_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3


def _tree_rows(query_lens: list[int]) -> torch.Tensor:
    """Each chunk's rows as a breadth-first tree of its length (medusa's default shape)."""
    rows = []
    for n in query_lens:
        if n == 1:
            rows.append(-1)
            continue
        paths = tree.default_tree(depth=4, num_nodes=n - 1, width=4)
        rows += tree.row_masks(tree.parents_of(paths))
    return torch.tensor(rows, dtype=torch.int64, device="cuda")


def run_case(name: str, query_lens: list[int], seq_lens: list[int]) -> dict:
    q, kc, vc, meta = make_batch(
        query_lens,
        seq_lens,
        num_kv_heads=HKV,
        group=HQ // HKV,
        head_dim=D,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
    )
    plain_rows = torch.full((q.shape[0],), -1, dtype=torch.int64, device="cuda")
    metas = {"no mask": meta, "mask all -1": dataclasses.replace(meta, tree_mask=plain_rows)}
    if max(query_lens) <= tree.MAX_TREE_TOKENS:
        metas["tree rows"] = dataclasses.replace(meta, tree_mask=_tree_rows(query_lens))
    expect = pa.paged_attention(q, kc, vc, meta, D**-0.5)
    same = torch.equal(pa.paged_attention(q, kc, vc, metas["mask all -1"], D**-0.5), expect)
    row = {"case": name, "same_output": same}
    for tag, m in metas.items():
        row[tag] = _time_us(lambda m=m: pa.paged_attention(q, kc, vc, m, D**-0.5))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    rows = [run_case(*case) for case in CASES]
    print(f"{'case':<26} {'no mask us':>10} {'all -1 us':>10} {'ratio':>6} {'tree us':>8}  same")
    for r in rows:
        tree_us = f"{r['tree rows']:8.1f}" if "tree rows" in r else f"{'-':>8}"
        print(
            f"{r['case']:<26} {r['no mask']:10.1f} {r['mask all -1']:10.1f} "
            f"{r['mask all -1'] / r['no mask']:6.2f} {tree_us}  {r['same_output']}"
        )
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1)
        )


if __name__ == "__main__":
    main()
