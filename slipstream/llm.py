"""LLM: the offline Python API — generate text for many prompts at once, with a progress bar."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from slipstream.engine.args import EngineArgs
from slipstream.engine.core import EngineCore
from slipstream.engine.frontend import InputProcessor, OutputProcessor, as_token_ids
from slipstream.lora.request import LoRARequest
from slipstream.outputs import RequestOutput
from slipstream.sampling_params import SamplingParams
from slipstream.tokenizer.tokenizer import maybe_load_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """An engine for offline batch generation.

    >>> llm = LLM()                      # the default model (SmolLM2, else the embedded one)
    >>> llm.generate(["def fib(n):"], SamplingParams(max_tokens=32))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        # Offline batches favour throughput: several greedy decode steps per host round trip.
        kwargs.setdefault("decode_steps", 8)
        args = EngineArgs(model=model, **kwargs)
        self.engine_config = args.create_engine_config()
        self.tokenizer = maybe_load_tokenizer(self.engine_config.tokenizer_path)
        self.engine = EngineCore(self.engine_config)
        self.engine_config = self.engine.config
        # Each step's outputs are processed while the next step's device work runs. A CPU step
        # has none to overlap with: its outputs are processed right after it, or a first token
        # would be timed only after the multi-step decode that follows.
        self._overlap_outputs = not self.engine_config.device.startswith("cpu")
        self._inputs = InputProcessor(self.engine_config, self.tokenizer)
        self._outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._pooling_client = None

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or {"prompt"|"prompt_token_ids": ...}).

        lora_request: one adapter for every prompt, or one (or None: the base model) per
        prompt; the engine needs enable_lora.

        Every prompt is validated before any runs: a bad one raises ValueError and nothing
        is queued. Outputs come back in the order of the prompts.
        """
        if self.engine_config.runner == "pooling":
            raise ValueError("this is a pooling model: use llm.embed, llm.classify or llm.score")
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")
        loras = _as_lora_list(lora_request, len(prompts))
        staged = [self._stage(p, sp, pr, lo)
                  for p, sp, pr, lo in zip(prompts, params, priorities, loras)]
        order: dict[str, int] = {}
        try:
            for request_id, text, token_ids, sp, children in staged:
                order[request_id] = len(order)
                self._outputs.add(request_id, text, token_ids, sp, children)
                for child in children:
                    self.engine.add_request(child)
        except BaseException:
            self._abort_all(order)  # e.g. a prompt larger than the whole KV cache
            raise
        return self._run(order, use_tqdm)

    def _abort_all(self, order: dict[str, int]) -> None:
        for request_id in order:
            self.engine.abort_requests(self._outputs.abort(request_id))

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (the tokenizer's chat template)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:  # the template writes its own BOS: encode without specials
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(
                text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts, params, use_tqdm: bool = False) -> list:
        """Beam search for each prompt (BeamSearchParams: beam_width, max_tokens,
        length_penalty, ignore_eos): a BeamSearchOutput per prompt, its `sequences` best
        first. The beams run in-flight like any request (engine/beam.py)."""
        from slipstream.sampling.beam_search import BeamSearchParams

        if not isinstance(params, BeamSearchParams):
            raise ValueError("beam_search takes a BeamSearchParams")
        if self.engine_config.runner == "pooling":
            raise ValueError("this is a pooling model: use llm.embed, llm.classify or llm.score")
        ids = [self._inputs.tokenize(_split_prompt(p)[1]) for p in _as_prompt_list(prompts)]
        order: dict[str, int] = {}
        results: list = [None] * len(ids)
        try:
            for prompt_ids in ids:
                # The prompt alone; the search's own length is checked as it starts.
                self._inputs.validate_prompt(prompt_ids, SamplingParams(max_tokens=None))
                search_id = f"beam-{next(self._ids)}"
                self.engine.add_beam_search(search_id, prompt_ids, params,
                                            self._inputs.eos_token_ids)
                order[search_id] = len(order)
            while self.engine.has_unfinished_requests():
                self.engine.step()
                for search_id, out in self.engine.beams.take_finished().items():
                    results[order[search_id]] = out
        except BaseException:
            self.engine.abort_requests(list(order))
            raise
        for prompt_ids, out in zip(ids, results):
            for seq in out.sequences:
                seq.tokens = prompt_ids + seq.output_token_ids
                if self.tokenizer is not None:
                    seq.text = self.tokenizer.decode(seq.output_token_ids)
        return results

    # ---- pooling models (pooling/): LLM(model, runner="pooling") or an encoder checkpoint ----
    def embed(self, prompts, pooling_params=None, use_tqdm: bool = False) -> list:
        """One embedding per prompt (`.outputs.embedding`); pooling_params: PoolingParams
        (dimensions for Matryoshka models, normalize)."""
        return self._pooling().embed(prompts, pooling_params)

    def classify(self, prompts, use_tqdm: bool = False) -> list:
        """Class probabilities per prompt (`.outputs.probs`) from a classification model."""
        return self._pooling().classify(prompts)

    def score(self, text_1, text_2, use_tqdm: bool = False) -> list:
        """`.outputs.score` per (text_1, text_2) pair: a cross-encoder's, or the cosine
        similarity of an embedding model's vectors."""
        return self._pooling().score(text_1, text_2)

    def _pooling(self):
        if self._pooling_client is None:
            from slipstream.pooling.offline import PoolingClient

            self._pooling_client = PoolingClient(self)
        return self._pooling_client

    def get_stats(self) -> dict:
        return self.engine.get_stats()

    def _stage(self, prompt: PromptType, params: SamplingParams, priority: int,
               lora_request: LoRARequest | None = None):
        text, raw = _split_prompt(prompt)
        request_id = str(next(self._ids))
        token_ids, children = self._inputs.process(request_id, raw, params, priority,
                                                   lora_request=lora_request)
        return request_id, text, token_ids, params, children

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = _progress(len(order), use_tqdm)
        # Each step's outputs are processed (detokenized, collected) during the next step's GPU
        # work, not between steps where the GPU would wait for them. Stop strings found there
        # abort their requests after that step: one extra step for them, whose tokens the
        # output processor ignores.
        unprocessed: list = []
        to_abort: list[str] = []
        failed: list[BaseException] = []

        def process_previous() -> None:
            if not unprocessed:
                return
            try:
                outputs, aborts = self._outputs.process(unprocessed.pop(), emit_unfinished=False)
            except BaseException as e:  # raised after the step: the engine stays consistent
                failed.append(e)
                return
            to_abort.extend(aborts)
            for out in outputs:
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    if bar is not None:
                        bar.update(1)

        overlap = self._overlap_outputs
        try:
            while self.engine.has_unfinished_requests():
                unprocessed.append(self.engine.step(
                    while_gpu_runs=process_previous if overlap else None))
                if not overlap:
                    process_previous()
                if failed:
                    raise failed[0]
                if to_abort:
                    self.engine.abort_requests(to_abort)
                    to_abort.clear()
            process_previous()
            if failed:
                raise failed[0]
        except BaseException:
            self._abort_all(order)  # leave the engine clean for the next call
            raise
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _split_prompt(prompt: PromptType) -> tuple[str | None, str | list[int]]:
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), as_token_ids(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], prompt["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(f"a prompt must be text, token ids or a dict, got {type(prompt).__name__}")


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                         f"{type(params).__name__}")
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, "
                             f"got a list holding {type(p).__name__}")
    return params


def _as_lora_list(lora_request, n: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} lora_requests for {n} prompts")
    return loras


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
