"""RMSNorm, the gated-MLP activation and per-token FP8 activation quantization."""
