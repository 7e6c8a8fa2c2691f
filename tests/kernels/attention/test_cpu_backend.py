"""The CPU attention backend (attention/cpu_backend.py): rotation, K/V write and attention
bit-identical to the reference backend over the same CPU op table, per-step inputs built once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slipstream.attention import cpu_backend
from slipstream.attention.cpu_backend import CpuAttentionBackend
from slipstream.attention.reference import ReferenceAttentionBackend
from slipstream.bench.attn_batch import make_batch
from slipstream.kernels import get_ops, reference
from slipstream.kernels.cpu import cpu_ops
from slipstream.layers.attention import get_attention_backend
from slipstream.layers.rotary import build_cos_sin_cache

HKV, GROUP, D = 2, 3, 32


def _inputs(query_lens, seq_lens, dtype=torch.float32, pad_tokens=0, adjacent=True):
    q, kc, vc, meta = make_batch(
        query_lens,
        seq_lens,
        num_kv_heads=HKV,
        group=GROUP,
        head_dim=D,
        block_size=8,
        dtype=dtype,
        pad_tokens=pad_tokens,
        seed=len(seq_lens),
    )
    t = q.shape[0]
    qkv = torch.randn(t, (HKV * GROUP + 2 * HKV) * D, generator=torch.Generator().manual_seed(1))
    qkv = qkv.to(dtype)
    q, k, v = qkv.split([HKV * GROUP * D, HKV * D, HKV * D], dim=-1)
    q, k, v = q.view(t, -1, D), k.view(t, HKV, D), v.view(t, HKV, D)
    if not adjacent:  # e.g. Qwen3's q/k norms make new tensors
        q, k = q.clone(), k.clone()
    positions = torch.tensor(
        [p for s, n in zip(seq_lens, query_lens) for p in range(s - n, s)] + [0] * pad_tokens
    )
    return q, k, v, positions, kc, vc, meta


@pytest.mark.parametrize(
    "dtype,adjacent,pad", [(torch.float32, True, 0), (torch.float32, False, 2), (torch.bfloat16, True, 3)]
)
def test_equals_the_reference_backend(dtype, adjacent, pad):
    q, k, v, positions, kc, vc, meta = _inputs([1, 6, 1], [9, 6, 20], dtype, pad, adjacent)
    table = build_cos_sin_cache(D, 64, 10000.0, None)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    want = ReferenceAttentionBackend(cpu_ops()).forward(
        q, k, v, positions, table, ref_kc, ref_vc, dataclasses.replace(meta), 0.2
    )
    got = CpuAttentionBackend(cpu_ops()).forward(q, k, v, positions, table, kc, vc, meta, 0.2)
    real = meta.query_start_loc_cpu[-1]
    assert torch.equal(got[:real], want[:real])
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    # the rotation alone, against the oracle's twin
    rot = cpu_backend._rotate(q, *cpu_backend._step_inputs(meta, positions).cos_sin(table))
    assert torch.equal(rot, reference.apply_rotary(q, positions, table))


def test_step_inputs_are_shared_by_the_layers_of_a_step():
    q, k, v, positions, kc, vc, meta = _inputs([1, 1], [5, 12])
    table = build_cos_sin_cache(D, 64, 10000.0, None)
    backend = CpuAttentionBackend(cpu_ops())
    backend.forward(q, k, v, positions, table, kc, vc, meta, 0.2)
    step = meta.__dict__[cpu_backend._STEP_ATTR]
    backend.forward(q, k, v, positions, table, kc, vc, meta, 0.2)
    assert meta.__dict__[cpu_backend._STEP_ATTR] is step and len(step.tables) == 1
    backend.forward(q, k, v, positions + 1, table, kc, vc, meta, 0.2)  # other positions: rebuilt
    assert meta.__dict__[cpu_backend._STEP_ATTR] is not step


def test_quantized_cache_takes_the_reference_path():
    q, k, v, positions, kc, vc, meta = _inputs([1, 4], [7, 4])
    table = build_cos_sin_cache(D, 64, 10000.0, None)
    kq, vq = torch.zeros_like(kc, dtype=torch.int8), torch.zeros_like(vc, dtype=torch.int8)
    scales = dict(k_scale=torch.tensor(0.05), v_scale=torch.tensor(0.05))
    got = CpuAttentionBackend(cpu_ops()).forward(q, k, v, positions, table, kq, vq, meta, 0.2, **scales)
    want = ReferenceAttentionBackend(cpu_ops()).forward(
        q, k, v, positions, table, kq.clone(), vq.clone(), dataclasses.replace(meta), 0.2, **scales
    )
    assert torch.equal(got, want) and _step_not_built(meta)


def _step_not_built(meta) -> bool:
    return cpu_backend._STEP_ATTR not in meta.__dict__


def test_backend_choice(monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_KERNELS", "auto")
    assert isinstance(get_attention_backend("cpu", get_ops("cpu")), CpuAttentionBackend)
    monkeypatch.setenv("SLIPSTREAM_KERNELS", "reference")
    backend = get_attention_backend("cpu", get_ops("cpu"))
    assert type(backend) is ReferenceAttentionBackend
