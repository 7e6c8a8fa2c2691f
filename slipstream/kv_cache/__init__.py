"""The paged KV cache's bookkeeping: the block pool, prefix-cache hashing and the
per-request block tables the scheduler allocates through the manager.
"""
