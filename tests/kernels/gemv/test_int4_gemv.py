"""W4A16 kernels (kernels/gemv/int4.py, gemm_int4.py, int4_common.py) against the reference twin.

CPU: Triton's interpreter with float32 activations (bf16 tl.dot is wrong in the interpreter);
weights from utils.quantize_int4_groupwise + pack_int4_rows, the layout int4_awq stores.
GPU (`-m gpu`): bf16 activations on the Llama-3.1-8B layer shapes; each output within
1e-2 * max|reference| (bf16 output rounding, and in the GEMM bf16 weights, are ~4e-3).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from slipstream.kernels.gemm import int4 as gemm_int4
from slipstream.kernels.gemv import int4 as gemv_int4
from slipstream.kernels.gemv import int4_common
from slipstream.kernels.gemv.dense import COUNTERS
from slipstream.kernels.gemv.int4 import W4Config
from slipstream.quantization import utils as qu
from tests.kernels.gemv.gemv_helpers import quantized, rel, rms_normed


def _check(got, x, packed, bias, group, tol=1e-5) -> None:
    """float64 reference: the kernel must land within float32 rounding of it."""
    want = gemv_int4.w4_linear_reference(x.double(), *packed, group,
                                         None if bias is None else bias.double())
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert rel(got, want) < tol, f"relative error {rel(got, want):.2e}"


@triton.jit
def _unpack_kernel(w_ptr, nat_ptr, pair_ptr, W: tl.constexpr):
    w = tl.load(w_ptr + tl.arange(0, 2)[:, None] * W + tl.arange(0, W)[None, :])
    cols = tl.arange(0, 2)[:, None] * 8 * W + tl.arange(0, 8 * W)[None, :]
    tl.store(nat_ptr + cols, int4_common.unpack_natural(w, nat_ptr.dtype.element_ty))
    tl.store(pair_ptr + cols, int4_common.unpack_paired(w, pair_ptr.dtype.element_ty))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unpack_orders_and_magic_values(dtype: torch.dtype) -> None:
    """Every nibble value in every position: 1 + q/16, in k order and in the paired order."""
    q = torch.randint(0, 16, (2, 32), dtype=torch.uint8)
    q[0, :16] = torch.arange(16, dtype=torch.uint8)
    words = qu.pack_int4_rows(q).view(torch.int32)
    nat, pair = torch.empty(2, 32, dtype=dtype), torch.empty(2, 32, dtype=dtype)
    _unpack_kernel[(1,)](words, nat, pair, W=4)
    want = 1 + q.float() / 16
    assert torch.equal(nat.float(), want)
    o = torch.arange(32)
    paired_k = (o // 8) * 8 + (o % 8) // 2 + 4 * (o % 2)
    assert torch.equal(pair.float(), want[:, paired_k])


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("m,n,k,group", [(1, 37, 256, 128), (1, 45, 384, 64), (3, 37, 256, 128),
                                         (16, 33, 256, 64), (2, 24, 192, 192)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w4_gemv_default_config(m: int, n: int, k: int, group: int, with_bias: bool) -> None:
    packed = quantized(n, k, group)
    x = torch.randn(m, k)
    b = torch.randn(n) if with_bias else None
    _check(gemv_int4.w4_gemv(x, *packed, group, b), x, packed, b, group)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("cfg", [
    W4Config(block_n=16, block_k=64, split_k=3),            # chunk divides the group of 128
    W4Config(block_n=32, block_k=256, split_k=2, prefetch=True),  # chunk = group, uneven splits
    W4Config(block_n=16, block_k=128, split_k=4, dot=True),  # M == 1 through the tl.dot kernel
])
@pytest.mark.parametrize("m", [1, 4])
def test_w4_gemv_split_k(cfg: W4Config, m: int) -> None:
    n, k, group = 45, 640, 128
    packed = quantized(n, k, group)
    x, b = torch.randn(m, k), torch.randn(n)
    out = gemv_int4.w4_gemv(x, *packed, group, b, cfg)
    _check(out, x, packed, b, group)
    for buf in COUNTERS.values():  # the last program to arrive resets every tile counter
        assert int(buf.abs().sum()) == 0
    torch.testing.assert_close(gemv_int4.w4_gemv(x, *packed, group, b, cfg), out, atol=0, rtol=0)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("m,split", [(1, 1), (1, 3), (4, 2), (2, 4)])
def test_w4_deeper_prefetch_has_the_bits_of_one_chunk_ahead(depth: int, m: int,
                                                           split: int) -> None:
    """prefetch 2 / 3 (chunks requested that far ahead; past a split's end the last chunk
    again) only moves loads: the same bits as prefetch 1 for the one-row (chained and per-word)
    and the few-row kernels, split ranges of one to five chunks included; so does the one-row
    kernel's pipeline through shared memory (num_stages 3 / 4, no register prefetch)."""
    n, k, group = 45, 640, 128
    packed = quantized(n, k, group, seed=depth)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(split)).bfloat16()
    rows = dict(two_rows=m == 2, four_rows=m == 4)
    for bits in (1, 2) if m == 1 else (2,):
        base = W4Config(block_n=16, block_k=128, split_k=split, prefetch=True, bit_convert=bits,
                        **rows)
        want = gemv_int4.w4_gemv(x, *packed, group, None, base)
        deep = dataclasses.replace(base, prefetch=depth)
        assert deep.label() == base.label().replace("prefetch", f"prefetch{depth}")
        torch.testing.assert_close(gemv_int4.w4_gemv(x, *packed, group, None, deep), want,
                                   atol=0, rtol=0)
        if m == 1:  # the one-row kernel's shared-memory pipeline instead (tl.range stages)
            staged = dataclasses.replace(base, prefetch=False, num_stages=depth + 1)
            torch.testing.assert_close(gemv_int4.w4_gemv(x, *packed, group, None, staged), want,
                                       atol=0, rtol=0)
    assert rel(want, gemv_int4.w4_linear_reference(x.double(), *packed, group)) < 8e-3


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("group,split", [(128, 1), (64, 3)])
@pytest.mark.parametrize("chained", [False, True])
def test_w4_gemv_bf16x2_pairs(group: int, split: int, chained: bool) -> None:
    """The packed-bf16 M == 1 path pairs each word's nibbles a and a+4 with x_a and x_a+4 and
    subtracts its own row's zero; chained, it sums each run of four words of a row (words 4c to
    4c+3, split out of the tile's last axis) in one packed sum. The interpreter runs the float32
    twins; the GPU tests the PTX."""
    n, k = 45, 640
    packed = quantized(n, k, group)
    g = torch.Generator().manual_seed(split)
    x, b = torch.randn(1, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    cfg = W4Config(block_n=16, block_k=128, split_k=split, prefetch=True,
                   bit_convert=2 if chained else 1)
    assert gemv_int4._bf16x2_mode(cfg, x) == 1
    assert gemv_int4._chained(cfg, x, group) == chained
    assert not gemv_int4._chained(cfg, x, 16)  # two words per chunk row: the per-word sums
    got = gemv_int4.w4_gemv(x, *packed, group, b, cfg)
    want = gemv_int4.w4_linear_reference(x.double(), *packed, group, b.double())
    assert got.dtype == torch.bfloat16
    # The bf16 output's rounding, which the interpreter does by truncation (up to one ulp, 2^-8
    # relative, always toward zero); a wrong pairing or zero would be off by tens of percent.
    assert rel(got, want) < 8e-3


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("split,prefetch,bits", [(1, True, 1), (3, False, 1), (3, True, 2)])
def test_w4_two_rows_kernel_equals_the_one_row_kernel_per_row(split: int, prefetch: bool,
                                                              bits: int) -> None:
    """The two-row packed-bf16 kernel (each weight word unpacked once for both rows): each row's
    output has the bits of the one-row packed-bf16 kernel on that row alone (same tile, split
    and pairing; bits 2: four words per packed sum), with bias (the interpreter runs the
    float32 twins; the GPU tests the PTX)."""
    n, k, group = 45, 640, 128
    packed = quantized(n, k, group, seed=split)
    g = torch.Generator().manual_seed(split)
    x, b = torch.randn(2, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    assert not torch.equal(x[0], x[1])
    cfg = W4Config(block_n=16, block_k=128, split_k=split, prefetch=prefetch, two_rows=True,
                   bit_convert=bits)
    got = gemv_int4.w4_gemv(x, *packed, group, b, cfg)
    one_row = W4Config(block_n=16, block_k=128, split_k=split, prefetch=prefetch,
                       bit_convert=bits)
    for r in range(2):
        want = gemv_int4.w4_gemv(x[r:r + 1], *packed, group, b, one_row)
        torch.testing.assert_close(got[r:r + 1], want, atol=0, rtol=0)
    assert rel(got, gemv_int4.w4_linear_reference(x.double(), *packed, group, b.double())) < 8e-3
    for buf in COUNTERS.values():
        assert int(buf.abs().sum()) == 0
    for bad in (torch.randn(3, k).bfloat16(), torch.randn(2, k)):
        with pytest.raises(ValueError, match="two rows"):
            gemv_int4.w4_gemv(bad, *packed, group, b, cfg)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("m,split", [(4, 1), (3, 3)])
def test_w4_four_rows_kernel_equals_the_one_row_kernel_per_row(m: int, split: int) -> None:
    """The four-row kernel (3-4 rows of bf16 x, four words per packed sum, each weight word
    unpacked once for all rows): each row has the bits of the one-row chained kernel on that row
    alone, with bias and split-K; at three rows the fourth re-reads row 2 and is not written.
    x that is not 8-byte aligned falls back to the tensor-core kernel."""
    n, k, group = 45, 640, 128
    packed = quantized(n, k, group, seed=m)
    g = torch.Generator().manual_seed(m)
    x, b = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    cfg = W4Config(block_n=16, block_k=128, split_k=split, prefetch=True, bit_convert=2,
                   four_rows=True)
    got = gemv_int4.w4_gemv(x, *packed, group, b, cfg)
    assert got.shape == (m, n)
    one_row = W4Config(block_n=16, block_k=128, split_k=split, prefetch=True, bit_convert=2)
    for r in range(m):
        want = gemv_int4.w4_gemv(x[r:r + 1], *packed, group, b, one_row)
        torch.testing.assert_close(got[r:r + 1], want, atol=0, rtol=0)
    for buf in COUNTERS.values():
        assert int(buf.abs().sum()) == 0
    assert rel(got, gemv_int4.w4_linear_reference(x.double(), *packed, group, b.double())) < 8e-3
    odd = torch.empty(m * k + 1, dtype=torch.bfloat16)[1:].view(m, k).copy_(x)
    assert not gemv_int4._chain_ok(odd, 128)
    # (The interpreter's bf16 tensor-core product is not the GPU's: compare routes, not values.)
    tensor_core = dataclasses.replace(cfg, four_rows=False, bit_convert=0, dot=True)
    assert torch.equal(gemv_int4.w4_gemv(odd, *packed, group, b, cfg),
                       gemv_int4.w4_gemv(odd, *packed, group, b, tensor_core))
    assert "four-row bf16x2 chained" in cfg.label()


def test_four_row_candidates_only_for_the_four_row_bucket() -> None:
    assert any(c.four_rows for c in gemv_int4.candidate_w4_configs(4, torch.bfloat16))
    for m, dtype in [(4, torch.float16), (2, torch.bfloat16), (1, torch.bfloat16),
                     (16, torch.bfloat16)]:
        assert not any(c.four_rows for c in gemv_int4.candidate_w4_configs(m, dtype))


def test_two_row_candidates_only_for_two_bf16_rows() -> None:
    assert any(c.two_rows for c in gemv_int4.candidate_w4_configs(2, torch.bfloat16))
    for m, dtype in [(2, torch.float16), (4, torch.bfloat16), (16, torch.bfloat16)]:
        assert not any(c.two_rows for c in gemv_int4.candidate_w4_configs(m, dtype))
    assert "two-row bf16x2" in W4Config(64, 128, two_rows=True).label()


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("cfg", [
    W4Config(block_n=16, block_k=128, split_k=1, prefetch=True),
    W4Config(block_n=8, block_k=64, split_k=3),  # split-K partials reduced before the activation
    W4Config(block_n=32, block_k=128, split_k=2, bit_convert=1),  # packed bf16 pairs (bf16 x)
    W4Config(block_n=32, block_k=128, split_k=2, bit_convert=2),  # four words per packed sum
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w4_gate_out_equals_product_then_activation(cfg: W4Config, with_bias: bool) -> None:
    """One row, a [gate | up] weight (I = 21: the last tile is partial): the kernel's SiLU(gate)·up
    equals silu_and_mul of the same config's stored product (each operand rounded to x's dtype)."""
    from slipstream.kernels.reference import silu_and_mul

    n, k, group = 42, 384, 128
    packed = quantized(n, k, group, seed=3)
    dtype = torch.bfloat16 if cfg.bit_convert else torch.float32
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    got = gemv_int4.w4_gemv_gate_out(x, *packed, group, b, cfg)
    want = silu_and_mul(gemv_int4.w4_gemv(x, *packed, group, b, cfg).float())
    assert got.shape == (1, n // 2) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 1e-2)
    for buf in COUNTERS.values():  # split-K tile counters back at zero
        assert int(buf.abs().sum()) == 0
    with pytest.raises(ValueError, match="one row"):
        gemv_int4.w4_gemv_gate_out(torch.randn(2, k).to(dtype), *packed, group, b, cfg)
    assert gemv_int4.w4_linear_small_gate_out(x, *packed, group, b) is None  # off CUDA


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("group,cfg", [
    (128, None),
    (64, gemm_int4.W4GemmConfig(32, 32, 128, 4, 1)),  # block_k clamped to the group
    (128, gemm_int4.W4GemmConfig(16, 64, 32, 4, 1)),  # four K steps per group
    (384, None),  # one group per row (GPTQ group_size -1): K steps of gcd(64, 384)
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w4_gemm(group: int, cfg, with_bias: bool) -> None:
    n, k = 37, 384
    packed = quantized(n, k, group)
    x = torch.randn(2, 20, k)  # leading dims: M = 40
    b = torch.randn(n) if with_bias else None
    out = gemm_int4.w4_gemm(x, *packed, group, b, cfg)
    assert out.shape == (2, 20, n)
    _check(out.reshape(40, n), x.reshape(40, k), packed, b, group)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("group", [128, 64, 192])
def test_w4_dequantize_kernel_matches_utils(group: int) -> None:
    q, s, z = quantized(37, 384, group)
    want = qu.dequantize_int4_groupwise(qu.unpack_int4_rows(q), s, z)
    got = gemm_int4.w4_dequantize(q, s, z, group, torch.float32, kernel=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # (q - z) * s rounded once, both


def test_int4_linear_on_cpu_is_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = quantized(24, 128, 64)
    monkeypatch.setattr(gemv_int4, "w4_gemv", lambda *a, **kw: pytest.fail("kernel on CPU"))
    for m in (1, 40):
        x, b = torch.randn(m, 128), torch.randn(24)
        want = gemv_int4.w4_linear_reference(x, *packed, 64, b)
        torch.testing.assert_close(gemv_int4.int4_linear(x, *packed, 64, b), want, atol=0, rtol=0)
    # The reference itself: dequantize + F.linear.
    w = qu.dequantize_int4_groupwise(qu.unpack_int4_rows(packed[0]), packed[1], packed[2])
    torch.testing.assert_close(want, x @ w.t() + b)


def test_w4_linear_small_off_cuda_runs_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = quantized(24, 128, 128)
    monkeypatch.setattr(gemv_int4, "measure_best", lambda *a: pytest.fail("measured on CPU"))
    x = torch.randn(1, 128)
    _check(gemv_int4.w4_linear_small(x, *packed, 128), x, packed, None, 128)


def test_layout_errors() -> None:
    q, s, z = quantized(16, 256, 128)
    x = torch.randn(1, 256)
    with pytest.raises(ValueError):
        gemv_int4.w4_gemv(x, q, s, z, 96)  # group does not divide K
    with pytest.raises(ValueError):
        gemv_int4.w4_gemv(x, q.view(torch.int8), s, z, 128)
    with pytest.raises(ValueError):
        gemv_int4.w4_gemv(x, q, s[:, :1], z, 128)
    with pytest.raises(ValueError):
        gemv_int4.w4_gemv(torch.randn(17, 256), q, s, z, 128)  # more rows than MAX_M


def test_measure_best_skips_wrong_and_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    want = torch.ones(4)
    times = {"fast_wrong": 0.1, "slow": 2.0, "fast": 1.0}
    called: list[str] = []

    def fake_time(call, arg_sets):  # the time of whichever candidate the timed call ran
        call(arg_sets[0])
        return times[called[-1]]

    monkeypatch.setattr(int4_common, "graph_time_us", fake_time)

    def fast_wrong(x):
        called.append("fast_wrong")
        return want + 1

    def slow(x):
        called.append("slow")
        return want

    def fast(x):
        called.append("fast")
        return want

    def broken(x):
        raise RuntimeError("out of resources")

    cands = [(name, fn) for name, fn in [("fast_wrong", fast_wrong), ("broken", broken),
                                         ("slow", slow), ("fast", fast)]]
    args = (torch.zeros(2),)
    assert int4_common.measure_best(cands, args, want, "fallback", "t") == "fast"
    assert int4_common.measure_best(cands[:2], args, want, "fallback", "t") == "fallback"


def test_w4_choices_for_the_startup_log(monkeypatch: pytest.MonkeyPatch) -> None:
    small = (1, 4096, 4096, 128, torch.bfloat16, False, 0)
    large = (256, 4096, 4096, 128, torch.bfloat16, True, 0)
    monkeypatch.setitem(gemv_int4._SMALL_CHOICES, small, W4Config(128, 128, 0, 2, 1, True))
    monkeypatch.setitem(gemm_int4.LARGE_CHOICES, large, gemm_int4.CUBLAS)
    assert gemv_int4.w4_choices() == {
        "M<=1 N=4096 K=4096 G=128 bfloat16": "w4 fma prefetch n128 k128 split auto warps 2",
        "M<=256 N=4096 K=4096 G=128 bfloat16 +bias": gemm_int4.CUBLAS}


def test_one_row_tuning_measures_each_kind_of_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """_small_choice keys and times one-row calls by kind (plain, in-GEMV norm, gate-out, both),
    each among the configs that run that call as themselves; the start-up log names the kind."""
    xs = torch.randn(1, 4096).bfloat16()
    chained = W4Config(128, 128, 0, 8, 1, True, bit_convert=2)
    dot = W4Config(128, 128, 0, 4, 1, dot=True)
    assert gemv_int4._runs(chained, xs, 28672, 4096, 128, True, 1e-5)
    assert not gemv_int4._runs(dot, xs, 4096, 4096, 128, False, 1e-5)  # no in-GEMV norm
    assert not gemv_int4._runs(dot, xs, 28672, 4096, 128, True, 0.0)  # no gate-out
    key = (1, 28672, 4096, 128, torch.bfloat16, False, 0, "gate-out rms")
    monkeypatch.setitem(gemv_int4._SMALL_CHOICES, key, chained)
    assert gemv_int4.w4_choices()["M<=1 N=28672 K=4096 G=128 bfloat16 gate-out rms"] == (
        chained.label())
    # Off CUDA nothing is measured: the callers take the default path.
    q, s, z = quantized(64, 4096, 128)
    assert gemv_int4._small_choice(xs, q, s, z, 128, None, gate_out=True, rms_eps=1e-5) is None


# ---------------------------------------------------------------------------- GPU (bf16)
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv o gate_up down


def _gpu_check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    failure = _gpu_error(got, want, what)
    assert not failure, failure


def _gpu_error(got: torch.Tensor, want: torch.Tensor, what: str) -> str:
    """'' when got is finite and within 1% of want's largest magnitude, else what went wrong."""
    got, want = got.float(), want.float()
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    if torch.isfinite(got).all() and err <= 1e-2 * scale:
        return ""
    return f"{what}: max error {err:.3e} ({100 * err / scale:.2f}% of max |ref| {scale:.3e})"


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("m", [1, 2, 8, 16, 64, 512])
def test_int4_linear_gpu(n: int, k: int, m: int) -> None:
    packed = quantized(n, k, 128, "cuda", seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = gemv_int4.w4_linear_reference(x, *packed, 128, b)
    _gpu_check(gemv_int4.int4_linear(x, *packed, 128, b), want, "int4_linear")  # measured
    if m <= 16:
        _gpu_check(gemv_int4.w4_gemv(x, *packed, 128, b), want, "w4_gemv default")
    else:
        _gpu_check(gemm_int4.w4_gemm(x, *packed, 128, b), want, "w4_gemm default")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(28672, 4096), (2 * 333, 256)])
def test_gpu_w4_gate_out_equals_two_steps(n: int, k: int, monkeypatch) -> None:
    """On the GPU the one-launch SiLU(gate)·up has the same bits as the product then
    silu_and_mul, for every one-row candidate (and the measured wrapper, with the config
    measured for the gate-out call: it may differ from the plain product's). The CUDA C++
    kernel, which would serve the wrapper first, has its own tests (test_gemv_int4_stream)."""
    from slipstream.kernels.norm_act.activation import silu_and_mul

    monkeypatch.setenv("SLIPSTREAM_CUDA_GEMV", "0")

    packed = quantized(n, k, 128, "cuda")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for cfg in gemv_int4.candidate_w4_configs(1, x.dtype):
        if cfg.dot or cfg.mma:  # mma: test_gemv_int4_mma, to a tolerance
            continue
        got = gemv_int4.w4_gemv_gate_out(x, *packed, 128, None, cfg)
        want = silu_and_mul(gemv_int4.w4_gemv(x, *packed, 128, None, cfg))
        assert torch.equal(got, want), cfg
    measured = gemv_int4.w4_linear_small_gate_out(x, *packed, 128)
    chosen = gemv_int4._small_choice(x, *packed, 128, None, gate_out=True)
    plain = gemv_int4.w4_gemv(x, *packed, 128, None, chosen)
    assert measured is not None and torch.equal(measured, silu_and_mul(plain))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(28672, 4096), (4096, 14336)])
def test_gpu_few_rows_kernel_has_the_one_row_bits(n: int, k: int) -> None:
    """The two- and four-row PTX computes each row as the one-row packed-bf16 PTX does (same
    bits), per word or four words per packed sum; three rows run the four-row kernel."""
    packed = quantized(n, k, 128, "cuda")
    for m, bucket in [(2, 2), (4, 4), (3, 4)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfgs = [c for c in gemv_int4.candidate_w4_configs(bucket, x.dtype)
                if c.two_rows or c.four_rows]
        assert cfgs
        if m == 2:  # the per-word sums too (chained candidates fall back to them on unaligned x)
            cfgs += [dataclasses.replace(c, bit_convert=0) for c in cfgs[:2]]
        for cfg in cfgs:
            got = gemv_int4.w4_gemv(x, *packed, 128, None, cfg)
            one = dataclasses.replace(cfg, two_rows=False, four_rows=False,
                                      bit_convert=cfg.bit_convert or 1)
            for r in range(m):
                want = gemv_int4.w4_gemv(x[r:r + 1], *packed, 128, None, one)
                assert torch.equal(got[r:r + 1], want), (m, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("group,dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_every_candidate_gpu(group: int, dtype: torch.dtype) -> None:
    """Every config the tuners may pick (3 rows: the 3-4-row bucket's), run twice (split-K
    counters left at zero)."""
    n, k = 4104, 4096
    packed = quantized(n, k, group, "cuda")
    for m, bucket in [(1, 1), (2, 2), (3, 4), (4, 4), (16, 16)]:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        want = gemv_int4.w4_linear_reference(x, *packed, group)
        for cfg in gemv_int4.candidate_w4_configs(bucket, dtype):
            for _ in range(2):
                _gpu_check(gemv_int4.w4_gemv(x, *packed, group, None, cfg), want, repr(cfg))
    for m in (40, 300):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        want = gemv_int4.w4_linear_reference(x, *packed, group)
        for cfg in gemm_int4.candidate_gemm_configs(m):
            _gpu_check(gemm_int4.w4_gemm(x, *packed, group, None, cfg), want, repr(cfg))
        _gpu_check(gemm_int4.w4_dequant_linear(x, *packed, group), want, "dequant+cuBLAS")
    deq = gemm_int4.w4_dequantize(*packed, group, dtype)
    ref = qu.dequantize_int4_groupwise(qu.unpack_int4_rows(packed[0]), *packed[1:], torch.float32)
    # One rounding of (q - z) * s (bf16: up to one ulp apart where splitting 16 s breaks a tie).
    torch.testing.assert_close(deq.float(), ref.to(dtype).float(), atol=0, rtol=8e-3)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("group,k", [(128, 512), (64, 512), (128, 384)])
@pytest.mark.parametrize("gate_out", [False, True])
@pytest.mark.parametrize("persist", [0, 1, 2], ids=["tile-a-program", "loop", "loop-2"])
@pytest.mark.parametrize("block_n,warps", [(8, 4), (4, 2)])
def test_w4_whole_k_equals_the_chained_loop(group: int, k: int, gate_out: bool,
                                            persist: int, block_n: int, warps: int) -> None:
    """whole_k: the program's whole slice in one chained product, equal to the chained loop's
    result within float32 summation order, plain and gate-out; K = 384 pads the tile to 512
    (the padding's words read 0 with scale 0); a slice too wide for the tile runs the loop.
    persist 1: four programs off CUDA (gemv.num_sms) loop over 6 tiles of 8 rows (3 gate-out)
    or 11 of 4 (6 gate-out), the last one ragged: programs of one, two and three tiles, so the
    loop's two buffers end on either one (persist 2: eight programs, one or two tiles each)."""
    n = 42
    packed = quantized(n, k, group, seed=5)
    g = torch.Generator().manual_seed(11)
    x, b = torch.randn(1, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    whole = W4Config(block_n=block_n, block_k=128, split_k=1, num_warps=warps, prefetch=True,
                     bit_convert=2, whole_k=True, persist=persist)
    path = gemv_int4._one_row_path(whole, x, group, n, k, 1)
    assert (path["WHOLE_K"], path["WHOLE_KP"]) == (k, 512)
    assert gemv_int4._one_row_path(whole, x, group, n, 64 * 1024, 1)["WHOLE_K"] == 0
    # word offsets past int32 (_whole_k_fits): the chained loop instead
    assert gemv_int4._one_row_path(whole, x, group, 2**25, k, 1)["WHOLE_K"] == 0
    loop = dataclasses.replace(whole, whole_k=False, persist=0)
    if gate_out:
        got = gemv_int4.w4_gemv_gate_out(x, *packed, group, b, whole)
        want = gemv_int4.w4_gemv_gate_out(x, *packed, group, b, loop)
    else:
        got = gemv_int4.w4_gemv(x, *packed, group, b, whole)
        want = gemv_int4.w4_gemv(x, *packed, group, b, loop)
        ref = gemv_int4.w4_linear_reference(x.double(), *packed, group, b.double())
        assert rel(got, ref) < 8e-3  # bf16 output rounding (see test_w4_gemv_bf16x2_pairs)
    assert rel(got, want) < 8e-3 and not torch.equal(got, torch.zeros_like(got))


def test_w4_gate_out_launches_the_path_the_tuner_timed(monkeypatch) -> None:
    """Gate-out reuses the plain product's measured config: both launches take the same path
    constexprs (_one_row_path), whole-K included."""
    launches: list[dict] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(gemv_int4, "_w4_gemv_kernel", Recorder())
    packed = quantized(64, 512, 128, seed=2)
    x = torch.randn(1, 512).bfloat16()
    cfg = W4Config(block_n=8, block_k=128, split_k=1, num_warps=4, prefetch=True,
                   bit_convert=2, whole_k=True)
    gemv_int4.w4_gemv(x, *packed, 128, None, cfg)
    gemv_int4.w4_gemv_gate_out(x, *packed, 128, None, cfg)
    keys = ("PREFETCH", "STAGES", "BF16X2", "CHAIN", "WHOLE_K")
    plain, gated = ({k: call[k] for k in keys} for call in launches)
    assert plain == gated and plain["WHOLE_K"] == 512
    # With persist both launches run the whole-K loop kernel instead, over the same K.
    monkeypatch.setattr(gemv_int4, "_w4_whole_k_loop_kernel", Recorder())
    launches.clear()
    loop = dataclasses.replace(cfg, persist=2)
    gemv_int4.w4_gemv(x, *packed, 128, None, loop)
    gemv_int4.w4_gemv_gate_out(x, *packed, 128, None, loop)
    assert [(call["K"], call["GATE_OUT"]) for call in launches] == [(512, False), (512, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 14336), (28672, 4096)])
def test_gpu_w4_whole_k_tiles(n: int, k: int) -> None:
    """Every whole-K candidate that fits (down's K padded to 16,384 words; gate_up as gate-out
    too) against the reference on the GPU, run twice, on a seeded x; every failure reported."""
    from slipstream.kernels.reference import silu_and_mul

    packed = quantized(n, k, 128, "cuda")
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    want = gemv_int4.w4_linear_reference(x, *packed, 128)
    tried, failures = 0, []
    for cfg in gemv_int4.candidate_w4_configs(1, torch.bfloat16):
        if not (cfg.whole_k and gemv_int4._one_row_path(cfg, x, 128, n, k, 1)["WHOLE_K"]):
            continue
        tried += 1
        got = [gemv_int4.w4_gemv(x, *packed, 128, None, cfg) for _ in range(2)]
        failures += [_gpu_error(out, want, cfg.label()) for out in got]
        if n > k:  # gate_up's shape, the one gate-out runs at: its epilogue against SiLU(gate)
            # times up of this kernel's own sums (the reference's bf16-rounded gate and up, each
            # 0.4% off, multiply into more than the tolerance at the output's largest entries)
            gated = gemv_int4.w4_gemv_gate_out(x, *packed, 128, None, cfg)
            failures.append(_gpu_error(gated, silu_and_mul(got[0].float()),
                                       cfg.label() + " gate-out"))
    assert tried >= 2
    failures = [f for f in failures if f]
    assert not failures, "\n".join(failures)



@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("cfg", [
    W4Config(block_n=8, block_k=128, split_k=1, num_warps=4, prefetch=True, bit_convert=2,
             whole_k=True),
    W4Config(block_n=4, block_k=128, split_k=1, num_warps=4, prefetch=True, bit_convert=2,
             whole_k=True, persist=1),
    W4Config(block_n=16, block_k=128, split_k=1, num_warps=4, prefetch=3, bit_convert=2),
    W4Config(block_n=16, block_k=128, split_k=1, num_warps=4, prefetch=True),
    W4Config(block_n=16, block_k=128, split_k=2, num_warps=4, prefetch=2, bit_convert=2),
    W4Config(block_n=16, block_k=128, split_k=3, num_warps=2, prefetch=True),
], ids=["whole-k", "whole-k-loop", "chained", "fma", "chained-split", "fma-split"])
@pytest.mark.parametrize("k", [512, 384])
def test_w4_rms_eps(cfg: W4Config, k: int) -> None:
    """The one-row W4 GEMV normalising its input row itself (rms_eps, a norm folded into the
    weight): equal to the product with x / rms(x), plain and gate-out (K = 384: a whole-K tile
    padded to 512 and a split's x read to 512, whose padding adds no squares); refused for two
    rows and, with a K split, an x too long to hold, and by the measured path off CUDA."""
    from slipstream.kernels.reference import silu_and_mul

    packed = quantized(42, k, 128, seed=7)
    g = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if cfg.bit_convert else torch.float32
    x, b = (5.0 * torch.randn(1, k, generator=g)).to(dtype), torch.randn(42, generator=g)
    want = gemv_int4.w4_linear_reference(rms_normed(x, 1e-6), *packed, 128, b.double())
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-5  # bf16 output rounding
    got = gemv_int4.w4_gemv(x, *packed, 128, b.to(dtype), cfg, rms_eps=1e-6)
    assert rel(got, want) < tol
    got = gemv_int4.w4_gemv_gate_out(x, *packed, 128, b.to(dtype), cfg, rms_eps=1e-6)
    # gate and up are each the product's value (bf16: packed-bf16 sums, ~4e-3 apart), rounded
    # to the output dtype before SiLU(gate)·up: twice the product's tolerance
    assert rel(got, silu_and_mul(want.to(dtype).double())) < 2 * tol
    with pytest.raises(ValueError, match="one row"):
        gemv_int4.w4_gemv(x.expand(2, k), *packed, 128, None, cfg, rms_eps=1e-6)
    long_k = 64 * 32 * cfg.num_warps + 128  # over gemv.split_rms_fits' 64 elements a thread
    x_long = torch.ones(1, long_k, dtype=dtype)
    with pytest.raises(ValueError, match="split_rms_fits"):
        gemv_int4.w4_gemv(x_long, *quantized(8, long_k, 128), 128, None,
                          dataclasses.replace(cfg, split_k=2, whole_k=False, persist=0),
                          rms_eps=1e-6)
    assert gemv_int4.w4_linear_small_rms(x, *packed, 128, None, 1e-6) is None


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096)])
def test_gpu_w4_rms_every_candidate(n: int, k: int) -> None:
    """Every one-row candidate (K splits included: gemv.rms_ok) normalises x itself (plain and
    gate-out) on the GPU, as the reference of x / rms(x); the measured entry point agrees."""
    from slipstream.kernels.reference import silu_and_mul

    packed = quantized(n, k, 128, "cuda")
    x = 6.0 * torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    want = gemv_int4.w4_linear_reference(rms_normed(x, 1e-5).float(), *packed, 128)
    tried = 0
    for cfg in gemv_int4.candidate_w4_configs(1, torch.bfloat16):
        if not gemv_int4.rms_ok(1, n, k, cfg, x.device):
            continue
        tried += 1
        _gpu_check(gemv_int4.w4_gemv(x, *packed, 128, None, cfg, rms_eps=1e-5), want,
                   cfg.label())
        got = gemv_int4.w4_gemv_gate_out(x, *packed, 128, None, cfg, rms_eps=1e-5)
        _gpu_check(got, silu_and_mul(want.float()), cfg.label() + " gate-out")
    assert tried >= 4
    got = gemv_int4.w4_linear_small_rms(x, *packed, 128, None, 1e-5)
    if got is not None:  # the measured config keeps K whole
        _gpu_check(got, want, "w4_linear_small_rms")
