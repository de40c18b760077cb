"""Attention behind one call, with swappable kernels.

``attention(q, k, v, bias=None, causal=False, kernel="sdpa", scale=None, **opts)`` with q, k, v
``(..., L, E)``. Kernels (names in :data:`KERNEL_NAMES`):

- ``"sdpa"``: torch's ``F.scaled_dot_product_attention``. Inputs are reshaped to 4-D
  ``(B, H, L, E)`` first, since on CPU the fused flash kernel only takes 4-D input.
- ``"chunked"``: exact memory-efficient attention (Rabe & Staats) with score blocks sized by a
  byte budget and its own backward; the kernel lives in :mod:`walrus.nn.chunked_attention`.
  With gradients on sequences short enough to hold whole, the fp32 composite of ``"math"``
  runs instead (autograd's fused softmax backward is faster there).
- ``"math"``: the plain reference.

Causal masks are bottom-right aligned: query i sees key j iff ``j <= i + (Lk - Lq)``.

Notation: Lq / Lk query / key lengths, E head dim, Ev value dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from walrus.nn.chunked_attention import ChunkedAttention, chunked_no_grad, make_plan

KERNEL_NAMES: tuple[str, ...] = ("sdpa", "chunked", "math")
KERNEL_OPTIONS: dict[str, tuple[str, ...]] = {
    "sdpa": (),
    "chunked": ("chunk_bytes", "q_chunk", "kv_chunk"),
    "math": (),
}


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bias: Tensor | None = None,
    causal: bool = False,
    kernel: str = "sdpa",
    scale: float | None = None,
    **opts: int,
) -> Tensor:
    """Softmax attention ``softmax(q k^T * scale + bias [+ causal mask]) v``.

    Args:
        q: ``(..., Lq, E)``.
        k: ``(..., Lk, E)``, same leading dims and dtype as ``q``.
        v: ``(..., Lk, Ev)``.
        bias: additive float bias, broadcastable to ``(..., Lq, Lk)`` without adding dims.
        causal: query i sees keys j <= i + (Lk - Lq) (bottom-right aligned); needs Lq <= Lk.
        kernel: one of :data:`KERNEL_NAMES`.
        scale: score scale, defaults to ``1/sqrt(E)``.
        **opts: kernel options (:data:`KERNEL_OPTIONS`). ``chunked`` takes ``chunk_bytes``
            (score-block budget in bytes; default 8 MiB on CPU, 256 MiB elsewhere) and explicit
            ``q_chunk`` / ``kv_chunk`` sizes that override the budget. Options of another kernel
            are accepted and ignored so configs can swap kernels; unknown names raise.

    Returns:
        ``(..., Lq, Ev)`` in the dtype of ``q``.

    Raises:
        ValueError: unknown kernel or option, or inconsistent shapes / dtypes.
    """
    _check(q, k, v, bias, causal, kernel, opts)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if kernel == "math":
        return _math(q, k, v, bias, causal, scale)
    if kernel == "sdpa":
        return _sdpa(q, k, v, bias, causal, scale)
    # The chunked kernel accumulates in fp32 itself; autocast would mix dtypes in its out= ops.
    with torch.autocast(q.device.type, enabled=False):
        return _chunked(q, k, v, bias, causal, scale, opts)


def _check(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, kernel: str, opts: dict
) -> None:
    """Raise a ValueError naming the first bad argument."""
    if kernel not in KERNEL_NAMES:
        raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {KERNEL_NAMES}")
    known = {o for names in KERNEL_OPTIONS.values() for o in names}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ValueError(f"unknown attention option(s) {unknown}; known: {sorted(known)}")
    for name, val in opts.items():
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"attention option {name}={val!r} must be a positive int or None")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() < 2:
            raise ValueError(f"attention {name} must be a tensor (..., L, E), got {_desc(t)}")
        if not t.is_floating_point():
            raise ValueError(f"attention {name} must be floating point, got {t.dtype}")
        if t.shape[-2] < 1:
            raise ValueError(f"attention {name} has an empty sequence axis: {tuple(t.shape)}")
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            f"attention q, k, v leading dims differ: {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"attention k and v lengths differ: {k.shape[-2]} vs {v.shape[-2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    lq, lk = q.shape[-2], k.shape[-2]
    if causal and lq > lk:
        raise ValueError(
            f"causal attention needs Lq <= Lk (bottom-right aligned), got Lq={lq}, Lk={lk}: "
            "the first queries would see no key"
        )
    if bias is not None:
        if not isinstance(bias, Tensor) or not bias.is_floating_point():
            raise ValueError(f"attention bias must be a float tensor, got {_desc(bias)}")
        target = (*q.shape[:-2], lq, lk)
        ok = bias.dim() <= len(target) and all(
            b in (1, t) for b, t in zip(reversed(bias.shape), reversed(target))
        )
        if not ok:
            raise ValueError(
                f"attention bias {tuple(bias.shape)} does not broadcast to (..., Lq, Lk) = {target}"
            )


def _desc(x: object) -> str:
    return f"shape {tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__


def _causal_keep(lq: int, lk: int, device: torch.device) -> Tensor:
    """Bool ``(Lq, Lk)``, True where query i may see key j (j <= i + Lk - Lq)."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)


def _math(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, scale: float
) -> Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (..., Lq, Lk)
    if bias is not None:
        s = s + bias.to(s.dtype)
    if causal:
        s = s.masked_fill(~_causal_keep(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return torch.matmul(s.softmax(dim=-1), v)  # (..., Lq, Ev)


def _to_4d(x: Tensor, lead: tuple[int, ...]) -> Tensor:
    """``(*lead, a, b)`` -> ``(B, H, a, b)``; leading dims beyond two are folded into B.

    ``x`` may have size-1 leading dims where ``lead`` has more (a broadcast mask); those stay
    broadcast unless a folded dim is not 1, in which case the folded dims are expanded.
    """
    if len(lead) <= 2:
        return x.reshape((1,) * (2 - len(lead)) + tuple(x.shape))
    outer = x.shape[: len(lead) - 1]
    if all(d == 1 for d in outer):
        return x.reshape(1, *x.shape[-3:])
    return x.expand(*lead[:-1], *x.shape[-3:]).reshape(-1, *x.shape[-3:])


def _sdpa(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, scale: float
) -> Tensor:
    lead = tuple(q.shape[:-2])
    lq, lk = q.shape[-2], k.shape[-2]
    mask = None
    if bias is not None:
        mask = bias.to(q.dtype)
    is_causal = causal and mask is None and lq == lk  # torch's is_causal is top-left aligned
    if causal and not is_causal:
        keep = _causal_keep(lq, lk, q.device)  # (Lq, Lk)
        mask = keep if mask is None else mask.masked_fill(~keep, float("-inf"))
    if mask is not None:
        mask = _to_4d(mask.reshape((1,) * (q.dim() - mask.dim()) + tuple(mask.shape)), lead)
    out = F.scaled_dot_product_attention(
        _to_4d(q, lead),
        _to_4d(k, lead),
        _to_4d(v, lead),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
    )  # (B, H, Lq, Ev)
    return out.reshape(*lead, lq, v.shape[-1])


# Below this key length the custom single-pass backward beats autograd's (T=6: 15 vs 17 ms).
_COMPOSITE_MIN_LK = 8


def _chunked(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, scale: float, opts: dict
) -> Tensor:
    """The chunked kernel, or its fp32 composite when that is faster (see the module notes)."""
    plan = make_plan(q, k, bias, causal, scale, opts)
    tensors = (q, k, v) if bias is None else (q, k, v, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        # Keep the probabilities for backward only when blocks hold whole sequences and they
        # are no larger than the budget or than q itself (short sequences, Lk <= E).
        whole = plan.cq == plan.lq and plan.ck == plan.lk
        small = plan.lk <= q.shape[-1] or plan.nb == plan.n
        if whole and small and plan.lk > _COMPOSITE_MIN_LK:
            # Probabilities are kept either way; autograd's fused softmax backward is faster
            # here (CPU, 6,144 causal sequences: fwd+bwd 30 vs 47 ms at T=16, 112 vs 121 at 32).
            acc = torch.promote_types(q.dtype, torch.float32)  # fp32 or wider
            qa, ka, va = (t.to(acc) for t in (q, k, v))
            ba = None if bias is None else bias.to(acc)
            return _math(qa, ka, va, ba, plan.causal, scale).to(q.dtype)
        return ChunkedAttention.apply(q, k, v, bias, plan, whole and small)
    return chunked_no_grad(plan, q, k, v, bias)  # (..., Lq, Ev)
