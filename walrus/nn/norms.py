"""RMS group normalisation.

Like GroupNorm without mean subtraction: channels split into ``groups`` and each group is
scaled by the root mean square over its channels *and* all spatial positions of one sample
(one frame). Weight only, no bias.

The official Walrus "RMSGroupNorm" is this norm with one group per channel (``groups=dim``)
and eps ``torch.finfo(float32).eps`` (it ignores its eps argument; the statistic here is fp32):
the official profiles (:mod:`walrus.model.profile`) construct it so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable


def _stat_dtype(x: Tensor) -> torch.dtype:
    """Statistics in at least fp32 (fp64 stays fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


class _RMSScale(torch.autograd.Function):
    """``x * rsqrt(k * sum(x^2 over dims) + eps) * w`` with a backward of three passes over x.

    Autograd's backward of the composite (``vector_norm``'s divide, mask and multiply, the
    product's two gradients and their sum) makes about six; this one writes ``gy * x`` once,
    reduces it, and writes the input gradient in one multiply and one fused multiply-add. The
    composite's forward and gradients up to rounding. ``x`` and ``w`` share one dtype of at
    least fp32 (the statistic's dtype).
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor | None, dims: tuple[int, ...], k: float, eps: float):  # noqa: ANN205
        inv = torch.linalg.vector_norm(x, dim=dims, keepdim=True).square_()
        inv = inv.mul_(k).add_(eps).rsqrt_()  # statistic, broadcastable to x
        ctx.save_for_backward(x, w, inv)
        ctx.dims, ctx.k = dims, k
        return x * (inv if w is None else inv * w)

    @staticmethod
    @once_differentiable  # the saved statistic carries no graph: no double backward
    def backward(ctx, gy: Tensor):  # noqa: ANN205
        x, w, inv = ctx.saved_tensors
        dims = [d % x.ndim for d in ctx.dims]
        p = gy * x
        gw = None
        if w is None:
            r = p.sum(dims, keepdim=True)
            scale = inv
        else:
            lead = x.ndim - w.ndim  # w aligns with x's trailing dims
            over_w = [d for d in dims if d < lead or w.shape[d - lead] == 1]
            # summed where w is constant, then over the rest (sum([]) would sum every dim)
            pw = p.sum(over_w, keepdim=True) if over_w else p
            r = pw * w
            if rest := [d for d in dims if d not in over_w]:
                r = r.sum(rest, keepdim=True)
            gw = (pw * inv).sum_to_size(w.shape) if ctx.needs_input_grad[1] else None
            scale = inv * w
        coef = r.mul_(inv.pow(3)).mul_(-ctx.k)  # d inv / d x = -k inv^3 x, times sum(gy w x)
        gx = torch.mul(gy, scale).addcmul_(x, coef)
        return gx, gw, None, None, None


def _one_dtype(x: Tensor, w: Tensor | None) -> bool:
    """``x`` (and ``w``) already in the statistic's dtype: the fused backward applies."""
    return _stat_dtype(x) == x.dtype and (w is None or w.dtype == x.dtype)


class RMSGroupNorm(nn.Module):
    """RMS group norm over tokens and channel groups.

    Args:
        dim: number of channels.
        groups: number of channel groups; must divide ``dim``.
        eps: added to the mean square.
        channels_last: ``True`` for ``(..., S, C)`` inputs (statistic over ``S`` and the group's
            channels, per leading index); ``False`` for ``(N, C, *spatial)`` inputs.
    """

    def __init__(self, dim: int, groups: int, eps: float = 1e-6, channels_last: bool = True):
        super().__init__()
        if dim % groups != 0:
            raise ValueError(f"RMSGroupNorm: dim {dim} is not divisible by groups {groups}")
        self.dim, self.groups, self.eps, self.channels_last = dim, groups, eps, channels_last
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        """Normalise ``x`` (``(..., S, C)`` or ``(N, C, *spatial)``); same shape out."""
        g, cg = self.groups, self.dim // self.groups
        if self.channels_last:
            xg = x.unflatten(-1, (g, cg))  # (..., S, G, Cg)
            dims, count = (-3, -1), x.shape[-2] * cg
            w = self.weight.view(g, cg)  # (G, Cg)
        else:
            xg = x.reshape(x.shape[0], g, cg, -1)  # (N, G, Cg, S)
            dims, count = (2, 3), xg.shape[2] * xg.shape[3]
            w = self.weight.view(g, cg, 1)  # (G, Cg, 1)
        if torch.is_grad_enabled() and _one_dtype(x, w):
            return _RMSScale.apply(xg, w, dims, 1 / count, self.eps).view(x.shape)
        sq = torch.linalg.vector_norm(xg, dim=dims, keepdim=True, dtype=_stat_dtype(x)).square()
        inv = torch.rsqrt(sq / count + self.eps).to(x.dtype)  # statistic, broadcastable
        return (xg * (inv * w)).view(x.shape)


def rms_group_normalize(
    x: Tensor, groups: int, eps: float, dtype: torch.dtype, weight: Tensor | None = None
) -> Tensor:
    """RMS group normalisation of channels-last tokens, as a token matrix in ``dtype``.

    Same statistic as :class:`RMSGroupNorm` (fp32 mean square over the tokens and the group's
    channels, per leading index). One pass over ``x`` for the statistic and one that writes
    the result in ``dtype``; the weight is folded into the small per-group scale (or left to
    the caller to fold into the next linear when ``None``).

    Args:
        x: ``(..., S, C)``.
        groups: channel groups (divides C).
        eps: added to the mean square.
        dtype: output dtype.
        weight: ``(C,)`` norm weight, or None.

    Returns:
        ``(prod(...) * S, C)`` contiguous.
    """
    s, c = x.shape[-2], x.shape[-1]
    xg = x.reshape(-1, s, groups, c // groups)  # (N, S, G, Cg)
    w = None if weight is None else weight.view(groups, -1)  # (G, Cg)
    if torch.is_grad_enabled() and x.dtype == dtype and _one_dtype(x, w):
        return _RMSScale.apply(xg, w, (1, 3), groups / (s * c), eps).view(-1, c)  # (N*S, C)
    sq = torch.linalg.vector_norm(xg, dim=(1, 3), keepdim=True, dtype=_stat_dtype(x))  # (N,1,G,1)
    ms = sq.square() if torch.is_grad_enabled() else sq.square_()  # norm's backward needs sq
    inv = ms.mul_(groups / (s * c)).add_(eps).rsqrt_()  # (N, 1, G, 1) fp32
    if weight is not None:
        inv = inv * weight.view(groups, -1)  # (N, 1, G, Cg)
    if x.dtype == dtype:
        return torch.mul(xg, inv.to(dtype)).view(-1, c)  # (N*S, C)
    if torch.is_grad_enabled():
        return torch.mul(xg, inv).to(dtype).view(-1, c)
    return torch.mul(xg, inv, out=xg.new_empty(xg.shape, dtype=dtype)).view(-1, c)  # cast fused


def layer_norm_in_dtype(x: Tensor, norm: nn.LayerNorm) -> Tensor:
    """``norm(x)`` with the affine cast to ``x``'s dtype.

    For regions where autocast is off and ``x`` is in the compute dtype: CUDA's kernel refuses
    a bf16 input with float32 weights (the CPU one accepts it).
    """
    w, b = norm.weight, norm.bias
    if w is not None and w.dtype != x.dtype:
        w, b = w.to(x.dtype), None if b is None else b.to(x.dtype)
    return F.layer_norm(x, norm.normalized_shape, w, b, norm.eps)
