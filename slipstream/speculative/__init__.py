"""Speculative decoding: proposers (n-gram, draft model, a test-only oracle), the adaptive
choice of k, and the per-method statistics. Verification lives in sampling/speculative.py."""
