"""The draft-tree mask of paged attention (speculative/tree.py): each row of a tree's
verification chunk sees the cached prefix and its ancestors only. The reference against a
direct per-row softmax, the CPU table and the Triton kernel (interpreter; compiled on a GPU)
against the reference, in a batch that mixes tree chunks, a causal chunk and a decode."""

from __future__ import annotations

import pytest
import torch

from slipstream.bench.attn_batch import make_batch
from slipstream.kernels import cpu, reference
from slipstream.kernels.attention.paged import AttnConfig, paged_attention
from slipstream.speculative.tree import row_masks

pytestmark = pytest.mark.usefixtures("poison_outputs")

# Seq 0: a tree of 6 nodes over 23 cached tokens; seq 1: a causal chunk; seq 2: a decode;
# seq 3: a tree chunk that crosses a 16-token tile and a page boundary.
TREE_A = [-1, -1, 0, 0, 1, 2]
TREE_B = [-1, 0, -1, 1, 2, 2, 3, 4, 5, 5, 6]
QUERY_LENS = [len(TREE_A) + 1, 5, 1, len(TREE_B) + 1]
SEQ_LENS = [30, 40, 17, 42]


def _tree_batch(dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    q, kc, vc, meta = make_batch(
        QUERY_LENS,
        SEQ_LENS,
        num_kv_heads=2,
        group=2,
        head_dim=32,
        block_size=16,
        dtype=dtype,
        device=device,
        seed=seed,
    )
    masks = row_masks(TREE_A) + [-1] * 5 + [-1] + row_masks(TREE_B)
    meta.tree_mask = torch.tensor(masks, dtype=torch.int64, device=device)
    meta.tree_mask_cpu = masks
    return q, kc, vc, meta


def _direct(q, kc, vc, meta, scale):
    """Per row: softmax over exactly the positions it may see (prefix, ancestors, itself)."""
    out = torch.zeros_like(q, dtype=torch.float32)
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for s in range(meta.num_seqs):
        ctx = lens[s] - (qsl[s + 1] - qsl[s])
        blocks = meta.block_tables[s].long()
        k = kc.index_select(0, blocks).flatten(0, 1)[: lens[s]].float()
        v = vc.index_select(0, blocks).flatten(0, 1)[: lens[s]].float()
        for r in range(qsl[s], qsl[s + 1]):
            i, bits = r - qsl[s], meta.tree_mask_cpu[r]
            seen = [p for p in range(lens[s]) if p < ctx or (p <= ctx + i and (bits >> (p - ctx)) & 1)]
            for h in range(q.shape[1]):
                kv_h = h // (q.shape[1] // k.shape[1])
                w = (k[seen, kv_h] @ q[r, h].float() * scale).softmax(0)
                out[r, h] = w @ v[seen, kv_h]
    return out


def test_reference_and_cpu_tree_mask():
    q, kc, vc, meta = _tree_batch(torch.float32)
    want = _direct(q, kc, vc, meta, 0.2)
    ref = reference.paged_attention(q, kc, vc, meta, 0.2)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu.paged_attention(q, kc, vc, meta, 0.2), ref, atol=1e-5, rtol=1e-5)
    # The mask matters: without it the tree rows differ.
    meta.tree_mask = meta.tree_mask_cpu = None
    assert not torch.allclose(reference.paged_attention(q, kc, vc, meta, 0.2)[:7], ref[:7])


@pytest.mark.parametrize(
    "cfg",
    [
        None,
        AttnConfig(block_m=16, block_n=16, num_splits=2, num_warps=4, num_stages=1),
    ],
)
def test_triton_tree_mask_interpreter(cfg):
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs only without CUDA (the GPU test compiles)")
    q, kc, vc, meta = _tree_batch(torch.float32, seed=1)
    want = reference.paged_attention(q, kc, vc, meta, 0.2)
    got = paged_attention(q, kc, vc, meta, 0.2, config=cfg)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_tree_mask_compiled(dtype):
    q, kc, vc, meta = _tree_batch(dtype, device="cuda", seed=2)
    want = reference.paged_attention(q, kc, vc, meta, 0.2).float()
    got = paged_attention(q, kc, vc, meta, 0.2).float()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
