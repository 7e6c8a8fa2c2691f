"""Training loop for the default models: packed 512-token windows, AdamW, cosine schedule.

The number of steps is fixed in advance (given, or planned from the measured step time so the
run fits its time budget), capped by an epoch limit because the corpus is small; the weights
with the best validation loss are kept.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


@dataclass
class TrainSettings:
    """Everything one training run needs besides the data and the model config."""

    name: str
    time_budget_s: float
    lr: float
    batch_size: int
    seq_len: int
    max_epochs: float
    steps: int | None = None  # fixed step count (reproducible); None: planned from the budget
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 50
    num_evals: int = 10
    calib_steps: int = 30
    seed: int = 0
    compile: bool = False
    distill_weight: float = 0.0  # share of the loss that is KL to the teacher (draft only)


@dataclass
class TrainStats:
    """What the model card and metrics JSON report about a run."""

    params: int = 0
    steps: int = 0
    planned_steps: int = 0
    tokens_seen: int = 0
    epochs: float = 0.0
    train_seconds: float = 0.0
    tokens_per_second: float = 0.0
    final_train_loss: float = float("nan")
    best_val_loss: float = float("nan")
    best_step: int = 0
    stopped_by: str = "steps"
    loss_curve: list[list[float]] = field(default_factory=list)
    val_curve: list[list[float]] = field(default_factory=list)


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embeddings count once


class WindowSampler:
    """Random batches of (seq_len + 1)-token windows; a new offset and order every epoch."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.arange = torch.arange(seq_len + 1, device=tokens.device)
        self.windows_per_epoch = (len(tokens) - seq_len - 1) // seq_len + 1
        self.steps_per_epoch = max(1, self.windows_per_epoch // batch_size)
        self._order: torch.Tensor | None = None
        self._pos = 0

    def _new_epoch(self) -> None:
        offset = int(torch.randint(0, self.seq_len, (1,), generator=self.gen))
        n = (len(self.tokens) - offset - self.seq_len - 1) // self.seq_len + 1
        starts = offset + torch.randperm(n, generator=self.gen) * self.seq_len
        self._order, self._pos = starts.to(self.tokens.device), 0

    def next_batch(self) -> torch.Tensor:
        if self._order is None or self._pos + self.batch_size > len(self._order):
            self._new_epoch()
        starts = self._order[self._pos: self._pos + self.batch_size]
        self._pos += self.batch_size
        return self.tokens[starts[:, None] + self.arange]


def fixed_windows(tokens: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping (seq_len + 1)-token windows from the start of tokens (for validation)."""
    n = min(max_windows, max(1, (len(tokens) - 1) // seq_len))
    starts = torch.arange(n, device=tokens.device) * seq_len
    return tokens[starts[:, None] + torch.arange(seq_len + 1, device=tokens.device)]


def lm_loss(model: torch.nn.Module, batch: torch.Tensor, teacher: torch.nn.Module | None = None,
            distill_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to minimise, mean next-token cross entropy in fp32) over a [B, S + 1] batch.

    With a teacher, part of the loss is KL(teacher || model): a draft that imitates the
    target's distribution agrees with it more often, which is what speculative decoding needs.
    """
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits.float().flatten(0, 1)
    ce = F.cross_entropy(logits, batch[:, 1:].flatten())
    if teacher is None or distill_weight <= 0:
        return ce, ce.detach()
    with torch.no_grad():
        t_logits = teacher(input_ids=batch[:, :-1], use_cache=False).logits.float().flatten(0, 1)
    kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(t_logits, -1), log_target=True,
                  reduction="batchmean")
    return (1 - distill_weight) * ce + distill_weight * kl, ce.detach()


@torch.no_grad()
def validation_loss(model: torch.nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    model.eval()
    total = 0.0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i: i + batch_size]
        with _autocast(windows.device):
            total += lm_loss(model, chunk)[1].item() * len(chunk)
    model.train()
    return total / len(windows)


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _lr_at(step: int, total: int, s: TrainSettings) -> float:
    warmup = min(s.warmup_steps, max(1, total // 10))
    if step < warmup:
        return s.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _make_optimizer(model: torch.nn.Module, s: TrainSettings, device: torch.device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")


def plan_steps(s: TrainSettings, steps_per_epoch: int, done: int, elapsed: float,
               sec_per_step: float, eval_seconds: float) -> int:
    """Total steps: the given count, or what fits in the budget, capped by max_epochs."""
    epoch_cap = max(1, int(s.max_epochs * steps_per_epoch))
    if s.steps is not None:
        return s.steps
    remaining = s.time_budget_s - elapsed - s.num_evals * eval_seconds
    fit = done + int(0.92 * max(0.0, remaining) / max(sec_per_step, 1e-9))
    return max(done + 1, min(epoch_cap, fit))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_model(model_config: LlamaConfig, s: TrainSettings, train_tokens: torch.Tensor,
                val_windows: torch.Tensor, log=print,
                teacher: torch.nn.Module | None = None) -> tuple[LlamaForCausalLM, TrainStats]:
    """Train a fresh LlamaForCausalLM; returns it (best validation weights, fp32) and stats."""
    device = train_tokens.device
    torch.manual_seed(s.seed)
    model = LlamaForCausalLM(model_config).to(device)
    stats = TrainStats(params=count_params(model))
    fwd = torch.compile(model) if s.compile else model
    opt = _make_optimizer(model, s, device)
    sampler = WindowSampler(train_tokens, s.seq_len, s.batch_size, s.seed)
    total = s.steps or max(1, int(s.max_epochs * sampler.steps_per_epoch))
    log(f"[{s.name}] params={stats.params:,} train_tokens={len(train_tokens):,} "
        f"steps/epoch={sampler.steps_per_epoch} budget={s.time_budget_s:.0f}s")
    state = _LoopState(best_val=float("inf"), best_state=None, t0=time.perf_counter())
    step, loss_acc, t_log = 0, torch.zeros((), device=device), time.perf_counter()
    while step < total:
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, total, s)
        with _autocast(device):
            loss, ce = lm_loss(fwd, sampler.next_batch(), teacher, s.distill_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_acc += ce
        step += 1
        if step == s.calib_steps and s.steps is None:
            total = _calibrate(model, s, sampler, val_windows, state, step, log)
        if step % s.log_every == 0 or step == total:
            t_log = _log_progress(s, stats, step, total, loss_acc, t_log, state.t0, log)
            loss_acc.zero_()
        if step % max(1, total // s.num_evals) == 0 or step == total:
            _evaluate(model, s, val_windows, state, stats, step, log)
        if time.perf_counter() - state.t0 > 1.03 * s.time_budget_s:
            stats.stopped_by = "time budget"
            _evaluate(model, s, val_windows, state, stats, step, log)
            break
    return _finish(model, s, sampler, state, stats, step, total)


@dataclass
class _LoopState:
    best_val: float
    best_state: dict | None
    t0: float
    sec_per_step: float = 0.0


def _calibrate(model, s, sampler, val_windows, state, step, log) -> int:
    """Measure the step time (and one validation pass), then fix the total step count."""
    _sync(val_windows.device)
    elapsed = time.perf_counter() - state.t0
    t = time.perf_counter()
    validation_loss(model, val_windows, s.batch_size)
    eval_s = time.perf_counter() - t
    state.sec_per_step = elapsed / step  # includes warm-up, so slightly pessimistic
    total = plan_steps(s, sampler.steps_per_epoch, step, elapsed + eval_s,
                       state.sec_per_step, eval_s)
    log(f"[{s.name}] {state.sec_per_step * 1000:.1f} ms/step, eval {eval_s:.2f}s -> "
        f"planned {total} steps ({total / sampler.steps_per_epoch:.1f} epochs)")
    return total


def _log_progress(s, stats, step, total, loss_acc, t_log, t0, log) -> float:
    n = step % s.log_every or s.log_every
    loss = loss_acc.item() / n
    now = time.perf_counter()
    tok_s = n * s.batch_size * s.seq_len / max(now - t_log, 1e-9)
    stats.loss_curve.append([step, round(loss, 4)])
    stats.final_train_loss = loss
    log(f"[{s.name}] step {step}/{total} loss {loss:.4f} {tok_s / 1e6:.2f}M tok/s "
        f"elapsed {now - t0:.1f}s")
    return now


def _evaluate(model, s, val_windows, state, stats, step, log) -> None:
    if stats.val_curve and stats.val_curve[-1][0] == step:
        return
    val = validation_loss(model, val_windows, s.batch_size)
    stats.val_curve.append([step, round(val, 4)])
    if val < state.best_val:
        state.best_val, stats.best_step = val, step
        state.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    log(f"[{s.name}] step {step} val_loss {val:.4f} (best {state.best_val:.4f} @ {stats.best_step})")


def _finish(model, s, sampler, state, stats, step, total):
    _sync(next(model.parameters()).device)
    stats.train_seconds = time.perf_counter() - state.t0
    stats.steps, stats.planned_steps = step, total
    stats.tokens_seen = step * s.batch_size * s.seq_len
    stats.epochs = step / sampler.steps_per_epoch
    stats.tokens_per_second = stats.tokens_seen / max(stats.train_seconds, 1e-9)
    stats.best_val_loss = state.best_val
    if state.best_state is not None:
        model.load_state_dict(state.best_state)
    model.eval()
    return model, stats
