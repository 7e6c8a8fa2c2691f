"""Programmatic dependent launch: off where it cannot run, and on the GPU a chain of dependent
kernels replayed in a CUDA graph gives bit-for-bit the results of the same kernels without it
(a kernel that read its input before the previous one finished would not)."""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels.gemv import dense as gemv
from slipstream.kernels.norm_act import rms_norm
from slipstream.kernels.runtime import pdl


def test_off_on_cpu():
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_kwargs(torch.device("cpu")) == {}


def _chain(x: torch.Tensor, weights: list[torch.Tensor], norm_w: torch.Tensor) -> torch.Tensor:
    """norm -> GEMV -> add+norm -> gated GEMV -> ..., each kernel reading the previous output."""
    residual = x.clone()
    h = rms_norm.rms_norm(x, norm_w, 1e-6)
    for w_up, w_down in zip(weights[::2], weights[1::2], strict=True):
        gate_up = gemv.gemv(h, w_up)
        h = gemv.gemv(gate_up, w_down, gated=True)
        h, residual = rms_norm.fused_add_rms_norm(h, residual, norm_w, 1e-6)
    return h


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_chain_matches_without_pdl(monkeypatch):
    device = torch.device("cuda")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0+")
    assert pdl.enabled(device), "PDL should be on for a Hopper GPU with this Triton"
    torch.manual_seed(0)
    k, inter = 2048, 4096
    weights = []
    for _ in range(12):
        weights += [torch.randn(2 * inter, k, device=device, dtype=torch.bfloat16) / k**0.5,
                    torch.randn(k, inter, device=device, dtype=torch.bfloat16) / inter**0.5]
    norm_w = torch.rand(k, device=device, dtype=torch.bfloat16) + 0.5
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)

    monkeypatch.setenv("SLIPSTREAM_PDL", "0")
    expect = _chain(x, weights, norm_w)
    monkeypatch.setenv("SLIPSTREAM_PDL", "1")
    _chain(x, weights, norm_w)  # compile the PDL variants outside the capture
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(static_x, weights, norm_w)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expect)



def test_idle_before_timing_subtracts_the_spin(monkeypatch):
    """graph_time_us(idle_before_us=...) times spin+call and spin alone; the call's share is the
    difference (the spin itself is never counted)."""
    from slipstream.kernels.runtime import tuning

    spins, timed = [], iter([30.0, 20.0])  # spin + call, then spin alone
    monkeypatch.setattr(pdl, "spin", lambda device, us: spins.append(us))

    def fake_replay(call, arg_sets, min_calls, repeats):
        call(arg_sets[0])
        return next(timed)

    monkeypatch.setattr(tuning, "_replay_us", fake_replay)
    calls = []
    us = tuning.graph_time_us(lambda a: calls.append(a), [(torch.zeros(1),)], idle_before_us=8.0)
    assert us == 10.0 and spins == [8.0, 8.0] and len(calls) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_spin_lasts_about_as_asked():
    from slipstream.kernels.runtime import tuning

    device = torch.device("cuda")
    args = [(torch.zeros(1, device=device),)]
    us = tuning.graph_time_us(lambda a: pdl.spin(device, 20.0), args)
    assert 19.0 < us < 30.0
    w = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
    after_idle = tuning.graph_time_us(lambda a: gemv.gemv(*a), [(x, w)], idle_before_us=10.0)
    assert 0.0 < after_idle < 60.0
