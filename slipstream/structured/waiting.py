"""GrammarWaitRoom: structured-output requests wait here, outside the scheduler, while their
grammar compiles in the manager's thread; each engine step takes the ready ones (with their
RequestGrammar attached) to the scheduler, so a new schema never holds up the running batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from slipstream.engine.request import Request
from slipstream.structured.grammar import RequestGrammar
from slipstream.structured.manager import StructuredOutputManager

# With nothing else to run, a step waits this long for a grammar before returning (the caller
# loops): short enough that new requests and aborts are still seen promptly.
IDLE_WAIT_S = 0.05


class GrammarWaitRoom:
    def __init__(self, tokenizer_path: str | None, vocab_size: int) -> None:
        self.manager = StructuredOutputManager(tokenizer_path, vocab_size)
        self._waiting: dict[str, tuple[Request, Future]] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, request: Request) -> None:
        future = self.manager.compile(request.sampling_params.structured_outputs)
        self._waiting[request.request_id] = (request, future)

    def discard(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._waiting.pop(rid, None)

    def ready(self, wait: bool = False) -> list[tuple[Request, BaseException | None]]:
        """Requests whose grammar is done, in arrival order: (request, None) with
        request.grammar set, or (request, the compile error). wait: block up to IDLE_WAIT_S
        for the first one."""
        if not self._waiting:
            return []
        if wait and not any(f.done() for _, f in self._waiting.values()):
            futures = {f for _, f in self._waiting.values()}
            wait_for(futures, IDLE_WAIT_S)
        out = []
        for rid, (request, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[rid]
            error = future.exception()
            if error is None:
                request.grammar = RequestGrammar(future.result(), request.eos_token_ids, self.manager.encode)
            out.append((request, error))
        return out

    def shutdown(self) -> None:
        self.manager.shutdown()


def wait_for(futures: set[Future], timeout: float) -> None:
    wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
