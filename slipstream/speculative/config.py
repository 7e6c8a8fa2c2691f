"""SpeculativeConfig: the `speculative_config` dict of LLM / EngineArgs / `--speculative-config`,
with vLLM's key names, checked once."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

METHODS = ("ngram", "draft_model", "medusa", "eagle", "eagle3", "lookahead", "oracle")
_PUBLIC = tuple(m for m in METHODS if m != "oracle")
# Named in vLLM / the issue but not implemented here: a clear error instead of a silent no-op.
_NOT_IMPLEMENTED = ("mtp",)
# Methods whose drafts come from heads on the target's hidden states: `model` is required.
_HEAD_METHODS = ("medusa", "eagle", "eagle3")
# Methods that draft the tree speculative_token_tree shapes.
_TREE_METHODS = ("medusa", "eagle", "eagle3", "oracle")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: the draft checkpoint (None: the default's draft)
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched in the earlier tokens
    prompt_lookup_max: int = 4  # ngram: longest suffix tried first
    # No speculation while this many requests or more run (vLLM's name); None: never.
    disable_by_batch_size: int | None = None
    # Choose each step's k from the batch size and the measured acceptance (adaptive.py).
    adaptive: bool = True
    # Tokens a step may verify before it stops costing the same as a plain decode step (the
    # weights-read-bound to compute-bound ridge of the GPU for this model; adaptive.py).
    ridge_tokens: int = 128
    # oracle (test-only): chance that each draft token is the target's own next token.
    acceptance_rate: float = 0.7
    # medusa, eagle / eagle3, oracle: the candidate tree as paths of top-k ranks per level,
    # e.g. [[0], [1], [0, 0]] (or its JSON text, vLLM's name); None: medusa's default tree of
    # num_speculative_tokens levels, a chain for the others (EAGLE: paths [0, ..., 0, r]).
    speculative_token_tree: Any = None
    # lookahead: the Jacobi window's length W, the pool's n-gram length N and the most pool
    # n-grams G drafted a step (speculative/lookahead.py).
    lookahead_window: int = 4
    lookahead_ngram: int = 4
    lookahead_candidates: int = 4

    @staticmethod
    def from_dict(value: dict[str, Any] | str | SpeculativeConfig) -> SpeculativeConfig:
        """From the user's dict (or its JSON text); ValueError naming the bad key."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        value = dict(value)
        if "method" not in value:
            value["method"] = "draft_model" if value.get("model") else None
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        config = SpeculativeConfig(**value)
        if config.speculative_token_tree is not None:  # hashable, whatever form it came in
            tree = tuple(config.token_tree())
            config = SpeculativeConfig(**{**value, "speculative_token_tree": tree})
        config.check()
        return config

    def token_tree(self) -> list[tuple[int, ...]] | None:
        """speculative_token_tree as a list of rank paths (parsed from JSON text if given so)."""
        tree = self.speculative_token_tree
        if isinstance(tree, str):
            try:
                tree = json.loads(tree.replace("(", "[").replace(")", "]"))
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: speculative_token_tree is not a list: {e}") from None
        if tree is None:
            return None
        if not isinstance(tree, list | tuple) or not all(isinstance(p, list | tuple) for p in tree):
            raise ValueError("speculative_config: speculative_token_tree must be a list of rank paths")
        return [tuple(p) for p in tree]

    @property
    def drafts_trees(self) -> bool:
        """Whether the proposer drafts trees (rather than chains)."""
        return self.method in ("medusa", "lookahead") or self.speculative_token_tree is not None

    @property
    def max_draft_tokens(self) -> int:
        """The most draft tokens (chain or tree nodes) one request verifies in a step."""
        k = self.num_speculative_tokens
        if self.method == "lookahead":
            return (self.lookahead_candidates + 1) * k
        if self.speculative_token_tree is not None:
            return len(self.token_tree())
        if self.method == "medusa":
            from slipstream.speculative.tree import medusa_default_nodes

            return medusa_default_nodes(k)
        return k

    def check(self) -> None:
        if self.method in _NOT_IMPLEMENTED:
            raise ValueError(
                f"speculative_config: method {self.method!r} is not implemented; use one of {_PUBLIC}"
            )
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {_PUBLIC}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be an integer in [1, 16], got {k!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}"
            )
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or d < 1):
            raise ValueError(
                f"speculative_config: disable_by_batch_size must be a positive integer, got {d!r}"
            )
        if not isinstance(self.ridge_tokens, int) or self.ridge_tokens < 1:
            raise ValueError(
                f"speculative_config: ridge_tokens must be a positive integer, got {self.ridge_tokens!r}"
            )
        if not 0.0 <= float(self.acceptance_rate) <= 1.0:
            raise ValueError("speculative_config: acceptance_rate must be in [0, 1]")
        if self.method == "lookahead":
            self._check_lookahead()
        if self.method in _HEAD_METHODS and self.model is None:
            raise ValueError(
                f"speculative_config: method {self.method!r} needs 'model' (the "
                "heads' checkpoint directory); none ships for this model"
            )
        if self.method in _HEAD_METHODS and not Path(self.model).is_dir():
            raise ValueError(f"speculative_config: {self.method} model {self.model!r} is not a directory")
        if self.speculative_token_tree is not None:
            self._check_tree()
        if (
            self.method == "draft_model"
            and self.model is not None
            and not (Path(self.model) / "config.json").is_file()
        ):
            raise ValueError(
                f"speculative_config: draft model {self.model!r} is not a "
                "checkpoint directory (no config.json)"
            )

    def _check_lookahead(self) -> None:
        from slipstream.speculative.tree import MAX_TREE_TOKENS

        for key, lo in (("lookahead_window", 1), ("lookahead_ngram", 2), ("lookahead_candidates", 1)):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= 16:
                raise ValueError(f"speculative_config: {key} must be an integer in [{lo}, 16], got {v!r}")
        nodes = (self.lookahead_candidates + 1) * self.num_speculative_tokens
        if nodes > MAX_TREE_TOKENS - 1:
            raise ValueError(
                f"speculative_config: lookahead drafts up to (lookahead_candidates + 1) * "
                f"num_speculative_tokens = {nodes} tree nodes; at most {MAX_TREE_TOKENS - 1} fit"
            )

    def _check_tree(self) -> None:
        from slipstream.speculative.tree import leaves_on_top_chain, tree_from_choices

        if self.method not in _TREE_METHODS:
            raise ValueError(
                f"speculative_config: speculative_token_tree applies to {_TREE_METHODS}, not {self.method!r}"
            )
        check = leaves_on_top_chain if self.method in ("eagle", "eagle3") else tree_from_choices
        check(self.token_tree())
