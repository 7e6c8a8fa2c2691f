"""Checkpoints in the compressed-tensors format (`quant_method: compressed-tensors`, llm-compressor).

The config says, per group of layers (`config_groups`), how weights and input activations are
quantized, and which layers stay float (`ignore`: exact names or `re:` patterns, matched against
the checkpoint's module names). This module reads that and maps it onto a slipstream method:
FP8 W8A8 / W8A16 (float-quantized or naive-quantized: `weight` float8_e4m3fn, `weight_scale` per
channel or per tensor, `input_scale` for static activations) loads with "fp8"; INT4 W4A16
(pack-quantized: `weight_packed` int32, `weight_scale` per group or channel, optional
`weight_zero_point` / `weight_g_idx`) with "int4_awq"; INT8 W8A8 (int-quantized or naive-quantized:
`weight` int8, `weight_scale` per channel, activations int8 per token) with "w8a8_sq"; INT8 W8A16
(the same tensors, or pack-quantized: `weight_packed` int32, four values per word) with "int8_wo".
Every other scheme is a ValueError naming what was found, never a load of packed integers as floats.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

logger = logging.getLogger(__name__)

QUANT_METHOD = "compressed-tensors"
FP8_FORMATS = ("float-quantized", "naive-quantized")  # both store the float8 values as they are
_COMPRESSED_STATUSES = ("compressed", "frozen")
_FIELDS = ("weights", "input_activations", "output_activations")
FP8_SUPPORTED = ("FP8 weights (type float, 8 bits, symmetric, strategy 'channel', 'tensor' or "
                 "'block' with a [rows, cols] block_structure), input activations FP8 dynamic per "
                 "'token' / 'tensor' / 'group', static per 'tensor', or none; formats "
                 + " / ".join(FP8_FORMATS))
PACK_FORMAT = "pack-quantized"  # int values packed into int32 words along K (lowest bits first)
FLOAT8, INT8 = ("float", 8), ("int", 8)  # (type, num_bits) of QuantArgs
INT4_ACTORDERS = (None, "group", "weight")
INT4_SUPPORTED = ("INT4 weight-only W4A16 (type int, 4 bits, symmetric or asymmetric with "
                  "weight_zero_point, static, strategy 'group' or 'channel', actorder none / "
                  f"'group' / 'weight', no activation quantization); format {PACK_FORMAT!r}")
INT8_FORMATS = ("int-quantized", "naive-quantized")  # `weight` int8 as it is
INT8_W8A8_SUPPORTED = ("INT8 W8A8 (type int, 8 bits, symmetric, static weights per 'channel'; input "
                       "activations int8 symmetric, dynamic per 'token' or static per 'tensor'); "
                       "formats " + " / ".join(INT8_FORMATS))
INT8_W8A16_SUPPORTED = ("INT8 weight-only W8A16 (type int, 8 bits, symmetric, static, strategy "
                        "'channel', no activation quantization); formats "
                        + " / ".join((*INT8_FORMATS, PACK_FORMAT)))
SUPPORTED = f"{FP8_SUPPORTED}. {INT4_SUPPORTED}. {INT8_W8A8_SUPPORTED}. {INT8_W8A16_SUPPORTED}"
# Newer compressed-tensors spellings of the two activation orders (same layouts).
_ACTORDER_ALIASES = {"dynamic": "group", "static": "weight"}


@dataclass(frozen=True)
class QuantArgs:
    """One tensor's quantization (compressed-tensors QuantizationArgs, defaults filled in)."""

    num_bits: int
    type: str
    strategy: str
    symmetric: bool
    dynamic: bool | str
    group_size: int | None
    block_structure: tuple | str | None
    actorder: str | None = None  # GPTQ activation order: None, "group" (g_idx stored), "weight"

    @classmethod
    def parse(cls, args: dict | None) -> QuantArgs | None:
        if args is None:
            return None
        group_size = args.get("group_size")
        # The library's defaults: int type, symmetric, static; no strategy means per tensor
        # (per group when a group size is given).
        strategy = args.get("strategy") or ("group" if group_size else "tensor")
        return cls(num_bits=int(args.get("num_bits", 8)), type=str(args.get("type", "int")),
                   strategy=str(strategy), symmetric=bool(args.get("symmetric", True)),
                   dynamic=args.get("dynamic", False), group_size=group_size,
                   block_structure=_hashable(args.get("block_structure")),
                   actorder=_parse_actorder(args.get("actorder")))

    def describe(self) -> str:
        kind = f"{self.type}{self.num_bits}"
        strategy = f"group({self.group_size})" if self.strategy == "group" else self.strategy
        if self.block_structure:  # [rows, cols] (older configs: "128x128")
            block = self.block_structure
            strategy = f"block{list(block) if isinstance(block, tuple) else block}"
        when = "dynamic" if self.dynamic is True else "static" if not self.dynamic else self.dynamic
        sym = "" if self.symmetric else " asymmetric"
        order = f" actorder {self.actorder}" if self.actorder else ""
        return f"{kind} {strategy} {when}{sym}{order}"


def _parse_actorder(value) -> str | None:
    """None, "group" or "weight" (older configs: a bool, True meaning "group")."""
    if value is None or value is False:
        return None
    if value is True:
        return "group"
    name = str(value).lower()
    return _ACTORDER_ALIASES.get(name, name)


@dataclass(frozen=True)
class Scheme:
    """What one config group does; every group of a loadable checkpoint must do the same."""

    format: str
    weights: QuantArgs | None
    input_activations: QuantArgs | None
    output_activations: QuantArgs | None

    def describe(self) -> str:
        parts = [f"{field.replace('_', ' ')} {args.describe()}" for field in _FIELDS
                 if (args := getattr(self, field)) is not None]
        return ", ".join(parts + [f"format {self.format or '(none)'!r}"])

    @property
    def static_input_scale(self) -> bool:
        """Static activations: the checkpoint has an `input_scale` per layer."""
        return self.input_activations is not None and self.input_activations.dynamic is False


@dataclass(frozen=True)
class CompressedTensorsConfig:
    scheme: Scheme
    targets: tuple[str, ...]
    ignore: tuple[str, ...]

    def quantizes(self, name: str) -> bool:
        """Whether the checkpoint module `name` (HF name, e.g. model.layers.0.mlp.up_proj) is a
        quantized one: some target matches it and no ignore entry does."""
        return _matches_any(name, self.targets) and not _matches_any(name, self.ignore)


def is_compressed_tensors(qc: dict) -> bool:
    return str(qc.get("quant_method", "")).lower() == QUANT_METHOD


def parse_config(qc: dict) -> CompressedTensorsConfig:
    """Validate the parts every scheme shares; the one scheme of all config groups."""
    status = qc.get("quantization_status", "compressed")
    if status not in _COMPRESSED_STATUSES:
        raise ValueError(f"compressed-tensors checkpoint with quantization_status={status!r}: "
                         f"only saved quantized checkpoints load ({', '.join(_COMPRESSED_STATUSES)})")
    _reject_extras(qc)
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors checkpoint without config_groups: nothing says how "
                         "its layers are quantized")
    schemes = {name: _parse_group(name, group, qc) for name, group in groups.items()}
    if len(set(schemes.values())) > 1:
        found = "; ".join(f"{name}: {s.describe()}" for name, s in schemes.items())
        raise ValueError(f"compressed-tensors checkpoint with different schemes per config group "
                         f"is not supported (found {found}); supported: one scheme for every "
                         f"group: {SUPPORTED}")
    targets = tuple(t for group in groups.values() for t in group.get("targets") or ())
    ignore = tuple(qc.get("ignore") or ())
    for pattern in targets:
        _check_pattern(pattern, target=True)
    for pattern in ignore:
        _check_pattern(pattern, target=False)
    return CompressedTensorsConfig(next(iter(schemes.values())), targets, ignore)


def _reject_extras(qc: dict) -> None:
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and str(sparsity.get("format", "dense")) != "dense":
        raise ValueError(f"compressed-tensors sparsity (format {sparsity.get('format')!r}, "
                         f"structure {sparsity.get('sparsity_structure')!r}) is not supported; "
                         "supported: dense weights")
    if qc.get("transform_config"):
        raise ValueError("compressed-tensors transforms (transform_config: rotations / Hadamard) "
                         "are not supported")


def _parse_group(name: str, group: dict, qc: dict) -> Scheme:
    if not isinstance(group, dict) or "weights" not in group:
        raise ValueError(f"compressed-tensors config group {name!r} is not a scheme with "
                         f"'weights': {group!r}")
    fmt = str(group.get("format") or qc.get("format") or "")  # newer configs: a format per group
    return Scheme(fmt, *(QuantArgs.parse(group.get(field)) for field in _FIELDS))


def fp8_problem(scheme: Scheme) -> str | None:
    """Why `scheme` is not one the "fp8" method loads (None: it is)."""
    if scheme.format not in FP8_FORMATS:
        return f"format {scheme.format or '(none)'!r}"
    if scheme.weights is None:
        return "no weight quantization"
    if scheme.output_activations is not None:
        return "output activations are quantized"
    weights, acts = scheme.weights, scheme.input_activations
    if weights.strategy == "block":  # FP8_BLOCK: requantized per channel at load (fp8_layouts)
        problem = _block_weights_problem(weights)
    else:
        problem = _args_problem("weights", weights, FLOAT8, (("channel", False), ("tensor", False)))
    if problem is None and acts is not None:
        if acts.strategy == "group" and acts.dynamic is True and isinstance(acts.group_size, int):
            # Per-token groups (FP8_BLOCK's activations): quantized per whole token instead.
            acts = replace(acts, strategy="token", group_size=None)
        act_modes = (("token", True), ("tensor", True), ("tensor", False))
        problem = _args_problem("input activations", acts, FLOAT8, act_modes)
    return problem


def block_size_of(args: QuantArgs) -> tuple[int, int] | None:
    """[rows, cols] of a block strategy's block_structure (a list, or older "128x128"); None when
    it is neither."""
    block = args.block_structure
    if isinstance(block, str):
        block = tuple(block.lower().split("x"))
    try:
        rows, cols = (int(b) for b in block)
    except (TypeError, ValueError):
        return None
    return (rows, cols) if rows > 0 and cols > 0 else None


def _block_weights_problem(weights: QuantArgs) -> str | None:
    if block_size_of(weights) is None:
        return f"weights block_structure {weights.block_structure!r}"
    plain = replace(weights, strategy="channel", block_structure=None)
    return _args_problem("weights", plain, FLOAT8, (("channel", False),))


def int4_problem(scheme: Scheme) -> str | None:
    """Why `scheme` is not one the "int4_awq" method loads (None: it is)."""
    if scheme.format != PACK_FORMAT:
        return f"format {scheme.format or '(none)'!r}"
    weights = scheme.weights
    if weights is None:
        return "no weight quantization"
    if scheme.input_activations is not None or scheme.output_activations is not None:
        return "activations are quantized (weight-only W4A16 only)"
    if (weights.type, weights.num_bits) != ("int", 4):
        return f"weights are {weights.type}{weights.num_bits}, not int4"
    if weights.dynamic is not False:
        return f"weights have dynamic={weights.dynamic}"
    if weights.strategy not in ("group", "channel") or weights.block_structure:
        return f"weights strategy {weights.strategy!r}"
    group = weights.group_size
    if weights.strategy == "group" and (not isinstance(group, int) or group <= 0):
        return f"weights group size {group!r}"
    if weights.actorder not in INT4_ACTORDERS:
        return f"weights actorder {weights.actorder!r}"
    return None


def int8_w8a8_problem(scheme: Scheme) -> str | None:
    """Why `scheme` is not one the "w8a8_sq" method loads (None: it is)."""
    if scheme.format not in INT8_FORMATS:
        return f"format {scheme.format or '(none)'!r}"
    if scheme.input_activations is None:
        return "activations are not quantized"
    if scheme.output_activations is not None:
        return "output activations are quantized"
    # Static per-tensor input scales load but go unused: inputs are quantized per token anyway.
    act_modes = (("token", True), ("tensor", False))
    return (_int8_weights_problem(scheme.weights)
            or _args_problem("input activations", scheme.input_activations, INT8, act_modes))


def int8_w8a16_problem(scheme: Scheme) -> str | None:
    """Why `scheme` is not one the "int8_wo" method loads (None: it is)."""
    if scheme.format not in (*INT8_FORMATS, PACK_FORMAT):
        return f"format {scheme.format or '(none)'!r}"
    if scheme.input_activations is not None or scheme.output_activations is not None:
        return "activations are quantized (weight-only W8A16 only)"
    return _int8_weights_problem(scheme.weights)


def _int8_weights_problem(weights: QuantArgs | None) -> str | None:
    if weights is None:
        return "no weight quantization"
    return _args_problem("weights", weights, INT8, (("channel", False),))


def _args_problem(what: str, args: QuantArgs, kind: tuple[str, int],
                  modes: tuple[tuple[str, bool], ...]) -> str | None:
    """Why `args` is not symmetric `kind` (type, bits) in one of the (strategy, dynamic) modes."""
    if (args.type, args.num_bits) != kind:
        return f"{what} are {args.type}{args.num_bits}, not {kind[0]}{kind[1]}"
    if not args.symmetric:
        return f"{what} are asymmetric" + (" (zero points)" if kind[0] == "int" else "")
    if (args.strategy, args.dynamic) not in modes or args.group_size or args.block_structure:
        return f"{what} strategy {args.strategy!r} with dynamic={args.dynamic}"
    return None


# slipstream method -> why a scheme is not one it loads (None: it loads it). A new method that
# reads compressed-tensors checkpoints adds one entry here.
_METHOD_PROBLEMS: dict[str, Callable[[Scheme], str | None]] = {
    "fp8": fp8_problem, "int4_awq": int4_problem, "w8a8_sq": int8_w8a8_problem,
    "int8_wo": int8_w8a16_problem}


def checkpoint_method(qc: dict) -> str:
    """The slipstream method that loads this compressed-tensors checkpoint; ValueError otherwise."""
    scheme = parse_config(qc).scheme
    problems = []
    for method, problem_of in _METHOD_PROBLEMS.items():
        problem = problem_of(scheme)
        if problem is None:
            return method
        problems.append(f"{method}: {problem}")
    raise ValueError(f"compressed-tensors checkpoint with {scheme.describe()} is not supported "
                     f"({'; '.join(problems)}); supported: {SUPPORTED}")


def layer_filter(config: CompressedTensorsConfig, packed: dict[str, list[str]]
                 ) -> Callable[[str], bool]:
    """prefix of a slipstream linear layer -> whether it is quantized in the checkpoint."""
    return fused_layer_filter(packed, lambda name: _matches_any(name, config.ignore),
                              config.quantizes, "`ignore`")


def fused_layer_filter(packed: dict[str, list[str]], listed_float: Callable[[str], bool],
                       quantizes: Callable[[str], bool], float_list: str
                       ) -> Callable[[str], bool]:
    """prefix of a slipstream linear layer -> whether the checkpoint quantized it.

    A fused layer (qkv_proj) is float when its own name is listed float (float_list names the
    config's list), else it follows its checkpoint modules (q/k/v_proj): all quantized or all
    float, since a mix cannot share one weight tensor (an error).
    """
    def quantized(prefix: str) -> bool:
        names = checkpoint_module_names(prefix, packed)
        if len(names) > 1 and listed_float(prefix):
            return False
        flags = [quantizes(n) for n in names]
        if all(flags) or not any(flags):
            return flags[0]
        split = ", ".join(f"{n}: {'quantized' if f else 'float'}" for n, f in zip(names, flags))
        raise ValueError(f"the checkpoint quantizes only some of the modules fused into {prefix} "
                         f"({split}); they share one weight here, so list all or none of them in "
                         f"{float_list}")

    return quantized


def check_lm_head(config: CompressedTensorsConfig) -> None:
    """The LM head is always float here: a checkpoint that quantized it cannot load."""
    if config.quantizes("lm_head"):
        raise ValueError("compressed-tensors checkpoint quantizes lm_head (it is a target and not "
                         "in `ignore`); slipstream keeps the LM head in float")


def checkpoint_module_names(prefix: str, packed: dict[str, list[str]]) -> list[str]:
    """model.layers.0.self_attn.qkv_proj -> [... .q_proj, ... .k_proj, ... .v_proj]."""
    parent, _, leaf = prefix.rpartition(".")
    if leaf not in packed:
        return [prefix]
    return [f"{parent}.{sub}" if parent else sub for sub in packed[leaf]]


def _matches_any(name: str, patterns: tuple[str, ...]) -> bool:
    return any(_matches(name, p) for p in patterns)


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors matching: `re:<regex>` (re.match, from the start of the name), the
    class name "Linear" (every layer this is asked about is a linear one), or the exact name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == "Linear" or pattern == name


def _check_pattern(pattern: str, target: bool) -> None:
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as e:
            raise ValueError(f"compressed-tensors pattern {pattern!r} is not a valid regex: {e}"
                             ) from None
    elif target and pattern != "Linear" and pattern[:1].isupper() and "." not in pattern:
        # A class name other than Linear: we could not tell which layers it quantizes. (In
        # `ignore` such a name matches none of our linear layers; a layer it made float then
        # fails to load for lack of its weight_scale rather than loading wrongly.)
        raise ValueError(f"compressed-tensors target {pattern!r}: module classes other than "
                         "'Linear' are not supported (layer names and 're:' patterns are)")


def _hashable(value):
    return tuple(map(_hashable, value)) if isinstance(value, list) else value


def packed_modules_of(hf_config: dict) -> dict[str, list[str]]:
    """The model's fused layer -> checkpoint modules map (empty when the class is unknown)."""
    # Lazy: the model classes import the layers, which import the quantization package.
    from slipstream.models.registry import get_model_class

    archs = hf_config.get("architectures") or []
    try:
        cls = get_model_class(archs[0]) if archs else None
    except ValueError:
        return {}
    return dict(getattr(cls, "packed_modules_mapping", {}) or {})


def scheme_layer_filter(hf_config: dict, qc: dict) -> tuple[Callable[[str], bool], Scheme]:
    """(is this slipstream layer quantized?, the checkpoint's scheme); a quantized LM head is an
    error."""
    config = parse_config(qc)
    check_lm_head(config)
    return layer_filter(config, packed_modules_of(hf_config)), config.scheme


def fp8_layer_filter(hf_config: dict, qc: dict
                     ) -> tuple[Callable[[str], bool], bool, tuple[int, int] | None]:
    """For the "fp8" method: (is this slipstream layer quantized?, static input scales?, the
    [rows, cols] of block-wise weight scales or None)."""
    quantized, scheme = scheme_layer_filter(hf_config, qc)
    if scheme.input_activations is None:
        logger.info("compressed-tensors FP8 weight-only (W8A16) checkpoint: runs as fp8, whose "
                    "large-batch matmuls quantize activations per token")
    block = block_size_of(scheme.weights) if scheme.weights.strategy == "block" else None
    if block is not None:
        logger.warning("compressed-tensors FP8 block checkpoint (%s): block scales are requantized "
                       "per output channel at load (a second FP8 rounding: a small extra weight "
                       "error), activations quantized per token", list(block))
    return quantized, scheme.static_input_scale, block


def int4_layer_filter(hf_config: dict, qc: dict) -> tuple[Callable[[str], bool], QuantArgs]:
    """For the "int4_awq" method: (is this slipstream layer quantized?, the weights' arguments)."""
    quantized, scheme = scheme_layer_filter(hf_config, qc)
    return quantized, scheme.weights


@dataclass(frozen=True)
class Int8Layout:
    """How a compressed-tensors INT8 layer stores its weight."""

    packed: bool  # pack-quantized: weight_packed int32 [N, K/4] + weight_shape, not weight int8
    static_input_scale: bool  # a per-tensor input_scale per module (W8A8 static activations)


def int8_layer_filter(hf_config: dict, qc: dict) -> tuple[Callable[[str], bool], Int8Layout]:
    """For "w8a8_sq" and "int8_wo": (is this slipstream layer quantized?, its tensors' layout)."""
    quantized, scheme = scheme_layer_filter(hf_config, qc)
    layout = Int8Layout(packed=scheme.format == PACK_FORMAT,
                        static_input_scale=scheme.static_input_scale)
    if layout.static_input_scale:
        logger.info("compressed-tensors INT8 W8A8 checkpoint with static per-tensor input scales: "
                    "they load but are unused, w8a8_sq quantizes activations per token")
    return quantized, layout

