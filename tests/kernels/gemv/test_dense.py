"""Triton GEMV / skinny GEMM (split-K with in-kernel reduction) and the op table's `linear`."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels import OP_NAMES, get_ops, triton_ops
from slipstream.kernels.gemv import dense as gemv

pytestmark = pytest.mark.usefixtures("poison_outputs")


def _ref(x, w, b):
    """float64 product: the kernel must land within float32 rounding of it."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _assert_close(got, x, w, b, rel=1e-5) -> None:
    want = _ref(x, w, b)
    err = (got.double() - want).norm() / want.norm()
    assert torch.isfinite(got).all() and err < rel, f"relative error {err:.2e}"


@pytest.mark.parametrize("m,n,k", [(1, 37, 300), (1, 130, 1024), (2, 50, 333), (7, 65, 256),
                                   (16, 64, 520)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_default_config(m: int, n: int, k: int, with_bias: bool) -> None:
    x, w = torch.randn(m, k), torch.randn(n, k)
    b = torch.randn(n) if with_bias else None
    _assert_close(gemv.gemv(x, w, b), x, w, b)


@pytest.mark.parametrize("cfg", [
    gemv.GemvConfig(block_n=16, block_k=64, split_k=5),   # uneven: last split is shorter
    gemv.GemvConfig(block_n=8, block_k=128, split_k=3),
    gemv.GemvConfig(block_n=32, block_k=32, split_k=1),
    gemv.GemvConfig(block_n=8, block_k=64, split_k=2, num_stages=4),  # pipelined loop (M == 1)
    gemv.GemvConfig(block_n=4, block_k=512, split_k=1, prefetch=True),  # one tile spans K
])
@pytest.mark.parametrize("m", [1, 5])
def test_gemv_split_k(cfg: gemv.GemvConfig, m: int) -> None:
    k, n = 300, 45
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    out = gemv.gemv(x, w, b, cfg)
    _assert_close(out, x, w, b)
    # The last program to arrive resets each tile counter: the next call starts from zero.
    for buf in gemv.COUNTERS.values():
        assert int(buf.abs().sum()) == 0
    # Fixed-order reduction: bitwise the same on a second run.
    torch.testing.assert_close(gemv.gemv(x, w, b, cfg), out, atol=0, rtol=0)


@pytest.mark.parametrize("cfg", [gemv.GemvConfig(block_n=16, block_k=64, split_k=3),
                                 gemv.GemvConfig(block_n=8, block_k=128, split_k=1, prefetch=True),
                                 gemv.GemvConfig(block_n=8, block_k=64, split_k=1, num_stages=3),
                                 gemv.GemvConfig(block_n=4, block_k=512, split_k=1, prefetch=True)])
@pytest.mark.parametrize("m", [1, 5])
def test_gemv_gated_input(cfg: gemv.GemvConfig, m: int) -> None:
    """gated=True computes silu(gate) * up while loading x: same as silu_and_mul, then gemv."""
    from slipstream.kernels.reference import silu_and_mul

    k = 300  # not a multiple of block_k: the masked tail reads gate and up correctly
    gate_up, w, b = torch.randn(m, 2 * k), torch.randn(45, k), torch.randn(45)
    got = gemv.gemv(gate_up, w, b, cfg, gated=True)
    _assert_close(got, silu_and_mul(gate_up), w, b)
    with pytest.raises(ValueError, match="2K"):
        gemv.gemv(gate_up[:, :k], w, b, cfg, gated=True)


def test_gemv_leading_dims_and_limits() -> None:
    x, w = torch.randn(2, 3, 96), torch.randn(40, 96)
    out = gemv.gemv(x, w)
    assert out.shape == (2, 3, 40)
    _assert_close(out.reshape(6, 40), x.reshape(6, 96), w, None)
    with pytest.raises(ValueError):
        gemv.gemv(torch.randn(gemv.MAX_M + 1, 96), w)


def test_linear_dispatch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, b = torch.randn(3, 64), torch.randn(24, 64), torch.randn(24)
    _assert_close(triton_ops.linear(x, w, b, impl="triton"), x, w, b)
    # Automatic choice on the CPU is torch: the kernel must not be called.
    monkeypatch.setattr(gemv, "gemv", lambda *a, **kw: pytest.fail("kernel used on CPU"))
    torch.testing.assert_close(triton_ops.linear(x, w, b), F.linear(x, w, b))
    big = torch.randn(gemv.MAX_M + 4, 64)  # large M always goes to cuBLAS / torch
    torch.testing.assert_close(triton_ops.linear(big, w, b, impl="triton"), F.linear(big, w, b))


def test_measured_choice_logic(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner keeps the fastest correct config, skips wrong ones, and can pick cuBLAS."""
    w, b = torch.randn(40, 64), torch.randn(40)
    cands = gemv.candidate_configs(1, 40, 64)[:3]
    monkeypatch.setattr(gemv, "candidate_configs", lambda m, n, k: cands)
    times = iter([5.0, 3.0, 1.0, 2.0])  # cuBLAS, then each candidate timed, in order
    monkeypatch.setattr(triton_ops, "graph_time_us", lambda call, sets, **kw: (call(sets[0]), next(times))[1])
    real_gemv = gemv.gemv

    def broken_second(x, w_, b_=None, config=None):  # candidate 1 computes a wrong answer
        out = real_gemv(x, w_, b_, config)
        return out + 1.0 if config == cands[1] else out

    monkeypatch.setattr(gemv, "gemv", broken_second)
    # Candidate 1 is never timed (wrong result), so candidate 2 gets 1.0 ms and wins; had
    # candidate 1 been timed it would have taken the 1.0 ms and been chosen.
    assert triton_ops._measure(1, w, b, torch.float32) == cands[2]
    times = iter([0.5, 3.0, 2.0])
    assert triton_ops._measure(1, w, b, torch.float32) is None  # cuBLAS is fastest


def test_op_table_names() -> None:
    table = get_ops("cpu", use_triton=True)
    assert table.name == "triton"
    for name in OP_NAMES + ("linear",):
        fn = getattr(table, name)
        assert callable(fn) and fn.__module__.startswith("slipstream.kernels.")
        assert fn.__module__ != "slipstream.kernels.reference", f"{name} fell back"


# ---------------------------------------------------------------------------- GPU (bf16)
LLAMA_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)]


def _gpu_inputs(m: int, k: int, n: int):
    dev, dt = "cuda", torch.bfloat16
    return (torch.randn(m, k, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt),
            torch.randn(n, device=dev, dtype=dt))


def _gpu_check(x, w, b, cfg) -> None:
    want = F.linear(x.float(), w.float(), b.float())
    got = gemv.gemv(x, w, b, cfg).float()
    # float32 accumulation of bf16 products, one bf16 rounding of the result.
    err = (got - want).norm() / want.norm()
    assert torch.isfinite(got).all() and err < 5e-3, f"{cfg}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", LLAMA_8B + [(1000, 333), (4104, 72)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gpu_gemv_bf16(k: int, n: int, m: int) -> None:
    _gpu_check(*_gpu_inputs(m, k, n), None)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(4096, 4096), (1000, 333)])
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_gemv_every_candidate(k: int, n: int, m: int) -> None:
    """Every config the tuner may pick (split-K and prefetch variants included) is correct."""
    x, w, b = _gpu_inputs(m, k, n)
    for cfg in gemv.candidate_configs(m, n, k):
        _gpu_check(x, w, b, cfg)
        _gpu_check(x, w, b, cfg)  # second call: the split-K counters were left at zero


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gpu_linear_gated_down_proj(m: int) -> None:
    """The Llama-8B down projection with silu(gate) * up computed inside the GEMV."""
    from slipstream.kernels.reference import silu_and_mul

    gate_up = torch.randn(m, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16) / 100
    want = F.linear(silu_and_mul(gate_up).float(), w.float())
    for got in (gemv.gemv(gate_up, w, None, gated=True),
                triton_ops.linear_gated(gate_up, w, None, silu_and_mul)):
        err = (got.float() - want).norm() / want.norm()
        assert err < 5e-3, f"relative error {err:.2e}"


@pytest.mark.gpu
def test_gpu_linear_measured_choice() -> None:
    dev, dt = "cuda", torch.bfloat16
    w = torch.randn(4096, 4096, device=dev, dtype=dt)
    for m in (1, 4, 16, 64):
        x = torch.randn(m, 4096, device=dev, dtype=dt)
        got = triton_ops.linear(x, w).float()
        want = F.linear(x.float(), w.float())
        assert (got - want).norm() / want.norm() < 5e-3
    assert triton_ops.linear_choices()  # the small-M shapes were measured and recorded


@pytest.mark.gpu
def test_gpu_gemv_graph_replay() -> None:
    """Split-K arrival counters reset themselves: graph replays stay correct."""
    x, w, b = _gpu_inputs(1, 14336, 4096)
    cfg = gemv.GemvConfig(block_n=16, block_k=512, split_k=4)
    gemv.gemv(x, w, b, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.gemv(x, w, b, cfg)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = F.linear(x.float(), w.float(), b.float())
        assert (out.float() - want).norm() / want.norm() < 5e-3


# ------------------------------------------- gate_out: the gate/up GEMV writes SiLU(gate)·up
@pytest.mark.parametrize("cfg", [gemv.GemvConfig(block_n=8, block_k=64, split_k=3),
                                 gemv.GemvConfig(block_n=4, block_k=128, split_k=1, prefetch=True),
                                 gemv.GemvConfig(block_n=16, block_k=64, num_stages=2),
                                 gemv.GemvConfig(block_n=2, block_k=64, split_k=2),
                                 gemv.GemvConfig(block_n=4, block_k=512, split_k=1, prefetch=True)])
@pytest.mark.parametrize("half,k,with_bias", [(45, 300, True), (64, 256, False)])
def test_gemv_gate_out(cfg: gemv.GemvConfig, half: int, k: int, with_bias: bool) -> None:
    """One row, a [gate | up] weight: silu_and_mul of the product in one launch, equal to the
    product then the activation (split-K, a partial last tile, bias on both halves)."""
    from slipstream.kernels.reference import silu_and_mul

    x, w = torch.randn(1, k), torch.randn(2 * half, k)
    b = torch.randn(2 * half) if with_bias else None
    got = gemv.gemv(x, w, b, cfg, gate_out=True)
    assert got.shape == (1, half)
    want = silu_and_mul(F.linear(x.double(), w.double(), None if b is None else b.double()))
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5


def test_gate_out_launches_the_path_the_tuner_timed(monkeypatch) -> None:
    """gate_out reuses the plain product's measured config, so it must launch the same loop
    constexprs: a whole-K tile sent down the loop path instead spilled registers on the H200
    (int8 W1 decode ~360 -> 10 tok/s) while every result stayed correct."""
    launches: list[dict] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(gemv, "gemv_kernel", Recorder())
    x, w = torch.randn(1, 256), torch.randn(64, 256)
    for cfg in [gemv.GemvConfig(block_n=4, block_k=256, split_k=1, prefetch=True),
                gemv.GemvConfig(block_n=8, block_k=64, split_k=2, prefetch=True)]:
        launches.clear()
        gemv.gemv(x, w, None, cfg)
        gemv.gemv(x, w, None, cfg, gate_out=True)
        keys = ("PREFETCH", "STAGES", "WHOLE_K")
        plain, gated = ({k: call[k] for k in keys} for call in launches)
        assert plain == gated and plain["WHOLE_K"] == (cfg.block_k >= 256), cfg


def test_gate_out_limits() -> None:
    one_row = gemv.GemvConfig(block_n=8, block_k=64)
    assert gemv.gate_out_ok(1, 64, one_row)
    assert not gemv.gate_out_ok(2, 64, one_row)  # one row only
    assert not gemv.gate_out_ok(1, 63, one_row)  # [gate | up] halves
    assert not gemv.gate_out_ok(1, 64, gemv.GemvConfig(block_n=32, block_k=64, dot=True))
    assert not gemv.gate_out_ok(1, 64, None)  # cuBLAS chosen
    with pytest.raises(ValueError, match="gate_out"):
        gemv.gemv(torch.randn(2, 64), torch.randn(16, 64), None, one_row, gate_out=True)
    # Off CUDA the automatic path never takes it (the caller then runs the two steps).
    assert triton_ops.linear_gate_out(torch.randn(1, 64), torch.randn(16, 64), None) is None


@pytest.mark.gpu
@pytest.mark.parametrize("k,half", [(4096, 14336), (1000, 333)])
def test_gpu_gate_out_equals_two_steps(k: int, half: int) -> None:
    """bf16 on the GPU, every one-row candidate: the same bits as the product, then the
    Triton silu_and_mul (same per-row sums, same activation formula and roundings)."""
    ops = get_ops("cuda")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * half, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    for cfg in gemv.candidate_configs(1, 2 * half, k):
        want = ops.silu_and_mul(gemv.gemv(x, w, None, cfg))
        assert torch.equal(gemv.gemv(x, w, None, cfg, gate_out=True), want), cfg


# ------------------------------------------- rms_eps: the one-row GEMV normalises its own input
def _rms_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


RMS_CONFIGS = [gemv.GemvConfig(block_n=4, block_k=512, split_k=1, prefetch=True),  # whole K
               gemv.GemvConfig(block_n=8, block_k=64, split_k=1, prefetch=2),
               gemv.GemvConfig(block_n=16, block_k=128, split_k=1, num_stages=2),
               gemv.GemvConfig(block_n=8, block_k=64, split_k=3, prefetch=True),  # K split
               gemv.GemvConfig(block_n=16, block_k=128, split_k=2, num_stages=2)]


@pytest.mark.parametrize("cfg", RMS_CONFIGS)
@pytest.mark.parametrize("k,with_bias", [(300, True), (256, False)])
def test_gemv_rms_eps_normalises_x(cfg: gemv.GemvConfig, k: int, with_bias: bool) -> None:
    """One row, rms_eps: the product with x / rms(x) (an RMSNorm of weight 1, the weight folded
    into w), bias added after the scaling; the plain and gate_out launches alike. x is scaled
    far from rms 1 so a missing or misplaced normalisation fails."""
    from slipstream.kernels.reference import silu_and_mul

    x, w = 7.0 * torch.randn(1, k), torch.randn(90, k)
    b = torch.randn(90) if with_bias else None
    want = F.linear(_rms_normed(x, 1e-5), w.double(), None if b is None else b.double())
    got = gemv.gemv(x, w, b, cfg, rms_eps=1e-5)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
    got = gemv.gemv(x, w, b, cfg, gate_out=True, rms_eps=1e-5)
    assert ((got.double() - silu_and_mul(want)).norm() / silu_and_mul(want).norm()).item() < 1e-5


def test_gemv_rms_eps_limits() -> None:
    """rms_eps needs one row, a plain input and, with a K split, an x short enough for every
    program to hold it (64 elements a thread)."""
    w = torch.randn(64, 256)
    whole = RMS_CONFIGS[0]
    cpu = torch.device("cpu")
    assert gemv.rms_ok(1, 64, 256, whole, cpu)
    assert not gemv.rms_ok(2, 64, 256, whole, cpu)
    split = gemv.GemvConfig(block_n=8, block_k=64, split_k=2, num_warps=1)
    assert gemv.rms_ok(1, 64, 256, split, cpu) and gemv.rms_ok(1, 64, 2048, split, cpu)
    assert not gemv.rms_ok(1, 64, 2049, split, cpu)
    assert not gemv.rms_ok(1, 64, 256, None, cpu)  # cuBLAS chosen
    with pytest.raises(ValueError, match="too long"):
        gemv.gemv(torch.randn(1, 4096), torch.randn(64, 4096), None, split, rms_eps=1e-5)
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv(torch.randn(2, 256), w, None, whole, rms_eps=1e-5)
    # off CUDA the measured paths decline: the caller runs the norm kernel
    assert triton_ops.linear_rms(torch.randn(1, 256), w, None, 1e-5) is None


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 28672), (1000, 334)])
def test_gpu_gemv_rms_every_candidate(k: int, n: int) -> None:
    """bf16, one row: every candidate that can (rms_ok, K splits included) normalises x itself,
    plain and gate_out, within bf16 rounding of x / rms(x) in float64; x far from rms 1."""
    from slipstream.kernels.reference import silu_and_mul

    x = 6.0 * torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    want = F.linear(_rms_normed(x, 1e-5), w.double())
    tried = 0
    for cfg in gemv.candidate_configs(1, n, k):
        if not gemv.rms_ok(1, n, k, cfg, x.device):
            continue
        tried += 1
        got = gemv.gemv(x, w, None, cfg, rms_eps=1e-5)
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-2, cfg
        if gemv.gate_out_ok(1, n, cfg):
            got = gemv.gemv(x, w, None, cfg, gate_out=True, rms_eps=1e-5)
            ref = silu_and_mul(want)
            assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2, cfg
    assert tried
