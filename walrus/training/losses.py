"""Training losses in normalised space."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

LOSSES = ("mae", "mse")


def normalized_loss(pred: Tensor, target: Tensor, kind: str = "mae") -> Tensor:
    """Mean absolute (``"mae"``) or squared (``"mse"``) error over every element."""
    diff = pred.float() - target.float()
    if kind == "mae":
        return diff.abs().mean()
    if kind == "mse":
        return diff.square().mean()
    raise ValueError(f"unknown loss {kind!r}; expected one of {LOSSES}")


def ensemble_crps(members: Tensor, target: Tensor, alpha: float = 1.0) -> Tensor:
    """The fair (finite-ensemble unbiased) CRPS of ``K >= 2`` members, mean over elements.

    ``members`` is ``(K, *shape)``, ``target`` ``(*shape)``. Per element
    ``mean_i |x_i - y| - alpha * sum_{i<j} |x_i - x_j| / (K (K - 1))``; ``alpha = 1`` is the
    fair CRPS, the expected CRPS of the distribution the members are drawn from. With
    identical members it is their MAE; the second term rewards members that differ as much as
    the truth differs from them. With few members the fair score is flat in how far apart
    members lie that straddle the truth (for K = 2 it is 0 whenever ``x_1 < y < x_2``);
    ``alpha < 1`` (the "almost fair" CRPS) makes that distance cost ``1 - alpha`` per unit.
    """
    k = members.shape[0]
    if k < 2:
        raise ValueError(f"ensemble_crps needs at least 2 members, got {k}")
    x, y = members.float(), target.float()
    skill = (x - y).abs().mean(dim=0)  # (*shape)
    spread = sum((x[i] - x[j]).abs() for i in range(k) for j in range(i + 1, k))  # (*shape)
    return (skill - alpha * spread / (k * (k - 1))).mean()


def pooled_ensemble_crps(members: Tensor, target: Tensor, pool: int, alpha: float = 1.0) -> Tensor:
    """CRPS of the members' ``pool``-point block means plus each member's MAE below that scale.

    ``members`` ``(K, B, T, C, *S)``, ``target`` ``(B, T, C, *S)``, every spatial size divisible
    by ``pool``. Each field splits into its block means (``pool^d`` points, e.g. one patch) and
    the rest; the block means are scored by :func:`ensemble_crps` (spread is rewarded where it
    is calibrated), the rest by every member's mean absolute error (members must agree with the
    truth, hence with each other, below the block scale). Both terms are means over elements.
    """
    n_sp = target.ndim - 3
    if any(n % pool for n in target.shape[3:]):
        raise ValueError(
            f"module.crps_pool={pool} must divide every spatial size, got {tuple(target.shape[3:])}"
        )
    avg = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[n_sp - 1]

    def coarse(x: Tensor) -> Tensor:  # (..., C, *S) -> (..., C, *S / pool)
        flat = x.float().reshape(-1, 1, *x.shape[-n_sp:])
        return avg(flat, pool).reshape(*x.shape[:-n_sp], *[n // pool for n in x.shape[-n_sp:]])

    def fine(x: Tensor, c: Tensor) -> Tensor:  # x minus its block means
        up = c
        for a in range(n_sp):
            up = up.repeat_interleave(pool, dim=up.ndim - n_sp + a)
        return x.float() - up

    cm, ct = coarse(members), coarse(target)
    detail = (fine(members, cm) - fine(target, ct)).abs().mean()
    return ensemble_crps(cm, ct, alpha) + detail


def ensemble_gradient_crps(members: Tensor, target: Tensor, alpha: float = 1.0) -> Tensor:
    """:func:`ensemble_crps` of the members' spatial differences against the target's.

    ``members`` ``(K, B, T, C, *S)``, ``target`` ``(B, T, C, *S)``; averaged over the spatial
    axes longer than one point. Members that differ from each other at the grid scale more
    than the truth varies there (patch seams, pixel noise) score worse.
    """
    axes = [a for a in range(3, target.ndim) if target.shape[a] > 1]
    if not axes:
        return target.new_zeros((), dtype=torch.float32)
    terms = [ensemble_crps(members.diff(dim=a + 1), target.diff(dim=a), alpha) for a in axes]
    return sum(terms) / len(terms)


def gradient_loss(pred: Tensor, target: Tensor, kind: str = "mae") -> Tensor:
    """The ``kind`` error of the error's spatial differences, averaged over spatial axes.

    ``pred`` and ``target`` are ``(B, T, C, *S)``; along each spatial axis longer than one point
    the forward difference of ``pred - target`` is scored like :func:`normalized_loss` scores
    values. An error that jumps from one point to the next (a seam between decoder patches,
    grid-scale noise) costs far more here than a smooth one of the same size.
    """
    diff = pred.float() - target.float()  # (B, T, C, *S)
    axes = [a for a in range(3, diff.ndim) if diff.shape[a] > 1]
    if not axes:
        return diff.new_zeros(())
    terms = [normalized_loss(diff.diff(dim=a), diff.new_zeros(()), kind) for a in axes]
    return sum(terms) / len(terms)
