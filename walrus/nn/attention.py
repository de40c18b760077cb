"""Attention behind one call, with swappable kernels.

``attention(q, k, v, bias=None, causal=False, kernel="sdpa")`` with q, k, v
``(..., L, head_dim)``. Kernels: ``sdpa`` (torch's fused kernel), ``math`` (plain
reference). (The ``chunked`` kernel is being added.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _math(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, scale: float) -> Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (..., Lq, Lk)
    if bias is not None:
        s = s + bias
    if causal:
        lq, lk = q.shape[-2], k.shape[-2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(s.softmax(dim=-1), v)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, scale: float) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal, scale=scale)


KERNELS = {"math": _math, "sdpa": _sdpa}


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bias: Tensor | None = None,
    causal: bool = False,
    kernel: str = "sdpa",
    scale: float | None = None,
) -> Tensor:
    """Softmax attention ``softmax(q k^T * scale + bias [+ causal mask]) v``.

    Args:
        q: ``(..., Lq, E)``; k: ``(..., Lk, E)``; v: ``(..., Lk, Ev)``.
        bias: additive, broadcastable to ``(..., Lq, Lk)``.
        causal: query i sees keys j <= i (aligned to the end when Lq != Lk).
        kernel: ``"sdpa"``, ``"chunked"`` or ``"math"``.
        scale: defaults to ``1/sqrt(E)``.

    Returns:
        ``(..., Lq, Ev)``.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {sorted(KERNELS)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return KERNELS[kernel](q, k, v, bias, causal, scale)
