"""GEMVs that compute their input's RMSNorm (and residual add) while loading it (NORMED).

CPU: Triton's interpreter in float32 against the reference norm followed by a float64 product.
GPU (`-m gpu`): bf16 at the Llama-3.1-8B shapes the norms feed (qkv, gate_up), eager and in a
CUDA graph, against the separate norm kernel followed by the plain GEMV.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels import gemv, gemv_int8, reference
from slipstream.quantization import utils

pytestmark = pytest.mark.usefixtures("poison_outputs")

EPS = 1e-5
CONFIGS = [
    gemv.GemvConfig(block_n=8, block_k=128, split_k=1, prefetch=True),
    gemv.GemvConfig(block_n=16, block_k=64, split_k=3),  # split ignored: the norm needs all of K
    gemv.GemvConfig(block_n=8, block_k=64, num_stages=3),  # pipelined loop
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _want(x, residual, norm_w, w, b):
    """The unfused path: reference norm (the add rounded to x's dtype), float64 product."""
    if residual is None:
        h, new_res = reference.rms_norm(x, norm_w, EPS), x
    else:
        h, new_res = reference.fused_add_rms_norm(x.clone(), residual.clone(), norm_w, EPS)
    return F.linear(h.double(), w.double(), None if b is None else b.double()), new_res


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("k", [256, 300])  # 300: the masked tail of the last K tile
@pytest.mark.parametrize("add", [False, True])
def test_gemv_normed(cfg: gemv.GemvConfig, k: int, add: bool) -> None:
    n = 45  # not a multiple of block_n: several programs share the residual columns
    x, norm_w = 3 * torch.randn(1, k), torch.rand(k) + 0.5
    residual = torch.randn(1, k) if add else None
    w, b = torch.randn(n, k), torch.randn(n)
    res_before = None if residual is None else residual.clone()
    got, new_res = gemv.gemv_normed(x, residual, gemv.NormInput(norm_w, EPS), w, b, cfg)
    want, want_res = _want(x, residual, norm_w, w, b)
    assert got.shape == (1, n) and _rel(got, want) < 1e-5
    torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)
    if add:  # the input residual is read-only: other programs still read it
        assert new_res.data_ptr() != residual.data_ptr()
        torch.testing.assert_close(residual, res_before, atol=0, rtol=0)
    else:
        assert new_res is x


@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("cfg", CONFIGS + [gemv.GemvConfig(16, 64, bit_convert=1),
                                           gemv.GemvConfig(64, 128, num_stages=4, dot=True)])
def test_qgemv_normed(wdtype: torch.dtype, cfg: gemv.GemvConfig) -> None:
    k, n = 300, 37
    x, residual, norm_w = torch.randn(1, k), torch.randn(1, k), torch.rand(k) + 0.5
    wf = torch.randn(n, k)
    q, s = (utils.quantize_int8_per_channel(wf) if wdtype == torch.int8
            else utils.quantize_fp8_per_channel(wf))
    got, new_res = gemv_int8.qgemv_normed(x, residual, gemv.NormInput(norm_w, EPS), q, s,
                                          None, cfg)
    want, want_res = _want(x, residual, norm_w, q.double() * s.double()[:, None], None)
    assert _rel(got, want) < 1e-5
    torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)


def test_normed_rejects_bad_operands() -> None:
    w, norm = torch.randn(8, 64), gemv.NormInput(torch.ones(64), EPS)
    with pytest.raises(ValueError, match="one contiguous row"):
        gemv.gemv_normed(torch.randn(2, 64), None, norm, w)
    with pytest.raises(ValueError, match="norm weight"):
        gemv.gemv_normed(torch.randn(1, 64), None, gemv.NormInput(torch.ones(32), EPS), w)
    with pytest.raises(ValueError, match="residual"):
        gemv.gemv_normed(torch.randn(1, 64), torch.randn(1, 64).half(), norm, w)


# ---------------------------------------------------------------------------- GPU (bf16)
@pytest.mark.gpu
@pytest.mark.parametrize("n", [6144, 28672, 333])
@pytest.mark.parametrize("add", [False, True])
def test_gpu_gemv_normed_every_candidate(n: int, add: bool) -> None:
    k, dev, dt = 4096, "cuda", torch.bfloat16
    x = torch.randn(1, k, device=dev, dtype=dt)
    residual = torch.randn(1, k, device=dev, dtype=dt) if add else None
    norm_w = (torch.rand(k, device=dev) + 0.5).to(dt)
    w = torch.randn(n, k, device=dev, dtype=dt) / 64
    want, want_res = _want(x.float(), None if residual is None else residual.float(),
                           norm_w.float(), w.float(), None)
    for cfg in gemv.candidate_configs(1, n, k):
        got, new_res = gemv.gemv_normed(x, residual, gemv.NormInput(norm_w, EPS), w, None, cfg)
        # bf16 weights and output; the normed input stays float32 (no bf16 rounding of it).
        assert _rel(got, want) < 5e-3, cfg
        torch.testing.assert_close(new_res.float(), want_res.to(dt).float(), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn])
def test_gpu_qgemv_normed_every_candidate(wdtype: torch.dtype) -> None:
    k, n, dev, dt = 4096, 6144, "cuda", torch.bfloat16
    x, residual = torch.randn(1, k, device=dev, dtype=dt), torch.randn(1, k, device=dev, dtype=dt)
    norm_w = (torch.rand(k, device=dev) + 0.5).to(dt)
    wf = torch.randn(n, k, device=dev)
    q, s = (utils.quantize_int8_per_channel(wf) if wdtype == torch.int8
            else utils.quantize_fp8_per_channel(wf))
    want, _ = _want(x.float(), residual.float(), norm_w.float(), q.float() * s[:, None], None)
    for cfg in gemv_int8.candidate_qconfigs(1, wdtype):
        got, _ = gemv_int8.qgemv_normed(x, residual, gemv.NormInput(norm_w, EPS), q, s, None, cfg)
        assert _rel(got, want) < 5e-3, cfg


@pytest.mark.gpu
def test_gpu_gemv_normed_graph_replay() -> None:
    """Captured with PDL and replayed on new inputs: same as eager on those inputs."""
    k, n, dev, dt = 4096, 6144, "cuda", torch.bfloat16
    x, residual = torch.randn(1, k, device=dev, dtype=dt), torch.randn(1, k, device=dev, dtype=dt)
    norm = gemv.NormInput((torch.rand(k, device=dev) + 0.5).to(dt), EPS)
    w = torch.randn(n, k, device=dev, dtype=dt) / 64
    cfg = gemv.default_config(1, n, k)
    gemv.gemv_normed(x, residual, norm, w, None, cfg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_res = gemv.gemv_normed(x, residual, norm, w, None, cfg)
    x.copy_(torch.randn_like(x))
    residual.copy_(torch.randn_like(residual))
    graph.replay()
    want, want_res = gemv.gemv_normed(x.clone(), residual.clone(), norm, w, None, cfg)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)


def test_fastest_fused_keeps_the_unfused_pair_unless_beaten(monkeypatch) -> None:
    """The tuner times the unfused pair first, skips configs whose result disagrees, and keeps a
    fused config only when it is faster than the pair."""
    from slipstream.kernels import tuning

    times = {"unfused": 5.0, "a": 6.0, "b": 4.0, "c": 1.0}
    monkeypatch.setattr(tuning, "graph_time_us",
                        lambda call, sets: times[call(sets[0]) if callable(call) else call])
    unfused = lambda a: "unfused"  # noqa: E731  (stand-ins: the "result" names the timing)
    fused = lambda a, cfg: cfg  # noqa: E731
    agrees = lambda got: got != "c"  # noqa: E731  ("c" would win, but computes a wrong answer)
    assert tuning.fastest_fused(unfused, fused, ["a", "b", "c"], [()], agrees) == ("b", 4.0, 5.0)
    assert tuning.fastest_fused(unfused, fused, ["a"], [()], agrees) == (None, 5.0, 5.0)


def test_norm_goes_into_the_gemv_only_where_it_can() -> None:
    """apply_normed's gate: one contiguous row on CUDA after the Triton RMSNorm, no hooks."""
    from types import SimpleNamespace

    from slipstream.layers.linear import ColumnParallelLinear
    from slipstream.layers.norm import RMSNorm
    from slipstream.quantization.base import _norm_fits_gemv

    norm = RMSNorm(64, EPS, torch.float32, SimpleNamespace(name="triton"))
    layer = ColumnParallelLinear(64, 32, bias=False, params_dtype=torch.float32)
    cuda_row = SimpleNamespace(is_cuda=True, dim=lambda: 2, shape=(1, 64), dtype=torch.float32,
                               is_contiguous=lambda: True)
    assert _norm_fits_gemv(layer, cuda_row, None, norm)
    assert not _norm_fits_gemv(layer, torch.randn(1, 64), None, norm)  # CPU
    two_rows = SimpleNamespace(**{**vars(cuda_row), "shape": (2, 64)})
    assert not _norm_fits_gemv(layer, two_rows, None, norm)
    ref_norm = RMSNorm(64, EPS, torch.float32, SimpleNamespace(name="reference"))
    assert not _norm_fits_gemv(layer, cuda_row, None, ref_norm)
    handle = layer.register_forward_hook(lambda *a: None)  # calibration wants the normed input
    assert not _norm_fits_gemv(layer, cuda_row, None, norm)
    handle.remove()
