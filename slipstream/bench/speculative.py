"""`slipstream bench latency|throughput --speculative-config ...`: the same workload without
speculation first, in the same engine (speculation switched off), then with it; the result
gains a `speculative` block with both rates, the speed-up and the acceptance statistics.

The run without speculation also records the target's own outputs, which the test-only
"oracle" proposer replays as its correct drafts."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def decoder_of(llm) -> Any:
    """The engine's SpeculativeDecoder, or None without speculation."""
    return getattr(getattr(llm, "engine", None), "spec", None)


def remember_outputs(outputs: list[Any]) -> None:
    """The target's continuations for the oracle proposer (keyed by prompt token ids)."""
    from slipstream.speculative.oracle import set_reference_outputs

    set_reference_outputs({tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outputs},
                          replace=False)


def without_speculation(llm, run: Callable[[], Any]) -> Any:
    """run() with speculation off (its outputs remembered for the oracle by the caller)."""
    spec = decoder_of(llm)
    spec.enabled = False
    try:
        return run()
    finally:
        spec.enabled = True


def summary(llm, baseline_rate: float | None, rate: float | None) -> dict[str, Any]:
    spec = decoder_of(llm)
    stats = spec.get_stats()
    return {"config": dataclasses.asdict(spec.config),
            "baseline_tok_s": baseline_rate, "tok_s": rate,
            "speedup": rate / baseline_rate if rate and baseline_rate else None,
            "acceptance_rate": stats["spec_acceptance_rate"],
            "mean_accepted_length": stats["spec_mean_accepted_length"],
            "per_method": stats["speculative"]}
