"""Training loop for the default models: packed 512-token windows, AdamW, bf16 autocast.

The learning rate follows a warmup-stable-decay schedule (schedule.py) whose decay starts when
validation stalls or the step limit (given, or planned from the measured step time to fit the
time budget, capped by an epoch limit) nears; the best-validation weights are kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from .schedule import WsdSchedule


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
    decay_frac: float = 0.25  # decay length, as a fraction of the steps before it
    patience: int = 4  # validation evaluations without improvement before the decay
    eval_every: int | None = None  # None: twice per epoch
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 50
    calib_steps: int = 30  # the step time is measured over steps 10..calib_steps (warm)
    seed: int = 0
    compile: bool = False
    distill_weight: float = 0.0  # share of the loss that is KL to the teacher (draft only)


@dataclass
class TrainStats:
    """What the model card and metrics JSON report about a run."""

    params: int = 0
    steps: int = 0
    decay_start: int = 0
    decay_reason: str = ""
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


def _make_optimizer(model: torch.nn.Module, s: TrainSettings, device: torch.device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")


def plan_max_total(s: TrainSettings, steps_per_epoch: int, done: int, elapsed: float,
                   sec_per_step: float, eval_seconds: float, eval_every: int) -> int:
    """Step limit: what fits in the remaining time budget (evaluations included), capped by
    max_epochs."""
    epoch_cap = max(1, int(s.max_epochs * steps_per_epoch))
    per_step = sec_per_step + eval_seconds / max(1, eval_every)
    fit = done + int(0.95 * max(0.0, s.time_budget_s - elapsed) / max(per_step, 1e-9))
    return max(done + 1, min(epoch_cap, fit))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Run:
    """Mutable state of one training run."""

    model: LlamaForCausalLM
    s: TrainSettings
    sampler: WindowSampler
    sched: WsdSchedule
    val_windows: torch.Tensor
    stats: TrainStats
    eval_every: int
    log: Callable[[str], None]
    t0: float = field(default_factory=time.perf_counter)
    best_val: float = float("inf")
    best_state: dict | None = None
    t_calib: float = 0.0


def train_model(model_config: LlamaConfig, s: TrainSettings, train_tokens: torch.Tensor,
                val_windows: torch.Tensor, log=print,
                teacher: torch.nn.Module | None = None) -> tuple[LlamaForCausalLM, TrainStats]:
    """Train a fresh LlamaForCausalLM; returns it (best validation weights, fp32) and stats."""
    device = train_tokens.device
    torch.manual_seed(s.seed)
    model = LlamaForCausalLM(model_config).to(device)
    fwd = torch.compile(model) if s.compile else model
    opt = _make_optimizer(model, s, device)
    sampler = WindowSampler(train_tokens, s.seq_len, s.batch_size, s.seed)
    max_total = s.steps or max(1, int(s.max_epochs * sampler.steps_per_epoch))
    sched = WsdSchedule(s.lr, s.warmup_steps, max_total, s.decay_frac,
                        patience=None if s.steps else s.patience)
    run = _Run(model, s, sampler, sched, val_windows, TrainStats(params=count_params(model)),
               s.eval_every or max(10, sampler.steps_per_epoch // 2), log)
    log(f"[{s.name}] params={run.stats.params:,} train_tokens={len(train_tokens):,} "
        f"steps/epoch={sampler.steps_per_epoch} budget={s.time_budget_s:.0f}s")
    step, loss_acc, t_log = 0, torch.zeros((), device=device), time.perf_counter()
    while not sched.finished(step):
        for group in opt.param_groups:
            group["lr"] = sched.lr(step)
        with _autocast(device):
            loss, ce = lm_loss(fwd, sampler.next_batch(), teacher, s.distill_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_acc += ce
        step += 1
        if step == 10:
            _sync(device)
            run.t_calib = time.perf_counter()
        if step == s.calib_steps and s.steps is None:
            _calibrate(run, step)
        if step % s.log_every == 0:
            t_log = _log_progress(run, step, loss_acc, t_log)
            loss_acc.zero_()
            if s.steps is None and step > s.calib_steps and sched.decay_start is None:
                _replan(run, step)
        if step % run.eval_every == 0:
            _evaluate(run, step)
        sched.after_step(step)
        if time.perf_counter() - run.t0 > 1.03 * s.time_budget_s:
            run.stats.stopped_by = "time budget"
            break
    if step % s.log_every:  # the last, partial interval: final_train_loss covers the end
        _log_progress(run, step, loss_acc, t_log)
    _evaluate(run, step)
    return _finish(run, step)


def _calibrate(run: _Run, step: int) -> None:
    """Measure the step time and one validation pass, then fix the step limit."""
    _sync(run.val_windows.device)
    sec_per_step = (time.perf_counter() - run.t_calib) / (step - 10)  # warm steps only
    elapsed = time.perf_counter() - run.t0
    t = time.perf_counter()
    validation_loss(run.model, run.val_windows, run.s.batch_size)
    eval_s = time.perf_counter() - t
    run.sched.max_total = plan_max_total(run.s, run.sampler.steps_per_epoch, step,
                                         elapsed + eval_s, sec_per_step, eval_s, run.eval_every)
    run.log(f"[{run.s.name}] {sec_per_step * 1000:.1f} ms/step, eval {eval_s:.2f}s -> "
            f"step limit {run.sched.max_total} "
            f"({run.sched.max_total / run.sampler.steps_per_epoch:.1f} epochs)")


def _replan(run: _Run, step: int) -> None:
    """Refit the step limit to the time budget with the step rate measured so far (a slower
    machine must not run into the budget before its learning rate has decayed)."""
    now = time.perf_counter()
    sec_per_step = (now - run.t_calib) / (step - 10)  # evaluations included
    run.sched.max_total = plan_max_total(run.s, run.sampler.steps_per_epoch, step,
                                         now - run.t0, sec_per_step, 0.0, run.eval_every)


def _log_progress(run: _Run, step: int, loss_acc: torch.Tensor, t_log: float) -> float:
    n = step % run.s.log_every or run.s.log_every
    loss = loss_acc.item() / n
    now = time.perf_counter()
    tok_s = n * run.s.batch_size * run.s.seq_len / max(now - t_log, 1e-9)
    run.stats.loss_curve.append([step, round(loss, 4)])
    run.stats.final_train_loss = loss
    limit = run.sched.total or run.sched.max_total
    run.log(f"[{run.s.name}] step {step}/{limit} loss {loss:.4f} lr {run.sched.lr(step):.2e} "
            f"{tok_s:,.0f} tok/s elapsed {now - run.t0:.1f}s")
    return now


def _evaluate(run: _Run, step: int) -> None:
    stats = run.stats
    if stats.val_curve and stats.val_curve[-1][0] == step:
        return
    val = validation_loss(run.model, run.val_windows, run.s.batch_size)
    stats.val_curve.append([step, round(val, 4)])
    if val < run.best_val:
        run.best_val, stats.best_step = val, step
        run.best_state = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    if run.sched.decay_start is None:
        run.sched.observe_validation(step, val)
        if run.sched.decay_start is not None:
            run.log(f"[{run.s.name}] validation stalled: decay from step {step} "
                    f"to {run.sched.total}")
    run.log(f"[{run.s.name}] step {step} val_loss {val:.4f} "
            f"(best {run.best_val:.4f} @ {stats.best_step})")


def _finish(run: _Run, step: int) -> tuple[LlamaForCausalLM, TrainStats]:
    model, s, stats = run.model, run.s, run.stats
    _sync(next(model.parameters()).device)
    stats.train_seconds = time.perf_counter() - run.t0
    stats.steps, stats.decay_start = step, run.sched.decay_start or step
    stats.decay_reason = run.sched.decay_reason or stats.stopped_by
    stats.tokens_seen = step * s.batch_size * s.seq_len
    stats.epochs = step / run.sampler.steps_per_epoch
    stats.tokens_per_second = stats.tokens_seen / max(stats.train_seconds, 1e-9)
    stats.best_val_loss = run.best_val
    if run.best_state is not None:
        model.load_state_dict(run.best_state)
    model.eval()
    return model, stats
