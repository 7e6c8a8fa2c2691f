"""Triton rotary embedding and paged KV-cache writes (separate and fused) vs the reference."""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.attention.rotary_cache import apply_rotary, rotary_and_cache_write, write_kv_cache

pytestmark = pytest.mark.usefixtures("poison_outputs")
ATOL, RTOL = 1e-5, 1e-5  # float32: the same products, possibly fused differently


def _cos_sin(max_pos: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def _qkv(tokens: int, hq: int, hkv: int, d: int, dtype=torch.float32, device="cpu"):
    """q, k, v as strided views of one fused QKV output, like the model produces."""
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, dtype=dtype, device=device)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
    return q, k, v


def _caches(num_blocks: int, block_size: int, hkv: int, d: int, dtype=torch.float32,
            device="cpu"):
    shape = (num_blocks, block_size, hkv, d)
    return (torch.randn(shape, dtype=dtype, device=device),
            torch.randn(shape, dtype=dtype, device=device))


def _slots(tokens: int, num_slots: int, skip_every: int = 3, device="cpu") -> torch.Tensor:
    """Distinct random slots, every skip_every-th token marked -1 (not written)."""
    slots = torch.randperm(num_slots)[:tokens].to(torch.int64)
    slots[::skip_every] = -1
    return slots.to(device)


@pytest.mark.parametrize("hq,d", [(4, 64), (3, 128), (5, 80)])
def test_apply_rotary(hq: int, d: int) -> None:
    x = torch.randn(9, hq, d)
    cs = _cos_sin(512, d)
    pos = torch.randint(0, 512, (9,))
    torch.testing.assert_close(apply_rotary(x, pos, cs), reference.apply_rotary(x, pos, cs),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache(block_size: int) -> None:
    _, k, v = _qkv(11, 4, 2, 64)
    kc, vc = _caches(5, block_size, 2, 64)
    slots = _slots(11, 5 * block_size)
    want_k, want_v = kc.clone(), vc.clone()
    reference.write_kv_cache(k, v, want_k, want_v, slots)
    write_kv_cache(k, v, kc, vc, slots)
    # Exact: a copy; slots of skipped tokens and untouched rows keep their old values.
    torch.testing.assert_close(kc, want_k, atol=0, rtol=0)
    torch.testing.assert_close(vc, want_v, atol=0, rtol=0)


@pytest.mark.parametrize("hq,hkv,d,block_size", [(8, 2, 64, 16), (4, 4, 128, 32), (6, 2, 80, 16)])
def test_rotary_and_cache_write(hq: int, hkv: int, d: int, block_size: int) -> None:
    tokens = 13
    q, k, v = _qkv(tokens, hq, hkv, d)
    kc, vc = _caches(4, block_size, hkv, d)
    cs = _cos_sin(256, d)
    pos = torch.randint(0, 256, (tokens,))
    slots = _slots(tokens, 4 * block_size)
    want_k, want_v = kc.clone(), vc.clone()
    want_q, want_kr = reference.rotary_and_cache_write(q, k, v, pos, cs, want_k, want_v, slots)
    got_q, got_kr = rotary_and_cache_write(q, k, v, pos, cs, kc, vc, slots)
    torch.testing.assert_close(got_q, want_q, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got_kr, want_kr, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(kc, want_k, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(vc, want_v, atol=0, rtol=0)


# ------------------------------------------------------- fp8 / int8 caches (interpreter)
QUANT_DTYPES = [torch.float8_e4m3fn, torch.int8]


def _qcaches(num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype,
             device="cpu"):
    """1-byte caches holding random old entries (skipped slots must keep them)."""
    kc, vc = _caches(num_blocks, block_size, hkv, d, device=device)
    return reference.quantize_kv(kc * 20, dtype), reference.quantize_kv(vc * 20, dtype)


def _scales(device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    # Small enough that the largest inputs clamp: the clamp path is exercised too.
    return (torch.tensor(0.011, device=device), torch.tensor(0.019, device=device))


def _same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), \
        f"{int((got.view(torch.uint8) != want.view(torch.uint8)).sum())} entries differ"


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_write_kv_cache_quantized(dtype: torch.dtype) -> None:
    _, k, v = _qkv(11, 4, 2, 64)
    kc, vc = _qcaches(5, 16, 2, 64, dtype)
    ks, vs = _scales()
    slots = _slots(11, 5 * 16)
    want_k, want_v = kc.clone(), vc.clone()
    reference.write_kv_cache(k, v, want_k, want_v, slots, k_scale=ks, v_scale=vs)
    write_kv_cache(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    # Exact: the same float32 quotient, clamp and rounding rule (fp8: nearest even).
    _same_bytes(kc, want_k)
    _same_bytes(vc, want_v)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("hq,hkv,d,block_size", [(8, 2, 64, 16), (6, 2, 80, 32)])
def test_rotary_and_cache_write_quantized(dtype: torch.dtype, hq: int, hkv: int, d: int,
                                          block_size: int) -> None:
    tokens = 13
    q, k, v = _qkv(tokens, hq, hkv, d)
    kc, vc = _qcaches(4, block_size, hkv, d, dtype)
    ks, vs = _scales()
    cs = _cos_sin(256, d)
    pos = torch.randint(0, 256, (tokens,))
    slots = _slots(tokens, 4 * block_size)
    want_k, want_v = kc.clone(), vc.clone()
    want_q, want_kr = reference.rotary_and_cache_write(q, k, v, pos, cs, want_k, want_v, slots,
                                                       k_scale=ks, v_scale=vs)
    got_q, got_kr = rotary_and_cache_write(q, k, v, pos, cs, kc, vc, slots, k_scale=ks,
                                           v_scale=vs)
    torch.testing.assert_close(got_q, want_q, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got_kr, want_kr, atol=ATOL, rtol=RTOL)
    # K is rotated first: a last-bit difference in k_rot may move an entry across a rounding
    # boundary, so K is compared dequantized to within one step; V is a pure quantized copy.
    step = ks if dtype == torch.int8 else (want_k.float().abs() * ks / 8).clamp_min(ks * 2**-9)
    assert ((kc.float() * ks - want_k.float() * ks).abs() <= step + 1e-7).all()
    assert (kc.view(torch.uint8) != want_k.view(torch.uint8)).float().mean() < 0.01
    _same_bytes(vc, want_v)


def test_quantized_write_unwritten_rows_untouched() -> None:
    """Slot -1 and rows no token maps to keep their old 1-byte values."""
    _, k, v = _qkv(6, 2, 2, 64)
    kc, vc = _qcaches(2, 16, 2, 64, torch.int8)
    before_k, before_v = kc.clone(), vc.clone()
    slots = torch.tensor([3, -1, 5, -1, 17, 30])
    write_kv_cache(k, v, kc, vc, slots, k_scale=torch.tensor(0.05), v_scale=torch.tensor(0.05))
    keep = torch.ones(32, dtype=torch.bool)
    keep[[3, 5, 17, 30]] = False
    for got, old in ((kc, before_k), (vc, before_v)):
        _same_bytes(got.view(32, 2, 64)[keep], old.view(32, 2, 64)[keep])
        assert not torch.equal(got.view(32, 2, 64)[~keep], old.view(32, 2, 64)[~keep])


# ---------------------------------------------------------------------------- GPU (bf16)
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 4096])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (16, 8, 128), (28, 4, 128), (8, 8, 64)])
def test_gpu_rotary_and_cache_write_bf16(tokens: int, hq: int, hkv: int, d: int) -> None:
    dev, dt, bs = "cuda", torch.bfloat16, 16
    q, k, v = _qkv(tokens, hq, hkv, d, dt, dev)
    blocks = tokens // bs + 8
    kc, vc = _caches(blocks, bs, hkv, d, dt, dev)
    cs = _cos_sin(8192, d).to(dev)
    pos = torch.randint(0, 8192, (tokens,), device=dev)
    slots = _slots(tokens, blocks * bs, device=dev)
    want_k, want_v = kc.clone(), vc.clone()
    want_q, want_kr = reference.rotary_and_cache_write(q, k, v, pos, cs, want_k, want_v, slots)
    got_q, got_kr = rotary_and_cache_write(q, k, v, pos, cs, kc, vc, slots)
    # bf16 results of float32 math (FMA contraction may differ): one rounding step apart.
    for got, want in ((got_q, want_q), (got_kr, want_kr), (kc, want_k)):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(vc, want_v, atol=0, rtol=0)


@pytest.mark.gpu
def test_gpu_rotary_and_kv_write_separately_bf16() -> None:
    dev, dt, bs, tokens = "cuda", torch.bfloat16, 32, 777
    q, k, v = _qkv(tokens, 32, 8, 128, dt, dev)
    cs = _cos_sin(4096, 128).to(dev)
    pos = torch.randint(0, 4096, (tokens,), device=dev)
    torch.testing.assert_close(apply_rotary(q, pos, cs), reference.apply_rotary(q, pos, cs),
                               atol=2e-2, rtol=1e-2)
    kc, vc = _caches(tokens // bs + 4, bs, 8, 128, dt, dev)
    slots = _slots(tokens, kc.shape[0] * bs, device=dev)
    want_k, want_v = kc.clone(), vc.clone()
    reference.write_kv_cache(k, v, want_k, want_v, slots)
    write_kv_cache(k, v, kc, vc, slots)
    torch.testing.assert_close(kc, want_k, atol=0, rtol=0)
    torch.testing.assert_close(vc, want_v, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("tokens", [1, 64, 4096])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (28, 4, 128), (8, 8, 64), (8, 1, 64)])
def test_gpu_rotary_and_cache_write_quantized_bf16(dtype: torch.dtype, tokens: int, hq: int,
                                                   hkv: int, d: int) -> None:
    dev, dt, bs = "cuda", torch.bfloat16, 16
    q, k, v = _qkv(tokens, hq, hkv, d, dt, dev)
    blocks = tokens // bs + 8
    kc, vc = _qcaches(blocks, bs, hkv, d, dtype, dev)
    ks, vs = _scales(dev)
    cs = _cos_sin(8192, d).to(dev)
    pos = torch.randint(0, 8192, (tokens,), device=dev)
    slots = _slots(tokens, blocks * bs, device=dev)
    want_k, want_v = kc.clone(), vc.clone()
    reference.rotary_and_cache_write(q, k, v, pos, cs, want_k, want_v, slots, k_scale=ks,
                                     v_scale=vs)
    rotary_and_cache_write(q, k, v, pos, cs, kc, vc, slots, k_scale=ks, v_scale=vs)
    # bf16 k_rot may differ by one rounding (FMA), moving an entry by one quantization step:
    # dequantized values within one step, and almost all entries bit-identical.
    for got, want, s in ((kc, want_k, ks), (vc, want_v, vs)):
        step = s if dtype == torch.int8 else (want.float().abs() * s / 8).clamp_min(s * 2**-9)
        assert ((got.float() - want.float()).abs() * s <= step * 1.001).all()
        assert (got.view(torch.uint8) != want.view(torch.uint8)).float().mean() < 0.01


# ---------------------------------------------------------------------------- partial rotary
def test_partial_rotary_rotates_the_first_dims_and_passes_the_rest() -> None:
    """A table of R < D columns (Phi-4-mini): the first R dims of each head rotate (NeoX
    pairs within them), the rest pass through; the Triton wrappers give the same results."""
    tokens, hq, hkv, d, r, bs = 7, 4, 2, 32, 24, 16
    q, k, v = _qkv(tokens, hq, hkv, d)
    cs = _cos_sin(64, r)
    pos = torch.randint(0, 64, (tokens,))
    want = reference.apply_rotary(q, pos, cs)
    half = r // 2
    c, s = cs[pos][:, None, :half], cs[pos][:, None, half:]
    x1, x2 = q[..., :half], q[..., half:r]
    torch.testing.assert_close(want[..., :r], torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1))
    assert torch.equal(want[..., r:], q[..., r:])
    torch.testing.assert_close(apply_rotary(q, pos, cs), want, atol=ATOL, rtol=RTOL)
    from slipstream.quantization.awq import _rope  # AWQ calibration's own rotation

    cos, sin = cs[pos].chunk(2, dim=-1)
    torch.testing.assert_close(_rope(q[None], cos, sin)[0], want, atol=ATOL, rtol=RTOL)
    kc, vc = _caches(2, bs, hkv, d)
    slots = _slots(tokens, 2 * bs)
    want_k, want_v = kc.clone(), vc.clone()
    want_q, want_kr = reference.rotary_and_cache_write(q, k, v, pos, cs, want_k, want_v, slots)
    got_q, got_kr = rotary_and_cache_write(q, k, v, pos, cs, kc, vc, slots)
    for got, ref in ((got_q, want_q), (got_kr, want_kr), (kc, want_k), (vc, want_v)):
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.gpu
def test_gpu_partial_rotary_and_cache_write_bf16() -> None:
    dev, dt, bs, tokens = "cuda", torch.bfloat16, 16, 64
    q, k, v = _qkv(tokens, 24, 8, 128, dt, dev)
    kc, vc = _caches(tokens // bs + 2, bs, 8, 128, dt, dev)
    cs = _cos_sin(4096, 96).to(dev)  # Phi-4-mini: 96 of 128 dims rotate
    pos = torch.randint(0, 4096, (tokens,), device=dev)
    slots = _slots(tokens, kc.shape[0] * bs, device=dev)
    want_k, want_v = kc.clone(), vc.clone()
    want_q, want_kr = reference.rotary_and_cache_write(q, k, v, pos, cs, want_k, want_v, slots)
    got_q, got_kr = rotary_and_cache_write(q, k, v, pos, cs, kc, vc, slots)
    for got, want in ((got_q, want_q), (got_kr, want_kr), (kc, want_k), (vc, want_v)):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
