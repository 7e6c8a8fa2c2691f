"""Structured outputs: constrained decoding with xgrammar (JSON schema, any JSON object,
regular expression, EBNF grammar, a choice among strings).

`params.py` holds what a request asks for, checked on construction; `manager.py` compiles
grammars off the step loop and caches them; `grammar.py` is one request's matcher;
`bitmask.py` fills the batch's token bitmask and applies it to the logits.
xgrammar is imported only when a request asks for structured output (it takes seconds).
"""

from slipstream.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
