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
