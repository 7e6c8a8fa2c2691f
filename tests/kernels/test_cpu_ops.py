"""The CPU table's float32 norm and activation paths (kernels/cpu.py): bit-identical to the
reference twins, and other dtypes handed to the twins."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels import cpu, reference


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_activation_equal_the_reference(dtype):
    x, res, w = _rand(5, 96, dtype=dtype), _rand(5, 96, dtype=dtype, seed=1), _rand(96, seed=2)
    w = w.to(dtype)
    assert torch.equal(cpu.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    got, got_res = cpu.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    want, want_res = reference.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert torch.equal(got, want) and torch.equal(got_res, want_res)
    gate_up = _rand(5, 2 * 96, dtype=dtype, seed=3)
    assert torch.equal(cpu.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    assert cpu.rms_norm(x, w, 1e-6).dtype == dtype


def test_inputs_are_left_unchanged():
    x, w = _rand(3, 64), _rand(64, seed=1)
    before = x.clone()
    cpu.rms_norm(x, w, 1e-6)
    cpu.fused_add_rms_norm(x, x, w, 1e-6)
    assert torch.equal(x, before)
