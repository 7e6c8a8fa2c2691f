"""Triton dequant-GEMV (kernels/gemv/int8.py) against its reference twin.

CPU: Triton's interpreter with float32 activations (bf16 tl.dot is wrong in the interpreter).
GPU (`-m gpu`): bf16 activations, INT8 and FP8 weights, the Llama-3.1-8B layer shapes.
"""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels.gemv import dense as _gemv
from slipstream.kernels.gemv import fp8 as gemv_fp8
from slipstream.kernels.gemv import int8 as gemv_int8
from slipstream.kernels.gemv.dense import GemvConfig
from slipstream.quantization import utils


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _qweight(n: int, k: int, dtype: torch.dtype, device: str = "cpu"):
    w = torch.randn(n, k, device=device)
    if dtype == torch.int8:
        return utils.quantize_int8_per_channel(w)
    return utils.quantize_fp8_per_channel(w)


@pytest.mark.parametrize("m,n,k", [(1, 37, 300), (1, 64, 1024), (3, 50, 333), (16, 65, 256)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_qgemv_int8_interpreter(m: int, n: int, k: int, with_bias: bool) -> None:
    x = torch.randn(m, k)
    q, s = _qweight(n, k, torch.int8)
    b = torch.randn(n) if with_bias else None
    got = gemv_int8.qgemv(x, q, s, b)
    want = gemv_int8.qgemv_reference(x.double(), q, s, None if b is None else b.double())
    assert got.shape == (m, n) and _rel(got, want) < 1e-5


@pytest.mark.parametrize("cfg", [GemvConfig(block_n=16, block_k=64, split_k=5),
                                 GemvConfig(block_n=8, block_k=128, split_k=1, prefetch=True),
                                 GemvConfig(block_n=4, block_k=64, split_k=3, bit_convert=True),
                                 GemvConfig(block_n=8, block_k=64, split_k=2, num_stages=4),
                                 GemvConfig(block_n=32, block_k=64, dot=True),
                                 # one tile spanning K (masked past 300): gemv.whole_k
                                 GemvConfig(block_n=4, block_k=512, split_k=1, prefetch=True),
                                 GemvConfig(block_n=8, block_k=512, split_k=1, prefetch=True,
                                            bit_convert=1)])
@pytest.mark.parametrize("m", [1, 4])
def test_qgemv_split_k_interpreter(cfg: GemvConfig, m: int) -> None:
    x = torch.randn(m, 300)
    q, s = _qweight(45, 300, torch.int8)
    got = gemv_int8.qgemv(x, q, s, None, cfg)
    assert _rel(got, gemv_int8.qgemv_reference(x.double(), q, s)) < 1e-5
    torch.testing.assert_close(gemv_int8.qgemv(x, q, s, None, cfg), got, atol=0, rtol=0)


@pytest.mark.parametrize("cfg", [GemvConfig(block_n=4, block_k=64, split_k=3, bit_convert=True),
                                 GemvConfig(block_n=16, block_k=64, split_k=2),
                                 GemvConfig(block_n=4, block_k=512, split_k=1, prefetch=True)])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn])
def test_qgemv_gated_input(cfg: GemvConfig, m: int, wdtype: torch.dtype) -> None:
    from slipstream.kernels.reference import silu_and_mul

    gate_up = torch.randn(m, 600)
    q, s = _qweight(45, 300, wdtype)
    got = gemv_int8.qgemv(gate_up, q, s, None, cfg, gated=True)
    assert _rel(got, gemv_int8.qgemv_reference(silu_and_mul(gate_up).double(), q, s)) < 1e-5


def test_int8_magic_conversion_is_exact_for_every_value() -> None:
    # All 256 int8 values in one row: the exponent trick must reproduce each one exactly.
    q = torch.arange(-128, 128, dtype=torch.int8).reshape(1, 256)
    x = torch.zeros(1, 256)
    for j in (0, 1, 127, 128, 255):
        x.zero_()
        x[0, j] = 1.0
        got = gemv_int8.qgemv(x, q, torch.ones(1), None,
                              GemvConfig(block_n=4, block_k=64, split_k=1, bit_convert=True))
        assert got.item() == float(j - 128)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n,block_k", [(4, 64), (16, 512)])
def test_int8_byte_permute_conversion_is_exact_on_gpu(block_n: int, block_k: int) -> None:
    # Every byte position of the packed words and every value: the permute selectors must pick
    # each weight's own byte.
    q = torch.arange(-128, 128, dtype=torch.int8).repeat(1, 2).reshape(1, 512).cuda()
    x = torch.zeros(1, 512, device="cuda", dtype=torch.bfloat16)
    cfg = GemvConfig(block_n=block_n, block_k=block_k, split_k=1, bit_convert=2)
    ones = torch.ones(1, device="cuda")
    for j in range(0, 512, 3):
        x.zero_()
        x[0, j] = 1.0
        assert gemv_int8.qgemv(x, q, ones, None, cfg).item() == float(j % 256 - 128)


def test_fp8_bit_conversion_is_exact_for_every_value() -> None:
    bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # no NaN
    q = bits.view(torch.float8_e4m3fn).reshape(1, -1)
    k = q.shape[1]
    x = torch.zeros(1, k)
    cfg = GemvConfig(block_n=4, block_k=64, split_k=1, bit_convert=True)
    for j in (0, 1, 7, 8, 100, 126, 127, 128, 200, k - 1):  # zero, subnormals, normals, max, signs
        x.zero_()
        x[0, j] = 1.0
        assert gemv_int8.qgemv(x, q, torch.ones(1), None, cfg).item() == q[0, j].float().item()


# ---------------------------------------------- FP8 activations, tensor-core products (gemv_fp8)
FP8_DOT = [GemvConfig(block_n=64, block_k=128, split_k=3, num_stages=2, fp8_act=True),
           GemvConfig(block_n=32, block_k=64, split_k=1, fp8_act=True)]


@pytest.mark.parametrize("cfg", FP8_DOT)
@pytest.mark.parametrize("m,n,k", [(1, 45, 300), (3, 130, 256), (16, 50, 200)])
@pytest.mark.parametrize("gated,with_bias", [(False, True), (True, False)])
def test_fp8_dot_gemv_interpreter(cfg: GemvConfig, m: int, n: int, k: int, gated: bool,
                                  with_bias: bool) -> None:
    """Per (row, block_k slice) FP8 activations and FP8 products: equal to the oracle up to
    float32 rounding, uneven K, split-K, gated input and bias included."""
    x = torch.randn(m, 2 * k if gated else k) * 3
    q, s = _qweight(n, k, torch.float8_e4m3fn)
    b = torch.randn(n) if with_bias else None
    got = gemv_int8.qgemv(x, q, s, b, cfg, gated=gated)
    want = gemv_fp8.fp8_dot_gemv_reference(x, q, s, b, cfg.block_k, gated=gated)
    assert got.shape == (m, n) and _rel(got, want) < 1e-5


def test_fp8_dot_reference_scales_each_slice_by_its_amax() -> None:
    """Slices whose amax is 448 * 2^e and whose values are E4M3 values times 2^e quantize
    exactly (the scale is a power of two): the oracle then equals the float product. One
    value nudged off the grid makes it differ: the activations really are quantized."""
    k, bk = 256, 64
    grid = torch.tensor([448.0, -448.0, 1.5, -0.75, 12.0, 0.0, 3.25, -96.0])
    x = grid.repeat(k // len(grid)).view(1, k).clone()
    for i, e in enumerate([-3, 0, 2, -7]):  # a different scale in each slice
        x[0, i * bk:(i + 1) * bk] *= 2.0 ** e
    q, s = _qweight(40, k, torch.float8_e4m3fn)
    exact = gemv_int8.qgemv_reference(x.double(), q, s).float()
    torch.testing.assert_close(gemv_fp8.fp8_dot_gemv_reference(x, q, s, None, bk), exact,
                               atol=1e-4, rtol=1e-5)
    x[0, 2] = 1.55  # between the E4M3 values 1.5 and 1.625
    off = gemv_fp8.fp8_dot_gemv_reference(x, q, s, None, bk)
    assert not torch.allclose(off, gemv_int8.qgemv_reference(x.double(), q, s).float(),
                              atol=1e-6, rtol=1e-6)


def test_fp8_act_candidates_only_for_fp8_weights() -> None:
    for m in (1, 4, 16):
        assert any(c.fp8_act for c in gemv_int8.candidate_qconfigs(m, torch.float8_e4m3fn))
        assert not any(c.fp8_act for c in gemv_int8.candidate_qconfigs(m, torch.int8))
    with pytest.raises(TypeError):
        gemv_fp8.fp8_dot_gemv(torch.randn(1, 64), *_qweight(16, 64, torch.int8), None, FP8_DOT[1])


def test_qgemv_rejects_float_weights() -> None:
    with pytest.raises(TypeError):
        gemv_int8.qgemv(torch.randn(1, 8), torch.randn(4, 8), torch.ones(4))


_SHAPES_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize("k,n", _SHAPES_8B + [(333, 50)])
def test_qgemv_gpu(wdtype: torch.dtype, m: int, k: int, n: int) -> None:
    if wdtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, s = _qweight(n, k, wdtype, "cuda")
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = gemv_int8.qgemv_reference(x.float(), q, s, b.float())
    assert _rel(gemv_int8.qgemv(x, q, s, b), want) < 1e-2
    chosen = gemv_int8.measured_qconfig(x, q, s, b)
    got = gemv_int8.qlinear_small(x, q, s, b)  # the measured config
    if chosen.fp8_act:
        oracle = gemv_fp8.fp8_dot_gemv_reference(x, q, s, b, chosen.block_k)
        assert _rel(got, oracle) < 1e-2 and _rel(got, want) < 4e-2, chosen
    else:
        assert _rel(got, want) < 1e-2, chosen
    if m == 1:  # every candidate, including the shared-memory pipelined ones
        cands = gemv_int8.candidate_qconfigs(1, wdtype, k)
        assert any(_gemv.whole_k(c, k, 1) for c in cands) == (k <= 4096)
        for cfg in cands:
            got = gemv_int8.qgemv(x, q, s, b, cfg)
            if cfg.fp8_act:  # FP8 activations: ~2.5% from the float product, exact to its oracle
                oracle = gemv_fp8.fp8_dot_gemv_reference(x.float(), q, s, b.float(), cfg.block_k)
                assert _rel(got, oracle) < 1e-2 and _rel(got, want) < 4e-2, cfg
            else:
                assert _rel(got, want) < 1e-2, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize("k,n", _SHAPES_8B + [(333, 50), (4096, 128256)])
@pytest.mark.parametrize("gated", [False, True])
def test_fp8_dot_gemv_gpu(m: int, k: int, n: int, gated: bool) -> None:
    """The tensor-core FP8 GEMV against its oracle on the H200, every candidate tile; bf16
    activations with outliers (a few channels 100x larger), as real hidden states have."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 tensor-core products need sm_89+; the candidates are tuned for sm_90")
    x = torch.randn(m, 2 * k if gated else k, device="cuda")
    x[:, ::97] *= 100
    x = x.to(torch.bfloat16)
    q, s = _qweight(n, k, torch.float8_e4m3fn, "cuda")
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for cfg in [c for c in gemv_int8.candidate_qconfigs(m, torch.float8_e4m3fn) if c.fp8_act]:
        got = gemv_int8.qgemv(x, q, s, b, cfg, gated=gated)
        want = gemv_fp8.fp8_dot_gemv_reference(x, q, s, b, cfg.block_k, gated=gated)
        assert _rel(got, want) < 1e-2, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 17, 256])
def test_int8_and_fp8_linear_gpu(m: int) -> None:
    from slipstream.quantization.fp8 import fp8_linear, fp8_linear_reference
    from slipstream.quantization.int8_wo import int8_linear

    k, n = 4096, 6144
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, s = _qweight(n, k, torch.int8, "cuda")
    want = gemv_int8.qgemv_reference(x.float(), q, s)
    assert _rel(int8_linear(x, q, s, None), want) < 1e-2
    if torch.cuda.get_device_capability() >= (8, 9):
        q8, s8 = _qweight(n, k, torch.float8_e4m3fn, "cuda")
        # W8A8: per-token FP8 activations (large M) or per-slice ones (small M, when the
        # tuner picks the tensor-core kernel), each ~2.5% from the float product on random data.
        float_ref = gemv_int8.qgemv_reference(x.float(), q8, s8)
        assert _rel(fp8_linear_reference(x.float(), q8, s8), float_ref) < 4e-2
        got8 = fp8_linear(x, q8, s8, None)
        assert _rel(got8, float_ref) < 4e-2
        if m > 16:  # torch._scaled_mm: the per-token oracle's own quantization
            assert _rel(got8, fp8_linear_reference(x.float(), q8, s8)) < 3e-2


def test_gated_choice_logic(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gated call's choice times act-then-plain against each candidate
    run gated, skips wrong results, and keeps the fastest."""
    from slipstream.kernels.reference import silu_and_mul

    q, s = _qweight(40, 64, torch.int8)
    cands = gemv_int8.candidate_qconfigs(1, torch.int8)[:3]
    plain = cands[0]
    monkeypatch.setattr(gemv_int8, "candidate_qconfigs", lambda m, dt, k=None: cands)
    monkeypatch.setattr(gemv_int8, "measured_qconfig", lambda *a: plain)
    times = iter([1.0, 2.0, 3.0, 4.0])  # unfused first, then each candidate in order
    monkeypatch.setattr(gemv_int8, "graph_time_us",
                        lambda call, sets: (call(sets[0]), next(times))[1])
    assert gemv_int8._measure_gated(1, q, s, None, torch.float32, silu_and_mul) is gemv_int8._UNFUSED
    real = gemv_int8.qgemv

    def broken_second(x, w, sc, b=None, config=None, gated=False):
        out = real(x, w, sc, b, config, gated=gated)
        return out + 1.0 if (config == cands[1] and gated) else out

    monkeypatch.setattr(gemv_int8, "qgemv", broken_second)
    times = iter([5.0, 3.0, 1.0, 2.0])  # cands[1] would win at 1.0 had it been timed
    assert gemv_int8._measure_gated(1, q, s, None, torch.float32, silu_and_mul) == cands[2]


def test_qlinear_small_runs_the_gated_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream.kernels.reference import silu_and_mul

    q, s = _qweight(45, 300, torch.int8)
    gate_up = torch.randn(2, 600)
    want = gemv_int8.qgemv_reference(silu_and_mul(gate_up).double(), q, s)
    calls = []

    def act(x):
        calls.append(x.shape)
        return silu_and_mul(x)

    monkeypatch.setattr(gemv_int8, "_gated_choice", lambda *a: gemv_int8._UNFUSED)
    assert _rel(gemv_int8.qlinear_small(gate_up, q, s, gated=True, act=act), want) < 1e-5
    assert calls == [(2, 600)]  # the activation ran first, then the plain product
    cfg = GemvConfig(block_n=16, block_k=64, split_k=2)
    monkeypatch.setattr(gemv_int8, "_gated_choice", lambda *a: cfg)
    assert _rel(gemv_int8.qlinear_small(gate_up, q, s, gated=True, act=act), want) < 1e-5
    assert len(calls) == 1  # fused: the kernel computed the activation


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_tuned_gated_down_projection(monkeypatch: pytest.MonkeyPatch, wdtype, m) -> None:
    """On the GPU the gated call's own measured choice (fused or
    act-then-plain) gives the product of act(gate_up), within the method's tolerance."""
    from slipstream.kernels.reference import silu_and_mul

    if wdtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    k, n = 14336, 4096
    gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    q, s = _qweight(n, k, wdtype, "cuda")
    got = gemv_int8.qlinear_small(gate_up, q, s, None, gated=True, act=silu_and_mul)
    want = gemv_int8.qgemv_reference(silu_and_mul(gate_up).float(), q, s)
    assert _rel(got, want) < (4e-2 if wdtype == torch.float8_e4m3fn else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 7, 16])
def test_gpu_anchored_gated_activation_is_exact(monkeypatch: pytest.MonkeyPatch, wdtype, m):
    """The M=2-16 gated kernels compute SiLU·up in its load layout (ANCHOR_GATED, on for
    CUDA): the same bits as without (only where the math runs moves)."""
    from slipstream.kernels.gemv import dense as gemv

    if wdtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    k, n = 1024, 320
    gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    cfg = GemvConfig(block_n=64, block_k=256, num_stages=3)
    if wdtype == torch.bfloat16:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        run = lambda: gemv.gemv(gate_up, w, None, cfg, gated=True)  # noqa: E731
    else:
        q, s = _qweight(n, k, wdtype, "cuda")
        run = lambda: gemv_int8.qgemv(gate_up, q, s, None, cfg, gated=True)  # noqa: E731
    anchored = run()
    real = gemv.skinny_kernel

    class Unanchored:
        def __getitem__(self, grid):
            return lambda *a, **kw: real[grid](*a, **{**kw, "ANCHOR_GATED": False})

    monkeypatch.setattr(gemv, "skinny_kernel", Unanchored())
    assert torch.equal(run(), anchored)


@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("cfg", [GemvConfig(block_n=8, block_k=64, split_k=3),
                                 GemvConfig(block_n=4, block_k=128, split_k=1, prefetch=True,
                                            bit_convert=1),
                                 GemvConfig(block_n=16, block_k=64, num_stages=2)])
def test_qgemv_gate_out(wdtype: torch.dtype, cfg: GemvConfig) -> None:
    """The one-row dequant GEMV writing SiLU(gate)·up of a [gate | up] weight: equal to the
    product then the activation."""
    from slipstream.kernels.reference import silu_and_mul

    x = torch.randn(1, 300)
    q, s = _qweight(90, 300, wdtype)
    b = torch.randn(90)
    got = gemv_int8.qgemv_gate_out(x, q, s, b, cfg)
    want = silu_and_mul(gemv_int8.qgemv_reference(x.double(), q, s, b.double()))
    assert got.shape == (1, 45) and _rel(got, want) < 1e-5
    with pytest.raises(ValueError, match="one row"):
        gemv_int8.qgemv_gate_out(torch.randn(2, 300), q, s, b, cfg)
    assert gemv_int8.qlinear_small_gate_out(x, q, s, b) is None  # off CUDA: two steps


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("k,split", [(512, 1), (300, 2), (1024, 3)])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_deeper_prefetch_has_the_bits_of_one_tile_ahead(depth: int, k: int, split: int,
                                                        wdtype: torch.dtype) -> None:
    """The one-row GEMV with prefetch 2 / 3 (tiles requested that far ahead; past a split's end
    the last tile again, or masked where K is not a multiple of block_k) only moves loads: the
    bits of prefetch 1 for bf16 and the INT8 / FP8 dequant forms, plain, gated and gate-out."""
    from slipstream.kernels.gemv import dense as gemv

    n = 46
    x = torch.randn(1, 2 * k, generator=torch.Generator().manual_seed(k)).bfloat16()
    base = GemvConfig(block_n=8, block_k=128, split_k=split, prefetch=True)
    deep = GemvConfig(block_n=8, block_k=128, split_k=split, prefetch=depth)
    if wdtype == torch.bfloat16:
        w = torch.randn(n, k).bfloat16()
        run = lambda cfg, xx, **kw: gemv.gemv(xx, w, None, cfg, **kw)  # noqa: E731
        gate_out = lambda cfg: gemv.gemv(x[:, :k], w, None, cfg, gate_out=True)  # noqa: E731
    else:
        q, s = _qweight(n, k, wdtype)
        run = lambda cfg, xx, **kw: gemv_int8.qgemv(xx, q, s, None, cfg, **kw)  # noqa: E731
        gate_out = lambda cfg: gemv_int8.qgemv_gate_out(x[:, :k], q, s, None, cfg)  # noqa: E731
    for got, want in [(run(deep, x[:, :k]), run(base, x[:, :k])),
                      (run(deep, x, gated=True), run(base, x, gated=True)),
                      (gate_out(deep), gate_out(base))]:
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("cfg", [GemvConfig(block_n=4, block_k=512, split_k=1, prefetch=True,
                                            bit_convert=1),
                                 GemvConfig(block_n=8, block_k=128, split_k=1, num_stages=2),
                                 GemvConfig(block_n=8, block_k=64, split_k=3, prefetch=True,
                                            bit_convert=1)])  # a K split
def test_qgemv_rms_eps(wdtype: torch.dtype, cfg: GemvConfig) -> None:
    """The dequant GEMV normalising its one input row itself (rms_eps): equal to the product
    with x / rms(x); plain and gate_out launches; refused for several rows and FP8-activation
    configs, and by the measured path off CUDA."""
    from slipstream.kernels.reference import silu_and_mul

    x = 5.0 * torch.randn(1, 300)
    q, s = _qweight(90, 300, wdtype)
    b = torch.randn(90)
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = gemv_int8.qgemv_reference(normed, q, s, b.double())
    assert _rel(gemv_int8.qgemv(x, q, s, b, cfg, rms_eps=1e-6), want) < 1e-5
    assert _rel(gemv_int8.qgemv_gate_out(x, q, s, b, cfg, rms_eps=1e-6), silu_and_mul(want)) < 1e-5
    with pytest.raises(ValueError, match="one row"):
        gemv_int8.qgemv(torch.randn(2, 300), q, s, b, cfg, rms_eps=1e-6)
    with pytest.raises(ValueError, match="one row"):
        gemv_int8.qgemv(x, q, s, b, GemvConfig(64, 128, 0, 4, 4, fp8_act=True), rms_eps=1e-6)
    assert gemv_int8.qlinear_small_rms(x, q, s, b, 1e-6) is None


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 28672)])
def test_gpu_qgemv_rms_every_candidate(wdtype, k: int, n: int) -> None:
    """int8 / fp8, one row: every candidate that can (rms_ok, K splits included) normalises x
    itself (plain and gate_out), as the dequantized float math of x / rms(x)."""
    from slipstream.kernels.reference import silu_and_mul

    if wdtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    x = 6.0 * torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    q, s = _qweight(n, k, wdtype, "cuda")
    xd = x.double()
    want = gemv_int8.qgemv_reference(xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5),
                                     q, s)
    tried = 0
    for cfg in gemv_int8.candidate_qconfigs(1, wdtype, k):
        if not _gemv.rms_ok(1, n, k, cfg, x.device):
            continue
        tried += 1
        assert _rel(gemv_int8.qgemv(x, q, s, None, cfg, rms_eps=1e-5), want) < 1e-2, cfg
        if _gemv.gate_out_ok(1, n, cfg):
            got = gemv_int8.qgemv_gate_out(x, q, s, None, cfg, rms_eps=1e-5)
            assert _rel(got, silu_and_mul(want)) < 1e-2, cfg
    assert tried


@pytest.mark.parametrize("gate_out,rms_eps", [(True, 0.0), (False, 1e-6), (True, 1e-6)])
def test_one_row_kinds_are_measured_as_they_run(monkeypatch: pytest.MonkeyPatch, gate_out: bool,
                                                rms_eps: float) -> None:
    """A one-row gate-out / norm call is timed as itself among the configs that run it (not the
    plain product's pick): a config that cannot run the call (tensor-core dot, FP8 activations)
    or gives a wrong result is never chosen, the fastest of the rest is; none left: None."""
    fast_but_wrong = GemvConfig(block_n=8, block_k=128, split_k=1)
    good = GemvConfig(block_n=4, block_k=128, split_k=1, prefetch=True, bit_convert=1)
    slower = GemvConfig(block_n=8, block_k=64, split_k=1, num_stages=2)
    dot = GemvConfig(block_n=64, block_k=128, split_k=1, dot=True)
    times = {good: 5.0, slower: 9.0, fast_but_wrong: 1.0, dot: 0.5}
    timed = []

    def fake_time(call, arg_sets, **kw):
        timed.append(current[0])
        return times[current[0]]

    current = [None]
    real_call = gemv_int8._kind_call

    def tracking_call(cfg, g, eps):
        run = real_call(cfg, g, eps)

        def wrapped(*a):
            current[0] = cfg
            out = run(*a)
            return out * 3 if cfg is fast_but_wrong else out
        return wrapped

    monkeypatch.setattr(gemv_int8, "graph_time_us", fake_time)
    monkeypatch.setattr(gemv_int8, "_kind_call", tracking_call)
    monkeypatch.setattr(gemv_int8, "candidate_qconfigs",
                        lambda m, dtype, k: [dot, fast_but_wrong, slower, good])
    q, s = _qweight(90, 256, torch.int8)
    assert gemv_int8._measure_kind(q, s, None, torch.float32, gate_out, rms_eps) is good
    assert sorted(map(repr, timed)) == sorted(map(repr, [slower, good]))
    monkeypatch.setattr(gemv_int8, "candidate_qconfigs", lambda m, dtype, k: [dot])
    assert gemv_int8._measure_kind(q, s, None, torch.float32, gate_out, rms_eps) is None
    assert _gemv.call_kind(gate_out, rms_eps) == {(True, 0.0): "gate-out", (False, 1e-6): "rms",
                                                  (True, 1e-6): "gate-out rms"}[(gate_out,
                                                                                  rms_eps)]
