"""The formats `quantize_lm_head` stores the LM head in, and how a user's choice maps to one.

True takes the quantization method's own one-byte format (FP8 with `fp8`, INT8 weight-only
otherwise: ~0.01% perplexity on the default model). A name asks for a format: "int8", "fp8"
(with the `fp8` method: the GPU must run it) or "int4" (groups of 128, round-to-nearest, through
the int4_awq kernels: half the bytes of INT8, so a faster one-row GEMV, at a cost in perplexity;
docs/performance-log.md has the figures).
"""
from __future__ import annotations

import argparse

# quantization method -> the head's format for quantize_lm_head=True
DEFAULT_FORMATS = {"fp8": "fp8", "int8_wo": "int8_wo", "int4_awq": "int8_wo", "w8a8_sq": "int8_wo"}
# a name a user may give -> the format
_NAMES = {"int8": "int8_wo", "int8_wo": "int8_wo", "int4": "int4", "fp8": "fp8"}
FORMAT_NAMES = ("int8", "int4", "fp8")
INT4_GROUP = 128


def head_format(choice: bool | str | None, method: str | None) -> str | None:
    """The head's format for a `quantize_lm_head` choice under `method`, or None (float head);
    ValueError for a choice the method cannot honour or an unknown name."""
    if choice is None or choice is False:
        return None
    if method not in DEFAULT_FORMATS:
        raise ValueError(f"quantize_lm_head needs a quantization method "
                         f"({', '.join(DEFAULT_FORMATS)}); the model runs with {method!r}")
    if choice is True:
        return DEFAULT_FORMATS[method]
    fmt = _NAMES.get(str(choice).lower())
    if fmt is None:
        raise ValueError(f"quantize_lm_head: unknown format {choice!r}; choose "
                         f"{', '.join(FORMAT_NAMES)}, or true for the method's own")
    if fmt == "fp8" and method != "fp8":
        raise ValueError(f"an fp8 LM head needs quantization='fp8', not {method!r} "
                         f"(int8 or int4 go with any method)")
    return fmt


def cli_choice(value: str) -> str:
    """argparse type of --quantize-lm-head's optional value: a format name (checked here)."""
    if value.lower() not in _NAMES:
        raise argparse.ArgumentTypeError(f"unknown LM head format {value!r}; choose "
                                         f"{', '.join(FORMAT_NAMES)}")
    return value.lower()


def int4_group(hidden: int) -> int:
    """The int4 head's group: 128, the last group short where the hidden size is not a multiple
    (576: four groups of 128 and one of 64). The kernels take K in multiples of 16."""
    if hidden % 16:
        raise ValueError(f"an int4 LM head needs a hidden size that is a multiple of 16, "
                         f"not {hidden}")
    return INT4_GROUP
