"""Patch jittering with learned boundary padding, and its exact inverse.

Before encoding, each spatial axis that the encoder strides over is shifted by a random offset
smaller than half a patch, so patch borders do not sit at fixed places during rollout:

- periodic axis: the field is rolled (exact), then wrapped around to add the padding;
- wall / open axis: padded with a learned token per boundary type (corners get the sum), then
  the padded tensor is rolled. With jitter on, half a patch of extra padding on each side keeps
  the real data from wrapping.

The padding also includes what the strided convolutions need to tile the axis exactly. The
layout of the padding depends only on the configuration, never on whether a random offset is
drawn, so training and evaluation see the same latent grid. :meth:`PatchJitterer.unjitter`
undoes a jitter exactly (roll back, crop, unroll).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from walrus.bcs import BoundaryType


@dataclass(frozen=True)
class AxisPlan:
    """Padding and shift of one strided axis (all Python ints: no device syncs)."""

    lo: int
    hi: int
    shift: int
    bc_lo: int
    bc_hi: int

    @property
    def periodic(self) -> bool:
        return self.bc_lo == BoundaryType.PERIODIC


def plan_axis(
    size: int,
    strides: tuple[int, int],
    kernels: tuple[int, int],
    bc: tuple[int, int],
    jitter: bool,
    shift: int,
    compat: str | None = None,
) -> AxisPlan:
    """Padding for one axis so two strided convs tile it exactly.

    With kernels ``(k1, k2)`` and strides ``(s1, s2)`` (patch ``P = s1*s2``) the convs need
    ``k1 + s1*(k2-1) - P`` extra points; ``(-size) % P`` more pad the axis to a whole number of
    patches, and a non-periodic jittered axis gets ``P`` more (half a patch each side).

    With ``compat="walrus_official"`` the official plan is used instead: a non-periodic
    jittered axis first gets ``P // 2`` per side, then ``(P - r) // 2`` on both sides with
    ``r = (n - k1 + s1 - k2*s1) mod P`` for the (enlarged) length ``n`` (symmetric; the convs
    tile exactly when ``P - r`` is even).
    """
    (s1, s2), (k1, k2) = strides, kernels
    patch = s1 * s2
    periodic = bc[0] == BoundaryType.PERIODIC
    extra = patch // 2 if jitter and not periodic else 0
    if compat == "walrus_official":
        n = size + 2 * extra
        lo = hi = extra + (patch - (n - k1 + s1 - k2 * s1) % patch) // 2
    else:
        conv_pad = k1 + s1 * (k2 - 1) - patch
        lo = conv_pad // 2 + extra
        hi = conv_pad - conv_pad // 2 + (-size) % patch + extra
    return AxisPlan(lo=lo, hi=hi, shift=shift, bc_lo=int(bc[0]), bc_hi=int(bc[1]))


class PatchJitterer(nn.Module):
    """Learned boundary padding plus random shifts of the patch grid.

    Args:
        dim: channels of the tensor being padded (the projection dim).
    """

    def __init__(self, dim: int):
        super().__init__()
        # One learned token per non-periodic boundary type: WALL=0, OPEN=1.
        self.padding_tokens = nn.Parameter(torch.zeros(2, dim, 1, 1, 1))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.padding_tokens, std=0.02)

    def jitter(self, x: Tensor, plans: list[AxisPlan]) -> Tensor:
        """Pad and shift.

        Args:
            x: ``(N, dim, *spatial)`` with one plan per spatial axis.

        Returns:
            ``(N, dim, *padded)`` with ``padded[i] = spatial[i] + lo + hi``.
        """
        for i, p in enumerate(plans):  # pad every axis first: wrap or zeros
            ax = 2 + i
            n = x.shape[ax]
            if p.periodic:
                idx = (torch.arange(-p.lo, n + p.hi, device=x.device) - p.shift) % n
                x = x.index_select(ax, idx)
            else:
                x = F.pad(x, [0, 0] * (x.ndim - ax - 1) + [p.lo, p.hi])
        if all(p.periodic for p in plans):
            return x
        tokens = self.padding_tokens.view(2, -1).to(x.dtype)  # (2, dim)
        for i, p in enumerate(plans):  # then tokens over the full padded extent: corners sum
            if p.periodic:
                continue
            ax = 2 + i
            pos = torch.arange(x.shape[ax], device=x.device)
            lo_mask = (pos < p.lo).to(x.dtype)  # (L,)
            hi_mask = (pos >= x.shape[ax] - p.hi).to(x.dtype)  # (L,)
            edge = (
                tokens[p.bc_lo][:, None] * lo_mask + tokens[p.bc_hi][:, None] * hi_mask
            )  # (dim, L)
            x = x + edge.view(edge.shape[0], *(1,) * (ax - 2), -1, *(1,) * (x.ndim - ax - 1))
            if p.shift:
                x = torch.roll(x, p.shift, dims=ax)
        return x

    @staticmethod
    def unjitter(y: Tensor, plans: list[AxisPlan]) -> Tensor:
        """Exact inverse of :meth:`jitter` on the spatial layout (any channel count).

        Args:
            y: ``(N, C, *padded)``.

        Returns:
            ``(N, C, *spatial)``.
        """
        for i, p in enumerate(plans):
            ax = 2 + i
            if p.shift and not p.periodic:
                y = torch.roll(y, -p.shift, dims=ax)
            y = y.narrow(ax, p.lo, y.shape[ax] - p.lo - p.hi)
            if p.shift and p.periodic:
                y = torch.roll(y, -p.shift, dims=ax)
        return y
