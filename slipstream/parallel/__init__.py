"""Tensor, pipeline and expert parallelism: process groups (state.py), how a model splits
(sharding.py), worker processes and their executors (worker.py, executor.py, ray_executor.py).
See docs/parallelism.md."""
