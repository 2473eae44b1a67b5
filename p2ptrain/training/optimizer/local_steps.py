"""This peer's own optimizer: the inner steps of DiLoCo, the gradient sums of sync mode, and applying an
averaged gradient.

Theory of operation. In sync mode every backward pass leaves the batch's mean gradient in the parameters'
``.grad``, which :meth:`LocalSteps.accumulate` adds to the contribution's buffer weighted by the batch's
samples (or, with ``summed`` gradients, the backward pass added into the buffer itself: its views are the
``.grad``); a committed round's average is applied by :meth:`LocalSteps.apply`, one step of the wrapped
optimizer with the learning rate of the global step. In DiLoCo every backward pass is followed by one
inner step of the wrapped optimizer (:meth:`LocalSteps.inner_step`), at the learning rate of the inner
step count. Gradients are clipped the same way on every peer: the same bits go in, the same come out.
"""

from __future__ import annotations

import copy
import time

import torch

from ...config import TrainingSection
from .bookkeeping import Tally
from .buffers import Contribution, ParamBuffer


def inner_lr(t: TrainingSection, step: int) -> float:
    """The learning rate of step ``step`` (linear warmup, then constant): every rank of a site, too."""
    return t.lr * min(1.0, (step + 1) / t.warmup_steps) if t.warmup_steps else t.lr


class LocalSteps:
    """The wrapped torch optimizer's side of the collaborative one."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[torch.Tensor],
        training: TrainingSection,
        contribution: Contribution,
        tally: Tally,
    ) -> None:
        self.optimizer, self.params, self.training = optimizer, params, training
        self.contribution, self.tally = contribution, tally
        self.inner_seconds = 0.0  # DiLoCo: time in the inner optimizer's steps (training compute too)

    def set_lr(self, step: int) -> None:
        lr = inner_lr(self.training, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def inner_step(self) -> None:
        """DiLoCo's local step (its learning rate set first, by the inner step count)."""
        began = time.perf_counter()
        self.clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.inner_seconds += time.perf_counter() - began

    def accumulate(self, samples: int) -> None:
        """Sync: the batch's gradients (a mean over ``samples``) go into the contribution as a sum."""
        buffer = self.contribution.buffer
        if self.contribution.summed:  # the backward pass added into the accumulator itself
            for p, acc in zip(self.params, buffer.views, strict=True):
                if p.grad is None:  # (cleared, and not used by this batch)
                    p.grad = acc
                elif p.grad.data_ptr() != acc.data_ptr():
                    raise RuntimeError(
                        "summed_grads: a parameter's .grad was replaced (cleared by the training loop?):"
                        " the gradients accumulated so far are no longer where backward adds"
                    )
            return
        with torch.no_grad():
            for p, acc in zip(self.params, buffer.views, strict=True):
                if p.grad is not None:
                    acc.add_(p.grad, alpha=samples)  # the loss is a mean: its gradient times samples
                p.grad = None

    def apply(self, grads: ParamBuffer, zero: bool = True) -> None:
        """One optimizer step with ``grads``, then zeroed for reuse as an accumulator; ``zero`` False:
        a round averaged them in place and may still serve them, so nothing writes into them."""
        self.set_lr(self.tally.epoch)
        held = [p.grad for p in self.params]  # summed: the accumulator of the next step
        for p, g in zip(self.params, grads.views, strict=True):
            p.grad = g
        self.clip(shared=not zero)
        self.optimizer.step()
        for p, h in zip(self.params, held, strict=True):
            p.grad = h
        if zero:
            grads.zero_()

    def clip(self, shared: bool = False) -> None:
        """Clip the gradients' norm. ``shared``: they are a round's buffer that it may still serve to
        members fetching late (averaged in place): they are left alone, and the clipped gradients go
        into copies (only when clipping changes them). The same bits either way: one multiplication by
        the same factor."""
        limit = self.training.grad_clip
        if limit <= 0:
            return
        if not shared:
            torch.nn.utils.clip_grad_norm_(self.params, limit)
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        factor = torch.clamp(limit / (torch.nn.utils.get_total_norm(grads) + 1e-6), max=1.0)
        if float(factor) < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad = p.grad * factor

    def state_tensors(self) -> list[torch.Tensor]:
        """This peer's training state as tensors, live (what a round of a swarm split into regions
        averages): the parameters, then each floating tensor of the optimizer's per-parameter state, in
        the optimizer's parameter order and by state name. State the optimizer creates at its first
        step (Adam's moments and step count, SGD's momentum) is created here first, as zeros shaped as a
        throwaway step on copies shows (:meth:`_first_state`): the state a first step starts from (so
        exactly for Adam, AdamW and SGD without dampening), and every peer of a step averages the same
        tensors whether or not it has stepped yet."""
        opt = self.optimizer
        ordered = [p for group in opt.param_groups for p in group["params"]]
        if any(not opt.state.get(p) for p in ordered):
            first = self._first_state()
            for i, p in enumerate(ordered):
                if not opt.state.get(p) and first[i]:
                    opt.state[p] = {
                        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
                        for k, v in first[i].items()
                    }
        out = list(ordered)
        for p in ordered:
            state = opt.state.get(p, {})
            out += [
                state[k]
                for k in sorted(state)
                if isinstance(state[k], torch.Tensor) and state[k].is_floating_point()
            ]
        return out

    def _first_state(self) -> list[dict[str, object]]:
        """Each parameter's optimizer state after one step with zero gradients, on copies (of the
        optimizer and its parameters: a model-sized copy, once; nothing here changes)."""
        probe = copy.deepcopy(self.optimizer)
        params = [p for group in probe.param_groups for p in group["params"]]
        for p in params:
            p.grad = torch.zeros_like(p)
        probe.step()
        return [dict(probe.state.get(p, {})) for p in params]
