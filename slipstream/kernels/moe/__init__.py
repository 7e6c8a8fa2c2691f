"""Mixture-of-experts kernels: `reference.py` (plain PyTorch, the CPU path and the oracle) and
`fused_moe.py` (Triton: routing, a grouped GEMM over experts, and a decode path)."""
