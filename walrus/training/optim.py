"""Optimiser parameter groups and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

NO_DECAY_KEYWORDS = ("bias", "norm", "embed", "gamma", "rel_pos", "pad_token", "padding_token")


def param_groups(
    model: nn.Module, weight_decay: float, no_decay_keywords: Iterable[str] = NO_DECAY_KEYWORDS
) -> list[dict]:
    """Split trainable parameters into a decayed group and a no-decay group.

    Norm weights, biases, embeddings, layer-scale gains and other vectors (``ndim < 2``) get no
    weight decay; everything else (projection matrices, conv kernels) gets ``weight_decay``.
    """
    keywords = tuple(no_decay_keywords)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or any(k in name.lower() for k in keywords):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class WarmupCosine(LRScheduler):
    """Linear warmup from ``warmup_start`` × lr to lr, then cosine decay to ``min_ratio`` × lr.

    Args:
        optimizer: the optimiser whose groups' initial lr is the peak.
        total_steps: steps of the whole run (warmup included).
        warmup_steps: linear warmup length; a float in (0, 1) is a fraction of ``total_steps``.
        min_ratio: final lr as a fraction of the peak.
        warmup_start: first lr as a fraction of the peak.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: float = 0.05,
        min_ratio: float = 0.01,
        warmup_start: float = 0.01,
        last_epoch: int = -1,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"lr_scheduler.total_steps must be >= 1, got {total_steps}")
        self.total_steps = int(total_steps)
        w = warmup_steps * total_steps if 0 < warmup_steps < 1 else warmup_steps
        self.warmup_steps = int(min(max(w, 0), total_steps))
        self.min_ratio = min_ratio
        self.warmup_start = warmup_start
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_start + (1 - self.warmup_start) * step / self.warmup_steps
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def get_lr(self) -> list[float]:
        f = self.factor(self.last_epoch)
        return [base * f for base in self.base_lrs]


OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]
SchedulerFactory = Callable[..., LRScheduler]
