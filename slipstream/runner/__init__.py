"""The model runner: one step's inputs built on the host, the forward pass (eager or from
CUDA graphs), sampling, and the sampled tokens read back without stalling the GPU.
"""
