"""Chunked attention: exact, memory-efficient (Rabe & Staats), with its own backward.

Works on a ``(N, L, E)`` layout (N = product of the leading dims) with ``baddbmm``/``bmm``, a
running max and log-sum-exp. Score blocks are sized by a byte budget (:func:`make_plan`). Short
sequences (whole score matrix within the budget) take one ``baddbmm`` -> softmax -> ``bmm``
pass, in batch chunks if needed. The backward pass (:class:`ChunkedAttention`) recomputes scores
per block from the saved log-sum-exp, except for short sequences, whose probabilities are kept
(no larger than the budget or than q). Everything accumulates in fp32 or wider.

Callers go through :func:`walrus.nn.attention.attention` (``kernel="chunked"``), which checks
the arguments and picks between this kernel and its fp32 composite for short sequences.

Notation: N batch (all leading dims flattened), Lq / Lk query / key lengths, E head dim,
Ev value dim, nb / cq / ck the batch / query / key sizes of one score block.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

DEFAULT_CHUNK_BYTES_CPU = 8 << 20  # CPU: blocks >= 32 MiB are freshly mapped and page-fault
DEFAULT_CHUNK_BYTES_ACCEL = 256 << 20
_MIN_BLOCK_ELEMS = 64 * 64  # below this per-sequence block the batch is chunked too


@dataclass(frozen=True)
class Plan:
    """Everything the chunked forward/backward needs besides the tensors."""

    n: int  # batch N (leading dims flattened)
    lq: int
    lk: int
    lead_tail: tuple[int, ...]  # leading dims after the first
    bias_shape: tuple[int, ...] | None  # bias shape padded to len(lead) + 2 dims
    bias_flat: bool  # bias has no leading dims other than 1: passed straight to baddbmm
    unit: int  # batch chunks are multiples of this so the bias broadcasts over a block view
    causal: bool
    scale: float
    nb: int  # block sizes
    cq: int
    ck: int

    @property
    def off(self) -> int:
        return self.lk - self.lq

    def kv_end(self, qe: int) -> int:
        """Keys at or beyond this index are masked for every query row before ``qe``."""
        return min(self.lk, qe + self.off) if self.causal else self.lk

    def blocks(self) -> Iterator[tuple[int, int, int, int, int, int, int]]:
        """Yield ``(n0, n1, qs, qe, ks, ke, n_kv_blocks)``, skipping fully masked blocks."""
        for n0 in range(0, self.n, self.nb):
            n1 = min(self.n, n0 + self.nb)
            for qs in range(0, self.lq, self.cq):
                qe = min(self.lq, qs + self.cq)
                end = self.kv_end(qe)
                starts = range(0, end, self.ck)
                for ks in starts:
                    yield n0, n1, qs, qe, ks, min(end, ks + self.ck), len(starts)

    def mask(
        self, qs: int, qe: int, ks: int, ke: int, device: torch.device, dtype: torch.dtype
    ) -> Tensor | None:
        """Additive ``(cq, ck)`` causal mask (0 or -inf); None when fully visible.

        Adding it inside ``baddbmm`` costs nothing extra, unlike a separate ``masked_fill_``.
        """
        if not self.causal or ke - 1 <= qs + self.off:
            return None
        rows = torch.arange(qs, qe, device=device).unsqueeze(1) + self.off  # (cq, 1)
        hidden = torch.arange(ks, ke, device=device) > rows  # (cq, ck)
        return torch.zeros(hidden.shape, device=device, dtype=dtype).masked_fill_(
            hidden, float("-inf")
        )

    def bias_index(self, n0: int, n1: int, qs: int, qe: int, ks: int, ke: int) -> tuple:
        """Index of one block in the padded bias (size-1 axes stay whole)."""
        shape = self.bias_shape
        qi = slice(qs, qe) if shape[-2] != 1 else slice(None)
        ki = slice(ks, ke) if shape[-1] != 1 else slice(None)
        if self.bias_flat:
            return (0,) * (len(shape) - 2) + (qi, ki)
        bi = slice(n0 // self.unit, n1 // self.unit) if shape[0] != 1 else slice(None)
        return (bi,) + (slice(None),) * (len(shape) - 3) + (qi, ki)


def make_plan(
    q: Tensor, k: Tensor, bias: Tensor | None, causal: bool, scale: float, opts: dict
) -> Plan:
    """Pick block sizes from the byte budget (fp32 score block ``nb * cq * ck * 4`` bytes).

    Order of preference: everything in one block; whole sequences in batch chunks; query/key
    chunks (about square, keys a power of two) over the whole batch, with the batch chunked
    too when the per-sequence block would drop below 64 x 64.
    """
    lead = tuple(q.shape[:-2])
    n, lq, lk = math.prod(lead), q.shape[-2], k.shape[-2]
    bias_shape, bias_flat, unit = None, True, 1
    if bias is not None:
        bias_shape = (1,) * (len(lead) + 2 - bias.dim()) + tuple(bias.shape)
        bias_flat = all(d == 1 for d in bias_shape[:-2])
        unit = 1 if bias_flat else math.prod(lead[1:])
    default = DEFAULT_CHUNK_BYTES_CPU if q.device.type == "cpu" else DEFAULT_CHUNK_BYTES_ACCEL
    budget = max(1, (opts.get("chunk_bytes") or default) // 4)  # fp32 elements per block
    q_chunk, kv_chunk = opts.get("q_chunk"), opts.get("kv_chunk")
    if q_chunk or kv_chunk:
        nb, cq, ck = n, min(lq, q_chunk or lq), min(lk, kv_chunk or lk)
    elif n * lq * lk <= budget:
        nb, cq, ck = n, lq, lk  # no chunking at all
    elif unit * lq * lk <= budget:
        nb, cq, ck = budget // (lq * lk) // unit * unit, lq, lk  # whole sequences, batch chunks
    else:
        nb = n
        if budget // n < _MIN_BLOCK_ELEMS and unit == 1:
            nb = max(1, budget // _MIN_BLOCK_ELEMS)
        per = max(1, budget // nb)  # elements per sequence and block
        ck = min(lk, 1 << (math.isqrt(per).bit_length() - 1))
        cq = min(lq, max(1, per // ck))
    return Plan(n, lq, lk, lead[1:], bias_shape, bias_flat, unit, causal, scale, nb, cq, ck)


def _scores(
    plan: Plan, qc: Tensor, kc: Tensor, bias: Tensor | None, idx: tuple, mask: Tensor | None
) -> Tensor:
    """``qc kc^T * scale + bias + mask``: ``(nb, cq, ck)`` (fp32 or wider), masked at -inf."""
    kt = kc.transpose(1, 2)  # (nb, E, ck)
    add = mask  # (cq, ck) or None
    if bias is not None and plan.bias_flat:
        b = bias[idx].to(qc.dtype)  # (cq|1, ck|1)
        add = b if add is None else b + add
    if add is None:
        s = torch.baddbmm(qc.new_zeros(1, 1, 1), qc, kt, beta=0.0, alpha=plan.scale)
    else:
        s = torch.baddbmm(add.unsqueeze(0), qc, kt, alpha=plan.scale)  # (nb, cq, ck)
    if bias is not None and not plan.bias_flat:
        s.view(-1, *plan.lead_tail, *s.shape[-2:]).add_(bias[idx])
    return s


def _softmax_(s: Tensor) -> None:
    """Softmax over the last axis in place.

    ATen's fused softmax is slow on rows that are short or not a multiple of the vector width
    (measured 5x slower at 6 keys on an AVX-512 CPU); plain in-place ops are used there.
    """
    if s.shape[-1] % 16 == 0:
        torch.ops.aten._softmax.out(s, -1, False, out=s)
    else:
        s.sub_(s.amax(-1, keepdim=True)).exp_()
        s.div_(s.sum(-1, keepdim=True))


def _softmax_lse_(s: Tensor) -> Tensor:
    """Softmax over the last axis in place; returns the log-sum-exp ``(nb, cq, 1)``."""
    m = s.amax(-1, keepdim=True)  # (nb, cq, 1)
    m = m.masked_fill(m == float("-inf"), 0.0)
    s.sub_(m).exp_()
    total = s.sum(-1, keepdim=True)  # (nb, cq, 1)
    s.div_(total)
    return m + total.log()


def _chunked_forward(
    plan: Plan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    need_lse: bool,
    keep_probs: bool,
) -> tuple[Tensor, Tensor | None, list[Tensor]]:
    """Forward on ``(N, L, E)`` fp32 tensors.

    Returns:
        out ``(N, Lq, Ev)``, lse ``(N, Lq, 1)`` or None, and the probability blocks when
        ``keep_probs`` (only for plans whose blocks hold whole sequences).
    """
    out = q.new_empty(plan.n, plan.lq, v.shape[-1])  # (N, Lq, Ev)
    lse = q.new_empty(plan.n, plan.lq, 1) if need_lse else None
    probs: list[Tensor] = []
    acc = m = total = None
    for n0, n1, qs, qe, ks, ke, n_kv in plan.blocks():
        qc, kc, vc = q[n0:n1, qs:qe], k[n0:n1, ks:ke], v[n0:n1, ks:ke]  # (nb, cq|ck, E|Ev)
        idx = plan.bias_index(n0, n1, qs, qe, ks, ke) if bias is not None else ()
        s = _scores(
            plan, qc, kc, bias, idx, plan.mask(qs, qe, ks, ke, q.device, q.dtype)
        )  # (nb, cq, ck)
        if n_kv == 1:
            if need_lse:
                lse[n0:n1, qs:qe] = _softmax_lse_(s)
            else:
                _softmax_(s)
            dst = out[n0:n1, qs:qe]  # (nb, cq, Ev)
            if dst.is_contiguous():
                torch.bmm(s, vc, out=dst)
            else:
                dst.copy_(torch.bmm(s, vc))
            if keep_probs:
                probs.append(s)
        else:
            m_blk = s.amax(-1, keepdim=True)  # (nb, cq, 1)
            m_new = m_blk if ks == 0 else torch.maximum(m, m_blk)
            m_use = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows that saw nothing yet
            s.sub_(m_use).exp_()
            if ks == 0:
                acc, total = torch.bmm(s, vc), s.sum(-1, keepdim=True)  # (nb, cq, Ev), (nb, cq, 1)
            else:
                alpha = (m - m_use).exp_()  # (nb, cq, 1)
                total.mul_(alpha).add_(s.sum(-1, keepdim=True))
                acc.mul_(alpha).baddbmm_(s, vc)
            m = m_use
            if ke == plan.kv_end(qe):
                out[n0:n1, qs:qe] = acc.div_(total)
                if need_lse:
                    lse[n0:n1, qs:qe] = m + total.log()
        del s  # free the block before the next one is allocated
    return out, lse, probs


def _chunked_backward(
    plan: Plan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    out: Tensor,
    dout: Tensor,
    lse: Tensor | None,
    probs: list[Tensor],
    need_dbias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients on ``(N, L, E)`` fp32 tensors, recomputing each score block from ``lse``
    unless the probability blocks were kept. Returns dq, dk, dv and dbias (padded shape).

    With ``P = softmax(S)``: ``dV = P^T dO``, ``dP = dO V^T``,
    ``dS = P * (dP - rowsum(P * dP))`` with ``rowsum(P * dP) = rowsum(dO * O)``,
    ``dQ = scale dS K``, ``dK = scale dS^T Q``, ``dbias = dS`` summed over broadcast axes.
    Gradient slices are written (``beta=0``) on their first visit instead of zero-filled.
    """
    fresh_kv = plan.cq >= plan.lq  # one query chunk: every key block is visited exactly once
    dq = torch.empty_like(q)
    dk, dv = (torch.empty_like(t) if fresh_kv else torch.zeros_like(t) for t in (k, v))
    dbias = q.new_zeros(plan.bias_shape) if need_dbias else None
    delta = None
    for i, (n0, n1, qs, qe, ks, ke, n_kv) in enumerate(plan.blocks()):
        qc, kc, vc = q[n0:n1, qs:qe], k[n0:n1, ks:ke], v[n0:n1, ks:ke]  # (nb, cq|ck, E|Ev)
        doc = dout[n0:n1, qs:qe]  # (nb, cq, Ev)
        idx = plan.bias_index(n0, n1, qs, qe, ks, ke) if bias is not None else ()
        if probs:
            p = probs[i]  # (nb, cq, ck)
        else:
            p = _scores(plan, qc, kc, bias, idx, plan.mask(qs, qe, ks, ke, q.device, q.dtype))
            p.sub_(lse[n0:n1, qs:qe]).exp_()
        beta_kv = 0.0 if fresh_kv else 1.0
        dv[n0:n1, ks:ke].baddbmm_(p.transpose(1, 2), doc, beta=beta_kv)
        ds = torch.bmm(doc, vc.transpose(1, 2))  # dP (nb, cq, ck)
        if n_kv == 1:  # whole rows in the block: rowsum(P * dP) is cheaper than rowsum(dO * O)
            ds.mul_(p)
            ds.addcmul_(p, ds.sum(-1, keepdim=True), value=-1.0)
        else:
            if ks == 0:
                delta = (doc * out[n0:n1, qs:qe]).sum(-1, keepdim=True)  # (nb, cq, 1)
            ds.sub_(delta).mul_(p)
        dq[n0:n1, qs:qe].baddbmm_(ds, kc, beta=0.0 if ks == 0 else 1.0, alpha=plan.scale)
        dk[n0:n1, ks:ke].baddbmm_(ds.transpose(1, 2), qc, beta=beta_kv, alpha=plan.scale)
        if dbias is not None:
            dbias[idx] += _reduce_to_bias(plan, ds)
        del p, ds  # free the blocks before the next ones are allocated
    return dq, dk, dv, dbias


def _reduce_to_bias(plan: Plan, ds: Tensor) -> Tensor:
    """Sum a score-gradient block ``(nb, cq, ck)`` over the axes the bias broadcasts along."""
    shape = plan.bias_shape
    if plan.bias_flat:
        g = ds.sum(0)  # (cq, ck)
        dims = [i for i in (0, 1) if shape[i - 2] == 1]
    else:
        g = ds.view(-1, *plan.lead_tail, *ds.shape[-2:])  # (nb/unit, *lead_tail, cq, ck)
        dims = [i for i, d in enumerate(shape) if d == 1]
    return g.sum(dims, keepdim=True) if dims else g


class ChunkedAttention(torch.autograd.Function):
    """Chunked attention whose backward recomputes score blocks (O(block) memory)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, plan: Plan, keep_probs: bool):
        qf, kf, vf = (_flat(t, plan.n) for t in (q, k, v))
        bf = None if bias is None else bias.reshape(plan.bias_shape)
        out, lse, probs = _chunked_forward(plan, qf, kf, vf, bf, not keep_probs, keep_probs)
        out = out.to(q.dtype).reshape(*q.shape[:-1], v.shape[-1])
        ctx.plan, ctx.probs, ctx.has_bias = plan, probs, bias is not None
        ctx.meta = [(t.shape, t.dtype) for t in (q, k, v)]
        # keep the flat copies (not the inputs) when no cast was made: backward needs no new one
        saved = [f if f.dtype == t.dtype else t for f, t in ((qf, q), (kf, k), (vf, v))]
        ctx.save_for_backward(*saved, bias, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, bias, out, lse = ctx.saved_tensors
        plan = ctx.plan
        qf, kf, vf, of, gf = (_flat(t, plan.n) for t in (q, k, v, out, grad_out))
        bf = None if bias is None else bias.reshape(plan.bias_shape)
        need_dbias = ctx.has_bias and ctx.needs_input_grad[3]
        dq, dk, dv, db = _chunked_backward(plan, qf, kf, vf, bf, of, gf, lse, ctx.probs, need_dbias)
        dq, dk, dv = (g.to(dt).reshape(sh) for g, (sh, dt) in zip((dq, dk, dv), ctx.meta))
        db = None if db is None else db.to(bias.dtype).reshape(bias.shape)
        return dq, dk, dv, db, None, None


def _flat(t: Tensor, n: int) -> Tensor:
    """``(..., L, E)`` -> ``(N, L, E)`` in fp32 or wider (a view when no cast or copy is needed)."""
    return t.reshape(n, *t.shape[-2:]).to(torch.promote_types(t.dtype, torch.float32))


def chunked_no_grad(plan: Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """Chunked attention without autograd: q ``(..., Lq, E)``, k / v ``(..., Lk, E|Ev)`` ->
    ``(..., Lq, Ev)`` in the dtype of ``q``."""
    qf, kf, vf = (_flat(t, plan.n) for t in (q, k, v))
    bf = None if bias is None else bias.reshape(plan.bias_shape)
    out, _, _ = _chunked_forward(plan, qf, kf, vf, bf, need_lse=False, keep_probs=False)
    return out.to(q.dtype).reshape(*q.shape[:-1], v.shape[-1])  # (..., Lq, Ev)
