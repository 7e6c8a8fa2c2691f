"""Sampler: one step of token selection for a batch of requests, on the logits' device.

Order per row: logprobs of the raw logits (when asked), penalties, min_tokens mask, then
greedy argmax or temperature -> top-k -> top-p -> min-p -> sample. Sampling is an exponential
race (argmax of probs / q, q ~ Exp(1)), so a seeded row depends only on its own logits and
its own generator, whatever else is in the batch. The one host sync is the final read-back.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from slipstream.sampling.logit_controls import LogitControls, has_logit_controls
from slipstream.sampling.logprobs import pack_top_logprobs, unpack_top_logprobs
from slipstream.sampling.penalties import apply_penalties, has_penalties, mask_min_tokens
from slipstream.sampling.topk_topp import apply_min_p, apply_top_k_top_p
from slipstream.sampling_params import _GREEDY_EPS

if TYPE_CHECKING:
    from slipstream.engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Top-N plus the sampled token; None when not asked; a request with packed_logprobs gets
    # its row of pack_top_logprobs instead (beam search).
    logprobs: list[dict[int, float] | list[float] | None]


@dataclass
class _Params:
    """Per-row sampling parameters on the device, plus host-side facts that skip work."""

    greedy: torch.Tensor  # [S] bool
    temperature: torch.Tensor  # [S] float, 1.0 on greedy rows
    top_k: torch.Tensor | None  # [S] long, None when no row uses it
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    max_k: int
    any_greedy: bool

    @staticmethod
    def build(requests: list[Request], device: torch.device) -> _Params:
        sps = [r.sampling_params for r in requests]
        # Per-field lists into numpy (one C conversion each: this runs every step for every row);
        # the checks use float64, as the parameters are, before the float32 copy.
        temps = np.array([sp.temperature for sp in sps], dtype=np.float64)
        ks = np.array([sp.top_k for sp in sps], dtype=np.int64)
        ps = np.array([sp.top_p for sp in sps], dtype=np.float64)
        mps = np.array([sp.min_p for sp in sps], dtype=np.float64)
        greedy = temps < _GREEDY_EPS  # SamplingParams.greedy
        # Greedy rows go through the sampling maths too (then get overwritten): keep them
        # neutral so nothing divides by zero. One host-to-device copy for all parameters
        # (top_k < 2**24 is exact in float32).
        host = np.empty((5, len(sps)), dtype=np.float32)
        host[0] = np.where(greedy, 1.0, temps)
        host[1], host[2], host[3], host[4] = ks, ps, mps, greedy
        dev = torch.from_numpy(host).to(device, non_blocking=True)
        return _Params(
            greedy=dev[4].bool(),
            temperature=dev[0],
            top_k=dev[1].long() if ks.any() else None,
            top_p=dev[2] if (ps < 1.0).any() else None,
            min_p=dev[3] if mps.any() else None,
            max_k=int(ks.max()),
            any_greedy=bool(greedy.any()),
        )


class Sampler:
    """Callable: (logits [S, V], requests) -> SamplerOutput. Row i belongs to requests[i]."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._controls = LogitControls()

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 grammar_drafts: dict[int, list[int]] | None = None) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"sampler: logits {tuple(logits.shape)} for {len(requests)} requests")
        if not requests:
            return SamplerOutput([], [])
        if logits.dtype != torch.float32:
            logits = logits.float()
        lp_rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        raw_logprobs = self._raw_logprobs(logits, lp_rows)
        logits = self._process(logits, requests, grammar_drafts)
        tokens = self._choose(logits, requests)
        return self._read_back(tokens, raw_logprobs, lp_rows, requests)

    def sample_on_device(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The token ids [S] as __call__ chooses them, left on the device (no logprobs: the
        caller reads them later, async_scheduling)."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        return self._choose(self._process(logits, requests), requests)

    # -- steps -------------------------------------------------------------------------

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        if not rows:
            return None
        # The model's own distribution: before penalties, temperature or truncation.
        sub = logits if len(rows) == logits.shape[0] else logits[rows]
        return torch.log_softmax(sub, dim=-1)

    def _process(self, logits: torch.Tensor, requests: list[Request],
                 grammar_drafts: dict[int, list[int]] | None = None) -> torch.Tensor:
        """Penalties, the min_tokens mask, then the logit controls (bias, allowed / bad
        tokens, processors, grammar bitmask), on a copy (the caller's logits stay intact)."""
        needs = any(
            has_penalties(r.sampling_params) or r.num_output_tokens < r.sampling_params.min_tokens
            or has_logit_controls(r)
            for r in requests
        )
        if not needs:
            return logits
        logits = logits.clone()
        apply_penalties(logits, requests)
        mask_min_tokens(logits, requests)
        return self._controls(logits, requests, grammar_drafts)

    def _choose(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        if all(r.sampling_params.greedy for r in requests):  # no parameters to copy over
            return _argmax(logits)
        params = _Params.build(requests, logits.device)
        x = logits / params.temperature.view(-1, 1)
        x = apply_top_k_top_p(x, params.top_k, params.top_p, params.max_k)
        if params.min_p is not None:
            x = apply_min_p(x, params.min_p)
        probs = x.softmax(dim=-1)
        sampled = (probs / self._exponentials(probs, requests)).argmax(dim=-1)
        if not params.any_greedy:
            return sampled
        return torch.where(params.greedy, logits.argmax(dim=-1), sampled)

    def _exponentials(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """q ~ Exp(1), [S, V]: unseeded rows from the shared generator in one draw, seeded
        rows redrawn from their own generator (one draw of V values per step)."""
        q = torch.empty_like(probs).exponential_(generator=self._shared_generator(probs.device))
        for i, r in enumerate(requests):
            sp = r.sampling_params
            if sp.seed is not None and not sp.greedy:
                q[i].exponential_(generator=request_generator(r, probs.device))
        # Exp(1) can return 0; a zero would turn a masked token's 0 / q into NaN.
        return q.clamp_(min=torch.finfo(q.dtype).tiny)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self.seed is None:
                gen.seed()
            else:
                gen.manual_seed(self.seed)
            self._shared[device] = gen
        return gen

    @staticmethod
    def _read_back(
        tokens: torch.Tensor,
        raw_logprobs: torch.Tensor | None,
        lp_rows: list[int],
        requests: list[Request],
    ) -> SamplerOutput:
        num_rows = tokens.shape[0]
        if raw_logprobs is None:
            return SamplerOutput(tokens.tolist(), [None] * num_rows)
        ks = [requests[i].sampling_params.logprobs for i in lp_rows]
        lp_tokens = tokens if len(lp_rows) == num_rows else tokens[lp_rows]
        packed = pack_top_logprobs(raw_logprobs, lp_tokens, max(ks))
        width = packed.shape[1]
        # Token ids and logprobs come back in one copy (float64 holds both exactly).
        flat = torch.cat([tokens.double(), packed.flatten()]).tolist()
        token_ids = [int(t) for t in flat[:num_rows]]
        rows = [flat[num_rows + j * width : num_rows + (j + 1) * width] for j in range(len(lp_rows))]
        logprobs: list[dict[int, float] | list[float] | None] = [None] * num_rows
        dict_rows = []
        for j, i in enumerate(lp_rows):
            if requests[i].packed_logprobs:  # beam search reads the packed row itself
                logprobs[i] = rows[j]
            else:
                dict_rows.append(j)
        if len(dict_rows) == len(rows):
            dicts = unpack_top_logprobs(rows, ks)
        else:
            dicts = unpack_top_logprobs([rows[j] for j in dict_rows], [ks[j] for j in dict_rows])
        for j, d in zip(dict_rows, dicts):
            logprobs[lp_rows[j]] = d
        return SamplerOutput(token_ids, logprobs)


def request_generator(request: Request, device: torch.device) -> torch.Generator:
    """The request's own generator, created on first use and seeded with its seed."""
    gen = request.generator
    if not isinstance(gen, torch.Generator) or gen.device != device:
        gen = torch.Generator(device=device)
        gen.manual_seed(request.sampling_params.seed)
        request.generator = gen
    return gen


def warm_up_greedy(logits: torch.Tensor) -> None:
    """Choose greedily once from logits [S, V] (float32, as the engine passes them), so the
    argmax kernel is compiled before a request waits on it."""
    _argmax(logits.float())


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row argmax: the chunked Triton kernel on CUDA (torch's one-pass reduction is slow over a
    large vocabulary), torch elsewhere."""
    if logits.is_cuda and logits.dim() == 2:
        return _cuda_argmax()(logits)
    return logits.argmax(dim=-1)


@functools.cache
def _cuda_argmax():
    try:
        from slipstream.kernels.sampling.greedy import argmax_rows  # Triton: optional
    except ImportError:  # no Triton
        return lambda logits: logits.argmax(dim=-1)
    return argmax_rows
