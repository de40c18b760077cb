"""Field embedding over a shared vocabulary of physical fields ("space bag").

The vocabulary has one learned column per field. A batch names its C fields by vocabulary
id; the per-pixel projection uses only those columns, rescaled by ``sqrt(n_fields / C)`` so a
batch with few fields sees the same activation scale as one with all of them.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn


class FieldEmbedding(nn.Module):
    """Per-pixel projection ``n_fields -> dim`` restricted to the batch's fields.

    Args:
        n_fields: vocabulary size.
        dim: output channels (the projection dim).
        scale_bias: apply the ``sqrt(n_fields / C)`` rescale to the bias too, as the official
            legacy official Walrus does; by default only the weight is rescaled.
    """

    def __init__(self, n_fields: int, dim: int, scale_bias: bool = False):
        super().__init__()
        self.linear = nn.Linear(n_fields, dim)
        self.scale_bias = scale_bias

    @property
    def n_fields(self) -> int:
        return self.linear.in_features

    def forward(self, x: Tensor, fields: Tensor) -> Tensor:
        """Embed.

        Args:
            x: ``(N, C, *spatial)``.
            fields: ``(C,)`` long vocabulary ids, on the weight's device.

        Returns:
            ``(N, dim, *spatial)``.
        """
        n, c = x.shape[:2]
        w, bias = self.weight_and_bias(fields)  # (dim, C), (dim,)
        y = F.conv1d(x.reshape(n, c, -1), w[:, :, None], bias)  # (N, dim, S)
        return y.view(n, -1, *x.shape[2:])

    def weight_and_bias(self, fields: Tensor) -> tuple[Tensor, Tensor]:
        """The projection applied to a batch with ``fields`` ``(C,)``: ``(dim, C)`` weight
        (rescaled) and ``(dim,)`` bias."""
        scale = math.sqrt(self.n_fields / fields.numel())
        w = self.linear.weight[:, fields] * scale  # (dim, C)
        bias = self.linear.bias * scale if self.scale_bias else self.linear.bias  # (dim,)
        return w, bias
