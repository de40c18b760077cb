"""Layer scale folded into the residual add (with drop path)."""

from __future__ import annotations

import torch
from torch import Tensor

from walrus.nn.drop_path import drop_path_mask


def scaled_residual(
    x: Tensor, branch: Tensor, gamma: Tensor | None, drop_prob: float, training: bool
) -> Tensor:
    """``x + drop_path(gamma * branch)`` as one fused ``addcmul``.

    Args:
        x: residual stream ``(B, ..., C)``.
        branch: branch output, same shape as ``x``.
        gamma: per-channel layer scale ``(C,)``, or ``None`` for none.
        drop_prob: drop path probability (used only when ``training``).
        training: whether the module is in training mode.

    Returns:
        ``(B, ..., C)``.
    """
    scale = gamma
    if training and drop_prob > 0.0:
        dtype = branch.dtype if gamma is None else gamma.dtype
        mask = drop_path_mask(x.shape[0], drop_prob, x.ndim, x.device, dtype)
        scale = mask if gamma is None else gamma * mask
    if scale is None:
        return x + branch
    return torch.addcmul(x, branch, scale.to(branch.dtype))
