"""Quantization methods (int8_wo, fp8, int4_awq, w8a8_sq), the checkpoint formats they
read, calibration, the KV-cache formats and `slipstream quantize`.
"""
