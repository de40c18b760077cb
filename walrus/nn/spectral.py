"""Spectral operations on fields ``(N, C, *sp)``: a low-pass filter and a per-shell change limit.

Both work on the isotropic wavenumber ``|k|`` (``k`` in radians per cell on every axis).
Periodic axes are transformed as they are; a non-periodic axis is first extended by its mirror
image (an even extension, as a cosine transform does), so that its two ends are not coupled
and no jump is made at the wall. Axes of size 1 are left alone.

- :func:`spectral_filter`: the exponential filter spectral solvers use against aliasing
  (Hesthaven and Warburton, "Nodal Discontinuous Galerkin Methods", sec. 5.6). With
  ``eta = |k| / pi`` (1 at the Nyquist wavenumber of an axis), the gain is 1 for
  ``eta <= cutoff`` and ``exp(-ALPHA * ((eta - cutoff) / (1 - cutoff)) ** order)`` above it.
- :func:`limit_spectral_change`: a step's change from one frame to the next may carry, in each
  radial shell of wavenumbers, at most ``ratio`` times the RMS amplitude the first frame has
  in that shell; a larger change is scaled down in that shell alone. Grid-scale noise that a
  smooth field does not have (the seams of a patch decoder) is thereby held to the field's
  own fine-scale content, while fields that do have fine scales keep their changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

ALPHA = 36.0  # exp(-36) ~ 2e-16: the Nyquist mode is gone
# Shell power below this fraction of a field's fluctuation power (per mode) counts as empty:
# changes there are held to that floor instead of to zero
EMPTY_SHELL = 1e-6


def _axes(y: Tensor, periodic: Sequence[bool] | None) -> tuple[list[int], list[bool]]:
    """The spatial axes of ``(N, C, *sp)`` to transform (size > 1) and whether each wraps."""
    n_sp = y.ndim - 2
    periodic = [True] * n_sp if periodic is None else list(periodic)
    if len(periodic) != n_sp:
        raise ValueError(f"periodic has {len(periodic)} entries for {n_sp} spatial axes")
    axes = [2 + i for i in range(n_sp) if y.shape[2 + i] > 1]
    return axes, [periodic[ax - 2] for ax in axes]


def _work(y: Tensor, axes: Sequence[int], wraps: Sequence[bool]) -> Tensor:
    """``y`` in float32 (float64 kept), mirrored along each non-periodic axis: ``(.., 2n, ..)``."""
    work = y if y.dtype == torch.float64 else y.float()
    for ax, wrap in zip(axes, wraps):
        if not wrap:
            work = torch.cat([work, work.flip(ax)], dim=ax)
    return work


def _crop(out: Tensor, like: Tensor, axes: Sequence[int]) -> Tensor:
    """``out`` cut back to ``like``'s spatial sizes, in ``like``'s dtype."""
    for ax in axes:
        out = out.narrow(ax, 0, like.shape[ax])
    return out.to(like.dtype)


def _wavenumbers(sizes: Sequence[int], device: torch.device | None) -> Tensor:
    """``|f|`` in cycles per cell on the ``rfftn`` grid of ``sizes`` (last axis halved), float64."""
    f64 = torch.float64
    freqs = [torch.fft.fftfreq(n, device=device, dtype=f64) for n in sizes[:-1]]
    freqs.append(torch.fft.rfftfreq(sizes[-1], device=device, dtype=f64))
    grids = torch.meshgrid(*freqs, indexing="ij")
    return torch.sqrt(sum(g.square() for g in grids))


def _broadcast(t: Tensor, n_sp: int, axes: Sequence[int]) -> Tensor:
    """A tensor over the transformed axes viewed with size-1 entries at the skipped ones."""
    shape = [1] * n_sp
    for ax, n in zip(axes, t.shape[-len(axes) :]):
        shape[ax - 2] = n
    return t.reshape(*t.shape[: t.ndim - len(axes)], *shape)


def filter_gain(
    sizes: Sequence[int], cutoff: float, order: int, device: torch.device | None = None
) -> Tensor:
    """The gain on the ``rfftn`` grid of a field of shape ``sizes`` (last axis halved).

    Args:
        sizes: spatial sizes of the (extended) field.
        cutoff: ``eta`` below which the gain is 1, in ``[0, 1)``.
        order: even exponent; larger is sharper.

    Returns:
        ``(*sizes[:-1], sizes[-1] // 2 + 1)`` float64 gains in ``[0, 1]``.
    """
    eta = _wavenumbers(sizes, device) * 2.0  # |2 pi f| / pi
    excess = ((eta - cutoff) / (1.0 - cutoff)).clamp(min=0.0)
    return torch.exp(-ALPHA * excess.pow(order))


def spectral_filter(
    y: Tensor, cutoff: float, order: int, periodic: Sequence[bool] | None = None
) -> Tensor:
    """Filter ``y`` over its trailing spatial axes.

    Args:
        y: ``(N, C, *sp)`` with ``len(sp)`` spatial axes (1 to 3).
        cutoff: ``eta`` up to which every mode is kept, in ``[0, 1)``.
        order: even exponent of the damping.
        periodic: per spatial axis, whether it wraps around; default all periodic.

    Returns:
        ``(N, C, *sp)`` in ``y``'s dtype (computed in float32, or float64 for float64 input).
    """
    axes, wraps = _axes(y, periodic)
    if not axes:
        return y
    work = _work(y, axes, wraps)
    sizes = [work.shape[ax] for ax in axes]
    gain = _broadcast(filter_gain(sizes, cutoff, order, work.device), y.ndim - 2, axes)
    spec = torch.fft.rfftn(work, dim=axes)  # (N, C, *sp) with the last transformed axis halved
    out = torch.fft.irfftn(spec * gain.to(work.dtype), s=sizes, dim=axes)  # (N, C, *extended)
    return _crop(out, y, axes)


def limit_spectral_change(
    last: Tensor, nxt: Tensor, ratio: float, periodic: Sequence[bool] | None = None
) -> Tensor:
    """``nxt`` with its change from ``last`` limited shell by shell.

    Shells are ``|f| * n`` rounded to an integer, ``f`` in cycles per cell and ``n`` the
    largest (extended) axis; shell 0 (the mean) is never limited. Per sample, field and shell,
    a change whose power exceeds ``ratio**2`` times ``last``'s power there is scaled down to
    it (phases kept). A shell where ``last`` has (almost) no power is held to ``EMPTY_SHELL``
    of the field's mean power per mode instead, so changes can build a flat shell up, by at
    most ``(1 + ratio)**2`` in power per step. A field that is flat in space is not limited.

    Args:
        last: ``(N, C, *sp)`` the frame the step starts from.
        nxt: ``(N, C, *sp)`` the predicted next frame.
        ratio: largest change amplitude per shell over ``last``'s (> 0).
        periodic: per spatial axis, whether it wraps around; default all periodic.

    Returns:
        ``(N, C, *sp)`` in ``nxt``'s dtype.
    """
    if ratio <= 0:
        raise ValueError(f"ratio must be > 0, got {ratio}")
    if last.shape != nxt.shape:
        raise ValueError(f"last {tuple(last.shape)} and nxt {tuple(nxt.shape)} differ in shape")
    axes, wraps = _axes(nxt, periodic)
    if not axes:
        return nxt
    u = _work(last.to(nxt.dtype), axes, wraps)
    d = _work(nxt, axes, wraps) - u  # (N, C, *extended) the change
    sizes = [u.shape[ax] for ax in axes]
    f = _wavenumbers(sizes, u.device)  # (*sizes[:-1], sizes[-1] // 2 + 1)
    shell = torch.round(f * max(sizes)).long()
    # the halved axis holds its interior modes once for two: weigh them twice
    half = torch.full((sizes[-1] // 2 + 1,), 2.0, dtype=u.dtype, device=u.device)
    half[0] = 1.0
    if sizes[-1] % 2 == 0:
        half[-1] = 1.0
    weight = half.expand(f.shape).flatten()  # (M,)
    shell, n_shells = shell.flatten(), int(shell.max()) + 1
    spec_u = torch.fft.rfftn(u, dim=axes)  # (N, C, *sp) with the last transformed axis halved
    spec_d = torch.fft.rfftn(d, dim=axes)
    lead = spec_u.shape[:2]

    def shell_power(spec: Tensor) -> Tensor:  # (N, C, n_shells); size-1 axes add no modes
        power = spec.flatten(2).abs().square() * weight  # (N, C, M)
        return power.new_zeros(*lead, n_shells).index_add_(2, shell, power)

    p_u, p_d = shell_power(spec_u), shell_power(spec_d)
    count = weight.new_zeros(n_shells).index_add_(0, shell, weight)  # modes per shell
    fluct = p_u[..., 1:].sum(-1, keepdim=True)  # (N, C, 1) all but the mean
    floor = EMPTY_SHELL * fluct / count.sum() * count  # (N, C, n_shells)
    allowed = ratio**2 * torch.maximum(p_u, floor)
    gain = torch.sqrt(allowed / p_d.clamp(min=torch.finfo(p_d.dtype).tiny)).clamp(max=1.0)
    gain[..., 0] = 1.0  # the mean
    gain = torch.where(fluct > 0, gain, torch.ones_like(gain))  # flat fields: no limit
    g = gain[..., shell].reshape(spec_d.shape)  # (N, C, *sp halved)
    change = torch.fft.irfftn(spec_d * g, s=sizes, dim=axes)  # (N, C, *extended)
    return _crop(u + change, nxt, axes)
