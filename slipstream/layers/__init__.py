"""The model's building blocks (linear, embedding and LM head, norm, activation, rotary,
attention), each delegating its arithmetic to the kernel table or a quant method.
"""
