"""W8A8 FP8 tensor-core GEMV (kernels/gemv_fp8.py) against its torch twin and quantization/fp8.py.

CPU: Triton's interpreter, float32 activations (its float32 -> bf16 cast truncates, so bf16 runs
are checked to one bf16 ulp). The kernel's FP8 products are exact and its activation quantization
is bit-exact, so float32 results agree with the twins to float32 summation order (1e-5).
GPU (`-m gpu`): bf16 activations, the Llama-3.1-8B layer shapes, every candidate config.
"""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels import gemv, gemv_fp8, gemv_int8
from slipstream.kernels.gemv_fp8 import Fp8GemvConfig
from slipstream.kernels.reference import silu_and_mul
from slipstream.quantization import utils
from slipstream.quantization.fp8 import fp8_linear_reference

pytestmark = pytest.mark.usefixtures("poison_outputs")
FP8_REL = 1e-5  # float32 summation order (the FP8 x FP8 products themselves are exact)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _qweight(n: int, k: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return utils.quantize_fp8_per_channel(torch.randn(n, k, device=device))


def _linear_ref(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None,
                gated: bool = False) -> torch.Tensor:
    """quantization/fp8.py's oracle (dequantized operands), plus the bias."""
    x2 = silu_and_mul(x) if gated else x
    out = fp8_linear_reference(x2, q, s)
    return out if b is None else out + b


CONFIGS = [Fp8GemvConfig(block_n=16, block_k=64, split_k=1),    # no split, K tail masked
           Fp8GemvConfig(block_n=32, block_k=128, split_k=0),   # split from the shape
           Fp8GemvConfig(block_n=16, block_k=64, split_k=3, weight_a=False)]


@pytest.mark.parametrize("m,n,k", [(1, 37, 300), (3, 50, 256), (16, 65, 333)])
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_gemv_interpreter(m: int, n: int, k: int, cfg: Fp8GemvConfig, with_bias: bool) -> None:
    x = torch.randn(m, k)
    q, s = _qweight(n, k)
    b = torch.randn(n) if with_bias else None
    got = gemv_fp8.fp8_gemv(x, q, s, b, cfg)
    assert got.shape == (m, n) and got.dtype == x.dtype and torch.isfinite(got).all()
    assert _rel(got, gemv_fp8.fp8_gemv_reference(x, q, s, b)) < FP8_REL
    assert _rel(got, _linear_ref(x, q, s, b)) < FP8_REL


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2]])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_fp8_gemv_gated_input(cfg: Fp8GemvConfig, m: int) -> None:
    """gated=True: silu(gate) * up is formed while loading x, and its amax is over that row."""
    gate_up = torch.randn(m, 600)  # K = 300: the masked tail reads gate and up correctly
    q, s = _qweight(45, 300)
    b = torch.randn(45)
    got = gemv_fp8.fp8_gemv(gate_up, q, s, b, cfg, gated=True)
    assert _rel(got, gemv_fp8.fp8_gemv_reference(gate_up, q, s, b, gated=True)) < FP8_REL
    assert _rel(got, _linear_ref(gate_up, q, s, b, gated=True)) < FP8_REL


def _e4m3_ties() -> torch.Tensor:
    """Every midpoint between neighbouring finite E4M3 values (where rounding must tie to even)."""
    bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    vals = bits.view(torch.float8_e4m3fn).float().unique()
    return (vals[1:] + vals[:-1]) / 2


def test_activation_quantization_is_bit_exact() -> None:
    """With an identity weight, out[m, n] = xq[m, n] * x_scale[m]: one rounding, the same in the
    twin. Row 0: amax 448 (scale 1), values exactly on E4M3 ties and the subnormal range. Rows
    1-3: every tie times a scale that is not a power of two, so the quotient falls within an ulp
    of the tie and only a correctly rounded division picks torch's side. Row 4: zeros."""
    k = 256
    q = torch.eye(k).to(torch.float8_e4m3fn)
    x = torch.zeros(5, k)
    ties = _e4m3_ties()  # 252 of them; the last columns stay zero
    t = slice(1, 1 + ties.numel())
    x[0, 0], x[0, t] = 448.0, ties
    for row, s in zip((1, 2, 3), (0.0123, 3.7, 1.3e-4)):
        scale = torch.tensor(448.0 * s) / 448.0  # float32, as the per-token amax gives it
        x[row, 0], x[row, t] = 448.0 * scale, ties * scale
    xq, xs = utils.quantize_per_token(x, utils.FP8_DTYPE)
    for cfg in (CONFIGS[0], CONFIGS[2]):
        got = gemv_fp8.fp8_gemv(x, q, torch.ones(k), None, cfg)
        torch.testing.assert_close(got, xq.float() * xs, atol=0, rtol=0)
        assert (got[4] == 0).all()


def test_zero_row_gives_bias() -> None:
    x = torch.randn(4, 200)
    x[2] = 0
    q, s = _qweight(33, 200)
    b = torch.randn(33)
    got = gemv_fp8.fp8_gemv(x, q, s, b, Fp8GemvConfig(block_n=16, block_k=64, split_k=2))
    torch.testing.assert_close(got[2], b, atol=0, rtol=0)
    assert _rel(got, _linear_ref(x, q, s, b)) < FP8_REL


@pytest.mark.parametrize("m", [1, 5])
def test_split_k_counters_and_determinism(m: int) -> None:
    x = torch.randn(m, 300)
    q, s = _qweight(45, 300)
    cfg = Fp8GemvConfig(block_n=16, block_k=64, split_k=5)  # uneven: the last split is shorter
    out = gemv_fp8.fp8_gemv(x, q, s, None, cfg)
    assert _rel(out, gemv_fp8.fp8_gemv_reference(x, q, s)) < FP8_REL
    for buf in gemv._COUNTERS.values():  # the last program of each tile reset its counter
        assert int(buf.abs().sum()) == 0
    torch.testing.assert_close(gemv_fp8.fp8_gemv(x, q, s, None, cfg), out, atol=0, rtol=0)


def test_bf16_input_and_leading_dims() -> None:
    x = torch.randn(2, 3, 256).bfloat16()
    q, s = _qweight(40, 256)
    got = gemv_fp8.fp8_gemv(x, q, s, None, CONFIGS[1])
    want = gemv_fp8.fp8_gemv_reference(x, q, s)
    assert got.shape == (2, 3, 40) and got.dtype == torch.bfloat16
    # The interpreter truncates float32 -> bf16: at most one bf16 ulp (2^-7 relative) apart.
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0**-7 + 1e-6).all()


def test_fp8_linear_small_off_cuda_uses_default_config() -> None:
    x = torch.randn(1, 300)
    q, s = _qweight(37, 300)
    got = gemv_fp8.fp8_linear_small(x, q, s)
    assert _rel(got, gemv_fp8.fp8_gemv_reference(x, q, s)) < FP8_REL
    assert all(key[-1] is not None for key in gemv_fp8._CHOICES)  # nothing measured off CUDA


def test_measure_skips_failures_and_picks_the_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner's choice logic, with the CUDA-graph timer replaced by fixed times: a config that
    does not compile is skipped, and for a gated input the separate-activation variants compete."""
    cfgs = [Fp8GemvConfig(block_n=48, block_k=64),  # 48: not a power of two, does not compile
            Fp8GemvConfig(block_n=16, block_k=64, split_k=1),
            Fp8GemvConfig(block_n=32, block_k=64, split_k=2)]
    times = iter([5.0, 3.0, 4.0, 2.0])  # in order: cfg 1, cfg 2, cfg 1 + act, cfg 2 + act
    monkeypatch.setattr(gemv_fp8, "candidate_fp8_configs", lambda m: cfgs)
    monkeypatch.setattr(gemv_fp8, "weight_copies", lambda tensors: [tuple(tensors)])
    monkeypatch.setattr(gemv_fp8, "graph_time_us", lambda run, sets: (run(sets[0]), next(times))[1])
    q, s = _qweight(40, 128)
    choice = gemv_fp8._measure(2, q, s, None, torch.float32, gated=True)
    assert choice == gemv_fp8._Choice(cfgs[2], separate_act=True)
    # Every timing fails now (no times left): no choice, and fp8_linear_small falls back.
    assert gemv_fp8._measure(2, q, s, None, torch.float32, gated=False) is None


def test_fp8_linear_small_follows_the_recorded_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    q, s = _qweight(40, 128)
    gate_up, b = torch.randn(3, 256), torch.randn(40)
    key = (4, 40, 128, torch.float32, True, None)
    monkeypatch.setitem(gemv_fp8._CHOICES, key, gemv_fp8._Choice(CONFIGS[0], separate_act=True))
    got = gemv_fp8.fp8_linear_small(gate_up, q, s, b, gated=True)
    assert _rel(got, gemv_fp8.fp8_gemv_reference(gate_up, q, s, b, gated=True)) < FP8_REL
    # No working candidate: the dequant-GEMV (bf16-style activations, no FP8 quantization).
    monkeypatch.setitem(gemv_fp8._CHOICES, key, None)
    got = gemv_fp8.fp8_linear_small(gate_up, q, s, b, gated=True)
    assert _rel(got, gemv_int8.qgemv_reference(silu_and_mul(gate_up), q, s, b)) < 1e-5


def test_rejects_bad_operands() -> None:
    q, s = _qweight(8, 64)
    with pytest.raises(TypeError):
        gemv_fp8.fp8_gemv(torch.randn(1, 64), q.float(), s)
    with pytest.raises(ValueError):
        gemv_fp8.fp8_gemv(torch.randn(17, 64), q, s)
    with pytest.raises(ValueError):
        gemv_fp8.fp8_gemv(torch.randn(1, 64), q, s, gated=True)


# --- GPU: the Llama-3.1-8B shapes, every candidate -------------------------------------------

LLAMA = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
_WEIGHTS: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _gpu_weight(k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if (k, n) not in _WEIGHTS:
        torch.manual_seed(k + n)
        _WEIGHTS[(k, n)] = _qweight(n, k, "cuda")
    return _WEIGHTS[(k, n)]


def _assert_gpu_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 outputs: the kernel's float32 sum differs from the twin's only in order (and wgmma's
    FP8 accumulation within 128 k), so both round to the same or a neighbouring bf16 value."""
    assert torch.isfinite(got).all()
    assert _rel(got, want) < 4e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                               atol=2e-3 * want.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("layer", list(LLAMA))
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("cfg", gemv_fp8.candidate_fp8_configs(1), ids=repr)
def test_gpu_llama_shapes(layer: str, m: int, cfg: Fp8GemvConfig) -> None:
    k, n = LLAMA[layer]
    q, s = _gpu_weight(k, n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = gemv_fp8.fp8_gemv(x, q, s, None, cfg)
    _assert_gpu_close(got, gemv_fp8.fp8_gemv_reference(x, q, s))
    _assert_gpu_close(got, _linear_ref(x, q, s, None).to(torch.bfloat16))
    if cfg.split_k != 1:  # fixed-order split-K reduction: bitwise the same on a second run
        torch.testing.assert_close(gemv_fp8.fp8_gemv(x, q, s, None, cfg), got, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("cfg", gemv_fp8.candidate_fp8_configs(1), ids=repr)
def test_gpu_gated_down(m: int, cfg: Fp8GemvConfig) -> None:
    k, n = LLAMA["down"]
    q, s = _gpu_weight(k, n)
    gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    got = gemv_fp8.fp8_gemv(gate_up, q, s, b, cfg, gated=True)
    _assert_gpu_close(got, gemv_fp8.fp8_gemv_reference(gate_up, q, s, b, gated=True))


@pytest.mark.gpu
def test_gpu_identity_weight_is_bit_exact() -> None:
    """The in-kernel quantization (cvt.rn, fma-corrected division) equals torch's bit for bit."""
    k = 256
    q = torch.eye(k, device="cuda").to(torch.float8_e4m3fn)
    x = torch.randn(5, k, device="cuda") * torch.logspace(-3, 3, 5, device="cuda")[:, None]
    xq, xs = utils.quantize_per_token(x, utils.FP8_DTYPE)
    for cfg in gemv_fp8.candidate_fp8_configs(1):
        got = gemv_fp8.fp8_gemv(x, q, torch.ones(k, device="cuda"), None, cfg)
        torch.testing.assert_close(got, xq.float() * xs, atol=0, rtol=0, msg=repr(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_measured_choice_and_graph(gated: bool) -> None:
    """fp8_linear_small measures a working config, and the kernel replays in a CUDA graph (with
    programmatic dependent launch where the device supports it) to the eager result."""
    k, n = LLAMA["down"] if gated else LLAMA["o"]
    q, s = _gpu_weight(k, n)
    x = torch.randn(1, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
    eager = gemv_fp8.fp8_linear_small(x, q, s, gated=gated)
    key = (1, n, k, torch.bfloat16, gated, x.device.index)
    assert gemv_fp8._CHOICES[key] is not None, "no candidate config compiled and matched"
    print("measured choice:", gemv_fp8._CHOICES[key])
    _assert_gpu_close(eager, gemv_fp8.fp8_gemv_reference(x, q, s, gated=gated))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_fp8.fp8_linear_small(x, q, s, gated=gated)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
