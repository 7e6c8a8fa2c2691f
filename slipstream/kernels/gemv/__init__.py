"""Decode GEMVs and skinny GEMMs (M <= 16): bf16, int8 / fp8 and int4 weights, tuned per shape."""
