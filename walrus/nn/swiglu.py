"""SwiGLU gate."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class SwiGLU(nn.Module):
    """Split the last axis in half, ``(a, g)``, and return ``a * silu(g)``: ``(..., 2F) -> (..., F)``."""

    def forward(self, x: Tensor) -> Tensor:
        a, g = x.chunk(2, dim=-1)  # (..., F) each
        return a * F.silu(g)
