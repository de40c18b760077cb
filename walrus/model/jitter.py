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

The current official layout (:data:`walrus.model.profile.WALRUS_CURRENT`) has no learned tokens:
:func:`flag_jitter` pads with zeros and appends three indicator channels instead (ones outside
non-periodic padding, a wall flag, an open flag), which the encoder projects like fields.

Random offsets come from a :class:`JitterDraws` (a CPU generator); :class:`RecordedDraws`
replays a fixed list instead, e.g. the draws another implementation made.
"""

from __future__ import annotations

from collections.abc import Sequence
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
) -> AxisPlan:
    """Padding for one axis so two strided convs tile it exactly (this project's plan).

    With kernels ``(k1, k2)`` and strides ``(s1, s2)`` (patch ``P = s1*s2``) the convs need
    ``k1 + s1*(k2-1) - P`` extra points; ``(-size) % P`` more pad the axis to a whole number of
    patches, and a non-periodic jittered axis gets ``P`` more (half a patch each side).

    This is also the current official layout's plan (it pads ``(k1 + s1*(k2-1) - P) // 2`` per
    side): the two agree whenever ``size`` is a multiple of ``P``, the only sizes the official
    code accepts.
    """
    (s1, s2), (k1, k2) = strides, kernels
    patch = s1 * s2
    extra = patch // 2 if jitter and bc[0] != BoundaryType.PERIODIC else 0
    conv_pad = k1 + s1 * (k2 - 1) - patch
    lo = conv_pad // 2 + extra
    hi = conv_pad - conv_pad // 2 + (-size) % patch + extra
    return AxisPlan(lo=lo, hi=hi, shift=shift, bc_lo=int(bc[0]), bc_hi=int(bc[1]))


def plan_axis_symmetric(
    size: int,
    strides: tuple[int, int],
    kernels: tuple[int, int],
    bc: tuple[int, int],
    jitter: bool,
    shift: int,
) -> AxisPlan:
    """The legacy official padding plan (same arguments as :func:`plan_axis`).

    A non-periodic jittered axis first gets ``P // 2`` per side, then ``(P - r) // 2`` on both
    sides with ``r = (n - k1 + s1 - k2*s1) mod P`` for the (enlarged) length ``n`` (symmetric;
    the convs tile exactly when ``P - r`` is even).
    """
    (s1, s2), (k1, k2) = strides, kernels
    patch = s1 * s2
    extra = patch // 2 if jitter and bc[0] != BoundaryType.PERIODIC else 0
    n = size + 2 * extra
    lo = hi = extra + (patch - (n - k1 + s1 - k2 * s1) % patch) // 2
    return AxisPlan(lo=lo, hi=hi, shift=shift, bc_lo=int(bc[0]), bc_hi=int(bc[1]))


class JitterDraws:
    """Random integers for patch jitter and latent rolls, from a CPU generator.

    Args:
        generator: CPU ``torch.Generator``; ``None`` uses torch's global generator.
    """

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def randint(self, low: int, high: int) -> int:
        """One integer in ``[low, high)``."""
        return int(torch.randint(low, high, (1,), generator=self.generator))


class RecordedDraws(JitterDraws):
    """Replays recorded integers in order instead of drawing them.

    Each value is checked against the range the model asks for, so a replay that drifts out of
    step fails loudly. Use through :meth:`walrus.model.walrus.Walrus.replay_jitter`.

    Args:
        values: the integers, in the order the model draws them.
    """

    def __init__(self, values: Sequence[int]):
        super().__init__(None)
        self.values = [int(v) for v in values]
        self.used = 0

    def randint(self, low: int, high: int) -> int:
        """The next recorded integer (``ValueError`` if none is left or it is outside the range)."""
        if self.used >= len(self.values):
            raise ValueError(
                f"RecordedDraws: draw {self.used + 1} (range [{low}, {high})) was asked for but "
                f"only {len(self.values)} were recorded"
            )
        value = self.values[self.used]
        if not low <= value < high:
            raise ValueError(
                f"RecordedDraws: draw {self.used + 1} is {value}, outside the range "
                f"[{low}, {high}) the model draws from"
            )
        self.used += 1
        return value


def shift_within_half_patch(
    draws: JitterDraws, plan: AxisPlan, size: int, stride: tuple[int, int]
) -> int:
    """A random patch-grid shift of less than half a patch (this project's jitter)."""
    half = stride[0] * stride[1] // 2
    return draws.randint(-(half - 1), half) if half > 1 else 0


def shift_within_padding(
    draws: JitterDraws, plan: AxisPlan, size: int, stride: tuple[int, int]
) -> int:
    """The current official jitter: less than half the axis on a periodic axis, less than its
    padding on the others; no draw for a patch of one point."""
    if stride[0] * stride[1] <= 1:
        return 0
    half = size // 2 if plan.periodic else plan.lo
    return draws.randint(-(half - 1), half)


def pad_axes(x: Tensor, plans: list[AxisPlan]) -> Tensor:
    """Pad every axis of ``x`` ``(N, C, *spatial)``: periodic axes are shifted then wrapped
    around, the others get zeros (not yet shifted). Returns ``(N, C, *padded)``."""
    for i, p in enumerate(plans):
        ax = 2 + i
        n = x.shape[ax]
        if p.periodic and max(p.lo, p.hi) <= n:  # roll and wrap by copies (no gather)
            x = torch.roll(x, p.shift, dims=ax) if p.shift % n else x
            if p.lo or p.hi:
                x = torch.cat([x.narrow(ax, n - p.lo, p.lo), x, x.narrow(ax, 0, p.hi)], ax)
        elif p.periodic:  # wraps around more than once
            idx = (torch.arange(-p.lo, n + p.hi, device=x.device) - p.shift) % n
            x = x.index_select(ax, idx)
        else:
            x = F.pad(x, [0, 0] * (x.ndim - ax - 1) + [p.lo, p.hi])
    return x


def _edge_masks(p: AxisPlan, length: int, device: torch.device, dtype: torch.dtype):
    """``(lo, hi)`` masks ``(length,)``: 1 in the axis' low / high padding, 0 elsewhere."""
    pos = torch.arange(length, device=device)
    return (pos < p.lo).to(dtype), (pos >= length - p.hi).to(dtype)


def _along(v: Tensor, ax: int, ndim: int) -> Tensor:
    """A vector ``(L,)`` shaped to broadcast along axis ``ax`` of an ``ndim`` tensor."""
    return v.view(*(1,) * ax, -1, *(1,) * (ndim - ax - 1))


def flag_jitter(x: Tensor, plans: list[AxisPlan]) -> Tensor:
    """Pad and shift with boundary flag channels (current official layout).

    Non-periodic padding is zeros; three channels are appended: ``ones`` (0 inside any
    non-periodic padding), ``wall`` and ``open`` (1 inside a padding of that boundary type;
    corners get the sum). Periodic axes are shifted and wrapped; the others are shifted after
    padding, flags included.

    Args:
        x: ``(N, C, *spatial)`` with one plan per spatial axis.

    Returns:
        ``(N, C + 3, *padded)``.
    """
    x = pad_axes(x, plans)
    n, padded = x.shape[0], x.shape[2:]
    flags = x.new_zeros(3, *padded)  # (3, *padded): ones, wall, open
    flags[0] = 1.0
    for i, p in enumerate(plans):
        if p.periodic:
            continue
        lo, hi = _edge_masks(p, padded[i], x.device, x.dtype)
        flags[0] *= _along(1.0 - (lo + hi).clamp(max=1.0), i, len(padded))
        flags[1 + p.bc_lo] += _along(lo, i, len(padded))
        flags[1 + p.bc_hi] += _along(hi, i, len(padded))
    x = torch.cat([x, flags.expand(n, 3, *padded)], dim=1)  # (N, C + 3, *padded)
    for i, p in enumerate(plans):
        if p.shift and not p.periodic:
            x = torch.roll(x, p.shift, dims=2 + i)
    return x


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
        x = pad_axes(x, plans)  # pad every axis first: wrap or zeros
        if all(p.periodic for p in plans):
            return x
        tokens = self.padding_tokens.view(2, -1).to(x.dtype)  # (2, dim)
        for i, p in enumerate(plans):  # then tokens over the full padded extent: corners sum
            if p.periodic:
                continue
            ax = 2 + i
            lo_mask, hi_mask = _edge_masks(p, x.shape[ax], x.device, x.dtype)  # (L,) each
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
