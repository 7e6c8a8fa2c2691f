"""In-register conversions of one-byte weights (INT8, FP8 E4M3) to float32 for the GEMV kernels
(kernels/gemv/dense.py): conversion instructions run at a fraction of the FMA rate, so the M == 1
dequant GEMV can build the float bits directly (BIT_CONVERT)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def weight_to_float(w, BIT_CONVERT: tl.constexpr):
    """w as float32 (BIT_CONVERT 2: times 2^-120), converted without conversion instructions when
    BIT_CONVERT is set (int->float and fp8->float converts run at a fraction of the FMA rate).

    1 (int8): bits b ^ 0x4B000080 read as float32 are 2^23 + 128 + value.
    2 (fp8 e4m3): sign to bit 31, exponent and mantissa to bits 20-26: e4m3's value times 2^-120
    (subnormals land on float32 subnormals, the same scaling); the caller multiplies back.
    3 (int8, CUDA only): the same float as 1, one PRMT per value from four packed bytes.
    """
    if BIT_CONVERT == 3:
        return _int8x4_to_float(w)
    elif BIT_CONVERT == 1:
        bits = w.to(tl.uint8, bitcast=True).to(tl.uint32) ^ 0x4B000080
        return bits.to(tl.float32, bitcast=True) - 8388736.0
    elif BIT_CONVERT == 2:
        b = w.to(tl.uint8, bitcast=True).to(tl.uint32)
        bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
        return bits.to(tl.float32, bitcast=True)
    else:
        return w.to(tl.float32)


@triton.jit
def _int8x4_to_float(w):
    """int8 -> float32 as BIT_CONVERT 1 computes it, in fewer instructions: one XOR flips the
    sign bits of four packed bytes, then one byte permute per value builds the float bits
    0x4B0000uu (2^23 + uu); the subtraction leaves the value. Inline PTX: GPU only."""
    f = tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t;
        xor.b32 t, $4, 0x80808080;
        prmt.b32 $0, t, 0x4B000000, 0x7540;
        prmt.b32 $1, t, 0x4B000000, 0x7541;
        prmt.b32 $2, t, 0x4B000000, 0x7542;
        prmt.b32 $3, t, 0x4B000000, 0x7543;
        }""",
        constraints="=r,=r,=r,=r,r", args=[w], dtype=tl.float32, is_pure=True, pack=4)
    return f - 8388736.0
