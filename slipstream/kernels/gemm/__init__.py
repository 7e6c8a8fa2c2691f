"""Quantized GEMMs for prefill and large batches (M > 16), each measured against cuBLAS."""
