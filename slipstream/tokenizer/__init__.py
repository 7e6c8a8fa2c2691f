"""Tokenizers: loading one for a checkpoint, chat templates and messages, and the
incremental detokenizer that turns sampled ids into text as they arrive.
"""
