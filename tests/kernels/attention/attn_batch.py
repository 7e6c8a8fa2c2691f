"""Random mixed prefill/decode batches over a shuffled paged KV cache, for attention tests."""
from __future__ import annotations

import torch

from slipstream.attention.backend import AttentionMetadata


def make_batch(
    query_lens: list[int], seq_lens: list[int], *, num_kv_heads: int, group: int, head_dim: int,
    block_size: int, dtype: torch.dtype, device: str = "cpu", extra_blocks: int = 3,
    pad_tokens: int = 0, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q [T, Hq, D], k_cache, v_cache (random, shuffled block tables) and the metadata.

    pad_tokens extra query rows after the last sequence mimic CUDA-graph padding.
    """
    gen = torch.Generator().manual_seed(seed)
    # Random values drawn on the device itself: GPU cases reach gigabytes of KV cache.
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    max_blocks = max(blocks_per_seq + [1]) + 2
    tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    slots: list[int] = []
    used = 0
    for i, (n, q_len, s_len) in enumerate(zip(blocks_per_seq, query_lens, seq_lens)):
        tables[i, :n] = perm[used:used + n]
        used += n
        for pos in range(s_len - q_len, s_len):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    slots += [-1] * pad_tokens
    num_tokens = sum(query_lens) + pad_tokens
    hq = num_kv_heads * group
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    q = torch.randn((num_tokens, hq, head_dim), generator=dev_gen, device=device).to(dtype)
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(
        num_seqs=len(seq_lens), num_tokens=num_tokens,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens + [0]), max_seq_len=max(seq_lens + [0]),
        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens),
    )
    return q, k_cache, v_cache, meta
