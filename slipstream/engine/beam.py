"""BeamCoordinator: beam searches run as ordinary requests, in-flight with every other request.

Each beam is a Request that asks for greedy tokens with the top-K logprobs of every step
(the device picks them: the sampler's top-k). When a beam's step comes back the coordinator
takes the sampled token back, so the beam waits (nothing left to compute) until every beam of
its search has reported; then `BeamSearchState.step` picks the next beams. A beam chosen
once keeps its request and gets the chosen token; one chosen twice is forked: the child
shares the parent's full KV blocks and gets a copy of the partly filled one
(`KVCacheManager.fork`, `ModelRunner.copy_blocks`); a beam not chosen is aborted, freeing
its blocks. A beam preempted meanwhile is recomputed like any request, and a fork that finds
no free block starts as a waiting request that recomputes from the prefix cache.

Streaming: after each step of a search, the tokens every live hypothesis (running beams and
finished ones still among the best) begins with are settled, since every final hypothesis
descends from one of them. `take_progress` hands out the newly settled tokens.
"""
from __future__ import annotations

import itertools

from slipstream.engine.request import Request, RequestStatus
from slipstream.outputs import EngineCoreOutput
from slipstream.sampling.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchState,
    common_path,
    step_many,
)
from slipstream.sampling_params import SamplingParams


class _Group:
    def __init__(self, group_id: str, params: BeamSearchParams, state: BeamSearchState):
        self.id = group_id
        self.params = params
        self.state = state
        self.beams: list[Request] = []  # aligned with state.running
        self.reports: dict[str, list[float]] = {}  # beam id -> its packed logprob row
        self.next_index = itertools.count()
        self.settled: list[int] = []  # tokens every live hypothesis begins with


class BeamCoordinator:
    def __init__(self, scheduler, runner):
        self.scheduler = scheduler
        self.runner = runner
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[str, str] = {}  # beam request id -> search id
        self._finished: dict[str, BeamSearchOutput] = {}
        self._progress: dict[str, list[int]] = {}  # newly settled tokens per running search

    @property
    def active(self) -> bool:
        return bool(self._groups)

    def is_search(self, group_id: str) -> bool:
        return group_id in self._groups

    def owns(self, request_id: str) -> bool:
        """Whether request_id is one of a running search's beams."""
        return request_id in self._group_of

    def first_beam(self, group_id: str, prompt_ids: list[int], params: BeamSearchParams,
                   eos_token_ids: tuple[int, ...], priority: int = 0) -> tuple[_Group, Request]:
        """The search and its first beam (the prompt), for EngineCore to validate and queue;
        `start` registers the search once that succeeded."""
        if group_id in self._groups:
            raise ValueError(f"beam search id {group_id!r} is already running")
        if len(prompt_ids) + params.max_tokens > self.scheduler.max_seq_len:
            raise ValueError(
                f"max_tokens: a prompt of {len(prompt_ids)} tokens plus max_tokens="
                f"{params.max_tokens} does not fit the longest sequence this engine holds "
                f"({self.scheduler.max_seq_len} tokens)")
        state = BeamSearchState(params, eos_token_ids)
        sampling = SamplingParams(temperature=0.0, max_tokens=params.max_tokens + 1,
                                  ignore_eos=True, logprobs=state.num_candidates)
        group = _Group(group_id, params, state)
        request = Request(self._beam_id(group), prompt_ids, sampling, priority=priority,
                          packed_logprobs=True)
        return group, request

    def start(self, group: _Group, request: Request) -> None:
        group.beams = [request]
        self._groups[group.id] = group
        self._group_of[request.request_id] = group.id

    def take_finished(self) -> dict[str, BeamSearchOutput]:
        done, self._finished = self._finished, {}
        return done

    def take_progress(self) -> dict[str, list[int]]:
        """Tokens settled since the last call, per search still running (a finished search's
        last tokens are in its result)."""
        progress, self._progress = self._progress, {}
        return progress

    def abort(self, group_id: str) -> None:
        group = self._groups.pop(group_id, None)
        self._progress.pop(group_id, None)
        if group is not None:
            self._drop(group.beams)

    # ---- per step --------------------------------------------------------------------
    def on_outputs(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Consume the step's news of beam requests; return the others'."""
        rest, ready = [], []
        for out in outputs:
            group = self._groups.get(self._group_of.get(out.request_id, ""))
            if group is None:
                rest.append(out)
                continue
            if not out.new_token_ids:
                continue
            request = self.scheduler.get_request(out.request_id)
            if request is not None:  # None: ended by length at the search's last step
                del request.output_token_ids[-len(out.new_token_ids):]  # wait for the siblings
            group.reports[out.request_id] = out.new_logprobs[-1]  # the packed row
            if len(group.reports) == len(group.beams) and group not in ready:
                ready.append(group)
        copies: list[tuple[int, int]] = []
        candidates = []
        for group in ready:
            candidates.append([group.reports[b.request_id] for b in group.beams])
            group.reports.clear()
        for group, chosen in zip(ready, step_many([g.state for g in ready], candidates)):
            self._advance(group, chosen, copies)
        if ready:
            if self.scheduler.kv.host is not None:  # an evicted block's offload before its reuse
                self.runner.apply_kv_transfers(self.scheduler.kv.take_transfers())
            self.runner.copy_blocks(copies)  # every search's forks in one copy
        self.release_idle()
        return rest

    def release_idle(self) -> None:
        """A search with a beam in the waiting queue cannot advance until that beam runs, so
        its beams that only wait for it give their blocks back (their reports are kept):
        otherwise searches could hold every block while each waits for a queued beam."""
        for group in self._groups.values():
            if all(b.status == RequestStatus.RUNNING for b in group.beams):
                continue
            for beam in group.beams:
                if beam.status == RequestStatus.RUNNING and beam.request_id in group.reports:
                    self.scheduler.preempt_idle(beam)

    def _advance(self, group: _Group, chosen: list[tuple[int, int]],
                 copies: list[tuple[int, int]]) -> None:
        """Move the search's requests to its chosen next beams (parent index, token); the
        block copies forks need go to `copies`."""
        if group.state.done:
            del self._groups[group.id]
            self._progress.pop(group.id, None)
            self._drop(group.beams)
            self._finished[group.id] = group.state.result()
            return
        self._settle(group)
        used = {b for b, _ in chosen}
        # Beams not chosen become the forks' requests (their blocks re-pointed, integer work
        # only); any left over are dropped.
        spare = [beam for i, beam in enumerate(group.beams) if i not in used]
        new_beams: list[Request | None] = [None] * len(chosen)
        first_use: set[int] = set()
        for slot, (b, token) in enumerate(chosen):  # forks first: they copy the parent's tokens
            if b in first_use:
                new_beams[slot] = self._fork(group, group.beams[b], token, spare, copies)
            first_use.add(b)
        self._drop(spare)
        seen: set[int] = set()
        for slot, (b, token) in enumerate(chosen):
            if b not in seen:
                seen.add(b)
                group.beams[b].output_token_ids.append(token)
                new_beams[slot] = group.beams[b]
        group.beams = new_beams

    def _settle(self, group: _Group) -> None:
        state = group.state
        start = len(group.settled)
        # The running beams' common tokens are the path to their nearest common ancestor
        # (distinct beams differ in some token), so a step walks only the unsettled tails.
        common = common_path(state.running, start)
        for seq in state.finished:
            tail = seq.output_token_ids[start:]
            n = 0
            while n < min(len(tail), len(common)) and tail[n] == common[n]:
                n += 1
            common = common[:n]
        if common:
            self._progress.setdefault(group.id, []).extend(common)
            group.settled = group.settled + common

    def _fork(self, group: _Group, parent: Request, token: int, spare: list[Request],
              copies: list[tuple[int, int]]) -> Request:
        """The parent's continuation by `token`: a spare running beam re-pointed at the
        parent's blocks, else a new request."""
        tokens = parent.output_token_ids + [token]
        if parent.status == RequestStatus.RUNNING:
            child = _take_running(spare)  # a waiting spare holds no blocks to reuse
            if child is not None:
                pairs = self.scheduler.kv.refork(parent, child)
                child.output_token_ids = tokens
                if pairs is None:  # no block for the copy: recompute from the prefix cache
                    self.scheduler.preempt_idle(child)
                else:
                    child.num_computed_tokens = parent.num_computed_tokens
                    copies.extend(pairs)
                return child
        child = Request(self._beam_id(group), parent.prompt_token_ids, parent.sampling_params,
                        priority=parent.priority, arrival_time=parent.arrival_time,
                        packed_logprobs=True)
        child.output_token_ids = tokens
        self._group_of[child.request_id] = group.id
        if parent.status == RequestStatus.RUNNING:
            pairs = self.scheduler.kv.fork(parent, child)
            if pairs is not None:
                child.num_computed_tokens = parent.num_computed_tokens
                self.scheduler.adopt_running(child)
                copies.extend(pairs)
                return child
        self.scheduler.add_request(child)  # recomputes, sharing full blocks through the prefix cache
        return child

    def _drop(self, beams: list[Request]) -> None:
        if not beams:
            return
        ids = [b.request_id for b in beams]
        self.scheduler.abort_requests(ids)
        for rid in ids:
            self._group_of.pop(rid, None)

    @staticmethod
    def _beam_id(group: _Group) -> str:
        return f"{group.id}-beam{next(group.next_index)}"


def _take_running(spare: list[Request]) -> Request | None:
    """Remove and return the last running request of `spare`, if any."""
    for i in range(len(spare) - 1, -1, -1):
        if spare[i].status == RequestStatus.RUNNING:
            return spare.pop(i)
    return None
