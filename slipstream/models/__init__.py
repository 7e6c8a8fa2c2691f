"""Model architectures, the registry that maps a checkpoint's architecture to one, and
the loader that builds a model and fills its weights (folding norms, quantizing as it goes).
"""
