"""T5-style bucketed relative position bias (over time).

Distances below half the buckets get a bucket each; larger ones share log-spaced buckets up to
``max_distance``. Unidirectional (causal) mode only distinguishes the past: keys after the
query share bucket 0 (they are masked anyway). Bucket indices are cached per length and device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def relative_buckets(
    length: int, num_buckets: int, max_distance: int, bidirectional: bool
) -> Tensor:
    """Bucket index of every (query i, key j) pair.

    Returns:
        ``(length, length)`` long.
    """
    pos = torch.arange(length)
    rel = pos[None, :] - pos[:, None]  # (Lq, Lk) key - query
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets
        n = rel.abs()
    else:
        n = (-rel).clamp(min=0)
    max_exact = num_buckets // 2
    large = (
        max_exact
        + (
            torch.log(n.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(n < max_exact, n, large)


class RelativePositionBias(nn.Module):
    """Learned per-head bias from bucketed relative positions.

    Args:
        heads: attention heads.
        num_buckets: number of buckets.
        max_distance: distance at which the last bucket starts.
        bidirectional: ``False`` in causal mode.
    """

    def __init__(
        self,
        heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = False,
    ):
        super().__init__()
        self.heads, self.num_buckets, self.max_distance = heads, num_buckets, max_distance
        self.bidirectional = bidirectional
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)
        self._cache: dict[tuple, Tensor] = {}

    def reset_parameters(self) -> None:
        nn.init.normal_(self.relative_attention_bias.weight, std=0.02)

    def buckets(self, length: int, device: torch.device) -> Tensor:
        """Cached ``(length, length)`` bucket indices on ``device`` (not cached inside
        ``torch.compile``: filling the cache there would cost a recompile)."""
        key = (length, device)
        compiling = torch.compiler.is_compiling()
        if compiling or key not in self._cache:
            b = relative_buckets(length, self.num_buckets, self.max_distance, self.bidirectional)
            if compiling:
                return b.to(device)
            self._cache[key] = b.to(device)
        return self._cache[key]

    def forward(self, length: int, device: torch.device) -> Tensor:
        """Bias for a sequence of ``length``: ``(heads, length, length)``."""
        return self.relative_attention_bias(self.buckets(length, device)).permute(2, 0, 1)
