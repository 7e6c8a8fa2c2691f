"""StructuredOutputManager: grammars compiled against the vocabulary in a worker thread, once
per distinct constraint (an LRU of compiled grammars), so a request with a new schema waits
for its grammar while the batch keeps running.

The vocabulary comes from the engine's tokenizer, loaded on the first constrained request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from slipstream.runner.cpu_threads import physical_cores
from slipstream.structured.params import StructuredOutputsParams, build_grammar

logger = logging.getLogger(__name__)

CACHE_SIZE = 512  # compiled grammars kept; a large vocabulary's grammar can take a few MB


class StructuredOutputManager:
    def __init__(self, tokenizer_path: str | None, vocab_size: int) -> None:
        self._tokenizer_path = tokenizer_path
        self._vocab_size = vocab_size
        self._lock = threading.Lock()  # guards the cache and the compiler's creation
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._compiler: Any = None
        self._tokenizer: Any = None  # the HF tokenizer, loaded with the compiler
        self._executor: ThreadPoolExecutor | None = None
        self.compile_seconds: dict[tuple[str, str], float] = {}  # for benchmarks and logs

    def compile(self, params: StructuredOutputsParams) -> Future:
        """A Future of the compiled grammar, shared by every request with the same constraint."""
        key = params.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-grammar")
            future = self._executor.submit(self._compile, key, params)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def _compile(self, key: tuple[str, str], params: StructuredOutputsParams) -> Any:
        start = time.perf_counter()
        compiled = self._get_compiler().compile_grammar(build_grammar(params))
        self.compile_seconds[key] = time.perf_counter() - start
        if len(self.compile_seconds) > CACHE_SIZE:
            self.compile_seconds.pop(next(iter(self.compile_seconds)))
        return compiled

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                self._tokenizer = _load_tokenizer(self._tokenizer_path)
                self._compiler = _make_compiler(self._tokenizer, self._vocab_size)
            return self._compiler

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as the model's tokenizer splits it (no special tokens); only
        called once a grammar compiled, so the tokenizer is loaded."""
        return self._tokenizer.encode(text, add_special_tokens=False)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def compile_threads() -> int:
    """xgrammar's threads for one compile (it computes the grammar's token masks in parallel):
    a new schema waits less, while most cores stay with the step loop."""
    return max(1, min(4, physical_cores() // 4))


def _load_tokenizer(tokenizer_path: str | None) -> Any:
    from slipstream.tokenizer.tokenizer import maybe_load_tokenizer

    tokenizer = maybe_load_tokenizer(tokenizer_path)
    if tokenizer is None:
        raise ValueError("structured_outputs needs the model's tokenizer, and this model has none")
    return tokenizer


def _make_compiler(tokenizer: Any, vocab_size: int) -> Any:
    import xgrammar as xgr

    # The model's vocabulary may be padded past the tokenizer's: the extra ids stay masked.
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer.hf, vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids) or None
    )
    return xgr.GrammarCompiler(info, max_threads=compile_threads())
