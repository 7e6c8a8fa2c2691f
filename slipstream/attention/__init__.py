"""Attention backends: the metadata a step's attention needs and the reference (plain
PyTorch) and Triton implementations that read and write the paged KV cache.
"""
