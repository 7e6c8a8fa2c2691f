"""Pooling models: embeddings (last-token, mean or CLS pooling) and sequence classification."""
