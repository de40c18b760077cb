"""Optimiser parameter groups and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

NO_DECAY_KEYWORDS = ("bias", "norm", "embed", "gamma", "rel_pos", "pad_token", "padding_token")


def check_lr_scales(model: nn.Module, lr_scales: Mapping[str, float] | None) -> dict[str, float]:
    """``lr_scales`` (top-level part of ``model`` -> learning-rate factor) checked: every name a
    direct child of ``model`` (``blocks``, ``embed``, ``debed``...), every factor a number > 0.

    Raises:
        ValueError: naming ``module.lr_scales`` and what is wrong.
    """
    parts = dict(model.named_children())
    out: dict[str, float] = {}
    for name, scale in (lr_scales or {}).items():
        if name not in parts:
            raise ValueError(
                f"module.lr_scales: {name!r} is not a part of the model; its parts: "
                f"{', '.join(parts)}"
            )
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(
                f"module.lr_scales.{name} must be a number > 0 (finetune.freeze stops training "
                f"a part), got {scale!r}"
            )
        if not math.isfinite(scale):
            raise ValueError(f"module.lr_scales.{name} must be finite, got {scale!r}")
        out[name] = float(scale)
    return out


def param_groups(
    model: nn.Module,
    weight_decay: float,
    no_decay_keywords: Iterable[str] = NO_DECAY_KEYWORDS,
    lr_scales: Mapping[str, float] | None = None,
) -> list[dict]:
    """Split trainable parameters into a decayed group and a no-decay group.

    Norm weights, biases, embeddings, layer-scale gains and other vectors (``ndim < 2``) get no
    weight decay; everything else (projection matrices, conv kernels) gets ``weight_decay``.
    With ``lr_scales`` (see :func:`check_lr_scales`) the parameters of each named part form
    groups of their own whose ``lr_scale`` entry :func:`scale_group_lrs` applies to the
    optimiser's rate. Every group has an ``lr_scale`` (1.0 unless named).
    """
    keywords = tuple(no_decay_keywords)
    scales = check_lr_scales(model, lr_scales)
    # (scale, decayed) -> parameters; the unscaled decayed group first and always there, so that
    # without lr_scales the groups are those of earlier checkpoints (decay, then no-decay)
    order = [(1.0, True), (1.0, False), *((s, d) for s in scales.values() for d in (True, False))]
    groups: dict[tuple[float, bool], list[nn.Parameter]] = {key: [] for key in order}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decayed = p.ndim >= 2 and not any(k in name.lower() for k in keywords)
        groups[(scales.get(name.split(".", 1)[0], 1.0), decayed)].append(p)
    return [
        {"params": ps, "weight_decay": weight_decay if decayed else 0.0, "lr_scale": scale}
        for (scale, decayed), ps in groups.items()
        if ps or (scale, decayed) == (1.0, True)
    ]


def scale_group_lrs(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Multiply each group's ``lr`` by its ``lr_scale`` (before a scheduler reads the rates)."""
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * group.get("lr_scale", 1.0)
    return optimizer


class WarmupCosine(LRScheduler):
    """Linear warmup from ``warmup_start`` × lr to lr, then cosine decay to ``min_ratio`` × lr.

    The schedule follows the run's progress ``p`` in ``[0, 1]``: ``step / total_steps``, or, with
    ``time_fraction`` (the share of a wall-clock budget used, see ``TimeBudget``), whichever of the
    two is further along, so the lr reaches its floor when the first budget runs out.

    Args:
        optimizer: the optimiser whose groups' initial lr is the peak.
        total_steps: steps of the whole run (warmup included); ``None`` when only
            ``time_fraction`` bounds the run.
        warmup_steps: linear warmup length; a float in (0, 1) is a fraction of the run.
        min_ratio: final lr as a fraction of the peak.
        warmup_start: first lr as a fraction of the peak.
        time_fraction: returns the share of the time budget used, or ``None`` for no budget.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int | None,
        warmup_steps: float = 0.05,
        min_ratio: float = 0.01,
        warmup_start: float = 0.01,
        last_epoch: int = -1,
        time_fraction: Callable[[], float] | None = None,
    ) -> None:
        fractional = 0 < warmup_steps < 1
        if total_steps is None:
            if time_fraction is None:
                raise ValueError(
                    "the run has no end: set trainer.max_steps, trainer.max_epochs or "
                    "trainer.max_time"
                )
            if warmup_steps and not fractional:
                raise ValueError(
                    "lr_scheduler.warmup_steps must be a fraction in [0, 1) when only "
                    f"trainer.max_time bounds the run, got {warmup_steps}"
                )
        elif total_steps < 1:
            raise ValueError(f"lr_scheduler.total_steps must be >= 1, got {total_steps}")
        self.total_steps = None if total_steps is None else int(total_steps)
        if fractional or total_steps is None:
            self.warmup_fraction = float(warmup_steps)
        else:
            self.warmup_fraction = min(max(warmup_steps, 0), total_steps) / total_steps
        self.warmup_steps = (
            None if total_steps is None else int(self.warmup_fraction * total_steps + 1e-9)
        )
        self.min_ratio = min_ratio
        self.warmup_start = warmup_start
        self.time_fraction = time_fraction
        super().__init__(optimizer, last_epoch)

    def progress(self, step: int) -> float:
        """The run's progress in ``[0, 1]`` at ``step`` (and now, for a time budget)."""
        p = 0.0 if self.total_steps is None else step / self.total_steps
        if self.time_fraction is not None:
            p = max(p, self.time_fraction())
        return min(p, 1.0)

    def factor(self, step: int) -> float:
        p, w = self.progress(step), self.warmup_fraction
        if p < w:
            return self.warmup_start + (1 - self.warmup_start) * p / w
        progress = (p - w) / (1 - w) if w < 1 else 0.0
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def get_lr(self) -> list[float]:
        f = self.factor(self.last_epoch)
        return [base * f for base in self.base_lrs]

    def state_dict(self) -> dict:
        """The scheduler's state without ``time_fraction`` (a callable: the budget callback
        saves and restores the clock)."""
        state = super().state_dict()
        state.pop("time_fraction", None)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        time_fraction = self.time_fraction
        super().load_state_dict(state_dict)
        self.time_fraction = time_fraction


OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]
SchedulerFactory = Callable[..., LRScheduler]
