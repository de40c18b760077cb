"""Training losses in normalised space."""

from __future__ import annotations

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
