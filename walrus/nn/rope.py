"""Axial rotary position embedding over up to three spatial axes.

Each axis rotates ``head_dim // 4`` (rounded down to even) channels of every head with "pixel"
frequencies: positions ``linspace(-1, 1, n)`` per axis, frequencies
``linspace(1, max_freq / 2, rot / 2) * pi``. Channels are rotated in interleaved pairs; the
channels left over pass through unchanged. Tables are cached per grid, device and dtype.

Notation: S = h*w*d tokens, E = head_dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class AxialRoPE(nn.Module):
    """Axial rotary embedding; call :meth:`tables` once per forward, then :func:`apply_rope`.

    Args:
        head_dim: channels per head (even, at least 8).
        max_freq: the largest "pixel" frequency.
        n_axes: number of spatial axes (3: lower-dimensional grids have size-1 axes).
    """

    def __init__(self, head_dim: int, max_freq: float = 256.0, n_axes: int = 3):
        super().__init__()
        if head_dim % 2 or head_dim < 8:
            raise ValueError(f"AxialRoPE: head_dim must be even and >= 8, got {head_dim}")
        self.head_dim, self.n_axes, self.max_freq = head_dim, n_axes, max_freq
        self.axis_dim = (head_dim // 4) // 2 * 2
        freqs = torch.linspace(1.0, max_freq / 2, self.axis_dim // 2) * math.pi
        self.register_buffer("freqs", freqs, persistent=True)
        self._cache: dict[tuple, tuple[Tensor, Tensor]] = {}

    def tables(
        self, grid: tuple[int, ...], device: torch.device, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """Cosine and signed-sine tables for a token grid.

        Args:
            grid: ``(h, w, d)`` token grid, flattened row-major into S.

        Returns:
            ``cos, sin``, each ``(S, 1, E)`` (broadcast over heads); pass-through channels have
            cos 1 and sin 0. ``sin`` carries the pair sign: ``(-s, +s)`` per pair.
        """
        key = (tuple(grid), device, dtype)
        if key not in self._cache:
            with torch.no_grad():
                self._cache[key] = self._build(tuple(grid), device, dtype)
        return self._cache[key]

    def _build(
        self, grid: tuple[int, ...], device: torch.device, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        freqs = self.freqs.to(device=device, dtype=torch.float32)
        angles = []
        for axis, n in enumerate(grid):
            pos = (
                torch.linspace(-1.0, 1.0, n, device=device)
                if n > 1
                else torch.zeros(1, device=device)
            )
            ang = pos[:, None] * freqs  # (n, axis_dim/2)
            shape = [1] * len(grid) + [ang.shape[-1]]
            shape[axis] = n
            angles.append(ang.view(shape).expand(*grid, ang.shape[-1]))
        ang = torch.cat(angles, dim=-1).reshape(-1, len(grid) * (self.axis_dim // 2))  # (S, R/2)
        ang = ang.repeat_interleave(2, dim=-1)  # (S, R)
        pad = self.head_dim - ang.shape[-1]
        cos = torch.cat([ang.cos(), ang.new_ones(ang.shape[0], pad)], dim=-1)  # (S, E)
        sign = torch.tensor([-1.0, 1.0], device=device).repeat(ang.shape[-1] // 2)
        sin = torch.cat([ang.sin() * sign, ang.new_zeros(ang.shape[0], pad)], dim=-1)  # (S, E)
        return cos[:, None].to(dtype), sin[:, None].to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved channel pairs: ``x * cos + swap_pairs(x) * sin``.

    Args:
        x: ``(..., S, heads, E)``.
        cos, sin: ``(S, 1, E)`` from :meth:`AxialRoPE.tables`.

    Returns:
        ``(..., S, heads, E)``.
    """
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (..., S, heads, E)
    return torch.addcmul(x * cos, swapped, sin)
