"""Stochastic depth (drop path): the per-sample mask that drops a whole residual branch.

Applied together with the layer scale by :func:`walrus.nn.layer_scale.scaled_residual`.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
