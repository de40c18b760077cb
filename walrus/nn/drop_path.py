"""Stochastic depth (drop path): drop a whole residual branch per sample in training."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def drop_path_mask(
    batch: int, p: float, ndim: int, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """Per-sample keep mask already divided by the keep probability.

    Returns:
        ``(batch, 1, ..., 1)`` with ``ndim`` axes in all; entries ``0`` or ``1 / (1 - p)``.
    """
    keep = 1.0 - p
    mask = torch.empty((batch,) + (1,) * (ndim - 1), device=device, dtype=dtype).bernoulli_(keep)
    return mask.div_(keep)


class DropPath(nn.Module):
    """Zero a sample's branch with probability ``p`` in training; identity in eval."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"drop path probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``(B, ...)`` -> same shape."""
        if not self.training or self.p == 0.0:
            return x
        return x * drop_path_mask(x.shape[0], self.p, x.ndim, x.device, x.dtype)
