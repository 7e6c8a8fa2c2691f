"""The offline pooling API behind `LLM.embed`, `LLM.classify` and `LLM.score`.

Each prompt becomes one engine request that asks for a single (placeholder) token and carries
its pooling options; the engine returns its pooled vector when the request's one step ends.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from slipstream.engine.frontend import validate_prompt_tokens
from slipstream.engine.request import Request
from slipstream.pooling.pairs import encode_pair, pair_pooling_params
from slipstream.pooling.params import PoolingParams
from slipstream.pooling.pooler import check_pooling_params
from slipstream.sampling_params import SamplingParams

T = TypeVar("T")
_ONE_STEP = SamplingParams(max_tokens=1, ignore_eos=True)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # softmax over the labels (sigmoid for a one-label model)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput(Generic[T]):
    request_id: str
    prompt_token_ids: list[int]
    outputs: T
    finished: bool = True


class PoolingClient:
    """Runs pooling requests on an LLM's engine (its tokenizer and input processor)."""

    def __init__(self, llm: Any):
        self.llm = llm
        self.config = llm.engine_config
        self._ids = itertools.count()
        if self.config.runner != "pooling":
            raise ValueError("this LLM generates text: embed / classify / score need a pooling "
                             "model or LLM(model, runner='pooling')")

    @property
    def is_classifier(self) -> bool:
        return self.llm.engine.runner.is_classifier

    def embed(self, prompts, params: PoolingParams | None) -> list[PoolingRequestOutput]:
        if self.is_classifier:
            raise ValueError("this is a classification model: use llm.classify or llm.score")
        ids = [self._tokenize(p) for p in _as_list(prompts)]
        vectors = self.run(ids, params or PoolingParams())
        return [PoolingRequestOutput(rid, tok, EmbeddingOutput(v)) for rid, tok, v in vectors]

    def classify(self, prompts) -> list[PoolingRequestOutput]:
        if not self.is_classifier:
            raise ValueError("this model has no classification head: use llm.embed")
        ids = [self._tokenize(p) for p in _as_list(prompts)]
        return [PoolingRequestOutput(rid, tok, ClassificationOutput(activation(v)))
                for rid, tok, v in self.run(ids, PoolingParams())]

    def score(self, text_1, text_2) -> list[PoolingRequestOutput]:
        """Cross-encoder score of each (text_1, text_2) pair (a one-label classifier), or the
        cosine similarity of their embeddings (an embedding model). One text_1 goes with every
        text_2; lists of equal length pair up."""
        left, right = _as_list(text_1), _as_list(text_2)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right) or not right:
            raise ValueError(f"score pairs 1 or N text_1 with N text_2, got {len(left)} and "
                             f"{len(right)}")
        if self.is_classifier:
            return self._cross_encode(left, right)
        embedded = self.run([self._tokenize(t) for t in left + right], PoolingParams(normalize=True))
        n = len(left)
        return [PoolingRequestOutput(f"{a[0]}+{b[0]}", a[1] + b[1],
                                     ScoringOutput(sum(x * y for x, y in zip(a[2], b[2]))))
                for a, b in zip(embedded[:n], embedded[n:])]

    def _cross_encode(self, left: list, right: list) -> list[PoolingRequestOutput]:
        tokenizer = self._need_tokenizer()
        pairs = [encode_pair(tokenizer, a, b) for a, b in zip(left, right)]
        if not self.llm.engine.runner.takes_token_types:
            pairs = [(ids, None) for ids, _ in pairs]  # a decoder reads the ids alone
        results = self.run([ids for ids, _ in pairs], PoolingParams(),
                           [start for _, start in pairs])
        if any(len(v) != 1 for _, _, v in results):
            raise ValueError("llm.score needs a one-label cross-encoder or an embedding model; "
                             "this classifier has several labels: use llm.classify")
        return [PoolingRequestOutput(rid, tok, ScoringOutput(activation(v)[0]))
                for rid, tok, v in results]

    def run(self, prompts: list[list[int]], params: PoolingParams,
            type_starts: list[int | None] | None = None
            ) -> list[tuple[str, list[int], list[float]]]:
        """(request id, prompt ids, pooled vector) per prompt, in order. Every prompt is
        validated before any is queued. type_starts: per prompt, where a text pair's second
        segment starts (token type 1), or None."""
        cfg = self.config
        hidden = cfg.model.hidden_size
        check_pooling_params(params.to_dict(), cfg.pooler, hidden, self.is_classifier)
        for ids in prompts:
            validate_prompt_tokens(ids, cfg.model.vocab_size, cfg.scheduler.max_model_len)
        engine = self.llm.engine
        order: dict[str, int] = {}
        results: list[list[float] | None] = [None] * len(prompts)
        try:
            for ids, start in zip(prompts, type_starts or [None] * len(prompts)):
                rid = f"pool-{next(self._ids)}"
                pooling = pair_pooling_params(params.to_dict(), start)
                engine.add_request(Request(rid, ids, _ONE_STEP, pooling_params=pooling))
                order[rid] = len(order)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out.pooled
        except BaseException:
            engine.abort_requests(list(order))
            raise
        return [(rid, prompts[i], results[i]) for rid, i in order.items()]

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, str):
            return self._need_tokenizer().encode(prompt)
        return [int(t) for t in prompt]

    def _need_tokenizer(self):
        if self.llm.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids")
        return self.llm.tokenizer


def activation(logits: list[float]) -> list[float]:
    """Softmax over the labels, or the sigmoid of a single one."""
    if len(logits) == 1:
        return [1.0 / (1.0 + math.exp(-logits[0]))]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt as token ids
    return prompts

