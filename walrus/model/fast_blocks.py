"""Fast paths of the processor blocks: same maths as :mod:`walrus.model.blocks`, fewer passes.

:func:`run_processor` is the one place that picks, for the whole stack of blocks, between

- the reference forward (``blk(x, rope)``, :mod:`walrus.model.blocks`),
- the fused forward (:func:`temporal_fused`, :func:`spatial_fused`): norm weights and layer
  scales folded into the projections, the residual added inside the output GEMM; it records
  gradients and is the training path,
- the inference forward (:func:`temporal_inference`, :func:`spatial_inference`): no autograd,
  every intermediate written into one :class:`InferenceWorkspace` and the token stream updated
  in place block after block.

Derived weights (cast, folded, transposed) are cached per module while no gradient is recorded
(:class:`DerivedCache`). ``tests/test_perf.py`` checks all three paths agree in float64.

Notation: B batch, T frames, S spatial tokens, C channels, nh heads, E head_dim, M mlp_dim.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakTensorKeyDictionary

from walrus.model.blocks import ProcessorBlock, SpatialAttention, TemporalAttention
from walrus.nn.attention import attention
from walrus.nn.norms import rms_group_normalize

Rope = tuple[Tensor, Tensor]


def run_processor(
    blocks: Sequence[ProcessorBlock], x: Tensor, ropes: Sequence[Rope], *, fused: bool
) -> Tensor:
    """Run the processor blocks on the token stream, choosing the path.

    ``fused=False`` runs the reference forward of every block. Otherwise a module whose drop
    path is active (training with a rate > 0) runs its reference forward and every other one
    its fused forward; without autograd and with no drop path active anywhere, the whole stack
    runs in place in one :class:`InferenceWorkspace` (``x`` is overwritten), except inside a
    ``torch.compile`` region, which takes the out-of-place fused path (inductor plans buffers).

    Args:
        blocks: the processor blocks.
        x: ``(B, T, S, C)`` contiguous token stream.
        ropes: per block, the ``(cos, sin)`` RoPE tables, each ``(S, 1, E)``.
        fused: use the fast paths.

    Returns:
        ``(B, T, S, C)``.
    """
    modules = [m for blk in blocks for m in (blk.time_mixing, blk.space_mixing)]
    in_place = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
    if fused and blocks and in_place and all(map(_fast, modules)):
        sm = blocks[0].space_mixing
        ws = InferenceWorkspace(x, sm.heads, sm.mlp_dim, compute_dtype(x))
        for blk, rope in zip(blocks, ropes):
            temporal_inference(blk.time_mixing, ws)
            spatial_inference(blk.space_mixing, ws, rope)
        return ws.stream  # x, updated in place
    impl = _fused_block if fused else None  # through the block: checkpointing, compile apply
    for blk, rope in zip(blocks, ropes):
        x = blk(x, rope, impl)  # (B, T, S, C)
    return x


def _fast(m: TemporalAttention | SpatialAttention) -> bool:
    """Whether ``m`` may take a fast path (they have no drop path)."""
    return not (m.training and m.drop_path > 0.0)


def _fused_block(blk: ProcessorBlock, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """One block, each module fused unless its drop path is active."""
    tm, sm = blk.time_mixing, blk.space_mixing
    x = temporal_fused(tm, x) if _fast(tm) else tm(x)
    if not _fast(sm):
        return sm(x, (cos, sin))
    # the temporal output is a fresh tensor: the spatial residual may be added into it
    return spatial_fused(sm, x, (cos, sin), reuse_input=True)


def _layer_norm(x: Tensor, norm: nn.LayerNorm) -> Tensor:
    """``norm(x)`` over the last dim with its affine in ``x``'s dtype (outside autocast, CUDA's
    kernel refuses a bf16 input with float32 weights; the CPU one would accept it)."""
    if norm.weight is None:
        return F.layer_norm(x, norm.normalized_shape, eps=norm.eps)
    params = _present(norm.weight, norm.bias)
    key = ("affine", x.dtype, x.device)
    w, *b = _derived(norm).get(key, params, lambda: tuple(p.to(x.dtype) for p in params))
    return F.layer_norm(x, norm.normalized_shape, w, b[0] if b else None, norm.eps)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype projections run in: the autocast dtype when autocast is on, else ``x.dtype``."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _layer_scaled(t: Tensor, gamma: Tensor | None) -> Tensor:
    """``t`` scaled per output channel (its first axis) by the layer scale; ``t`` without one."""
    return t if gamma is None else t * gamma.view(-1, *(1,) * (t.ndim - 1))


def _present(*params: Tensor | None) -> list[Tensor]:
    """The given parameters without the absent (``None``) ones."""
    return [p for p in params if p is not None]


def _residual_gemms(
    x: Tensor, terms: list[tuple[Tensor, Tensor]], bias: Tensor, reuse_x: bool = False
) -> Tensor:
    """``x + sum(a @ w for a, w in terms) + bias`` in ``x``'s dtype.

    When ``x`` is in the compute dtype the GEMMs accumulate straight into a buffer that starts
    as the residual (``addmm`` then ``addmm_``): no separate add pass.

    Args:
        x: residual ``(N, C)``.
        terms: ``(a (N, K), w (K, C))`` pairs in the compute dtype.
        bias: ``(C,)`` in the compute dtype.
        reuse_x: ``x`` may be overwritten (only honoured when no gradient is recorded).
    """
    (a0, w0), rest = terms[0], terms[1:]
    same = x.dtype == a0.dtype
    out = torch.addmm(x if same else bias, a0, w0)  # (N, C)
    for a, w in rest:
        out = out.addmm_(a, w)
    if same:
        return out.add_(bias)
    return x.add_(out) if reuse_x and not torch.is_grad_enabled() else torch.add(x, out)


class DerivedCache:
    """Inference cache of tensors derived from parameters (cast, folded, transposed weights).

    Entries are rebuilt when a parameter changes (its version counter), the dtype or the
    device changes. Nothing is cached while gradients are recorded for a parameter, nor while
    ``torch.compile`` traces (the weights are then graph inputs). Inference
    tensors (made under ``torch.inference_mode``) have no version counter: they are keyed by
    identity only.
    """

    def __init__(self) -> None:
        self._store: dict[tuple, tuple[tuple, tuple, tuple[Tensor, ...]]] = {}

    def get(
        self, key: tuple, params: list[Tensor], build: Callable[[], tuple[Tensor, ...]]
    ) -> tuple[Tensor, ...]:
        """Return ``build()`` (a tuple of tensors), cached while ``params`` are unchanged."""
        if torch.compiler.is_compiling() or (
            torch.is_grad_enabled() and any(p.requires_grad for p in params)
        ):
            return build()
        versions = tuple(0 if p.is_inference() else p._version for p in params)
        hit = self._store.get(key)
        if hit is None or hit[1] != versions or any(a is not b for a, b in zip(hit[0], params)):
            with torch.no_grad():
                hit = (tuple(params), versions, build())
            self._store[key] = hit
        return hit[2]


# one cache per module, dropped with the module (a deep copy starts empty)
_CACHES: weakref.WeakKeyDictionary[nn.Module, DerivedCache] = weakref.WeakKeyDictionary()


def clear_derived(model: nn.Module) -> None:
    """Drop the inference caches of ``model``'s modules. Call it when weights may have changed
    without their version counters moving: fused optimisers (``torch.optim.AdamW(fused=True)``)
    update parameters in place without bumping them, so a cache would serve old weights."""
    for m in model.modules():
        _CACHES.pop(m, None)


# what a compiled region gets: it builds every time (``DerivedCache.get``) and, unlike a
# module's own cache, registering it mutates no global, which would cost a recompile per module
_UNCACHED = DerivedCache()


def _derived(m: nn.Module) -> DerivedCache:
    """The derived-tensor cache of module ``m`` (inside ``torch.compile``, one that builds)."""
    if torch.compiler.is_compiling():
        return _UNCACHED
    cache = _CACHES.get(m)
    if cache is None:
        cache = _CACHES[m] = DerivedCache()
    return cache


def _tokens(o: Tensor, n_tok: int, c: int) -> Tensor:
    """Attention output ``(N, H, L, E)`` as the token matrix ``(n_tok, C)``, rows ``(N, L)``.

    The CPU and CUDA flash kernels write their output token-major (``(N, L, H, E)`` in memory),
    so this is one view; any other layout is copied.
    """
    _, h, seq, e = o.shape
    if o.stride() == (seq * h * e, e, h * e, 1):
        return o.as_strided((n_tok, c), (c, 1))  # (n_tok, C)
    return o.transpose(1, 2).reshape(n_tok, c)


def _tokens_seq_major(o: Tensor, n_tok: int, c: int) -> Tensor:
    """Attention output ``(N, H, L, E)`` as the token matrix ``(n_tok, C)``, rows ``(L, N)``.

    The CPU flash kernel lays its output out like the query; with a sequence-major query
    (``(L, N, H, E)`` in memory) this is one view; any other layout is copied.
    """
    n, h, seq, e = o.shape
    if o.stride() == (h * e, e, n * h * e, 1):
        return o.as_strided((n_tok, c), (c, 1))  # (n_tok, C)
    return o.permute(2, 0, 1, 3).reshape(n_tok, c)


# RoPE as a matrix per position, per table tensor: shared by the blocks using the same tables
_ROPE_MATS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def rope_matrices(rope: Rope, dtype: torch.dtype) -> Tensor:
    """The rotation of :func:`walrus.nn.rope.apply_rope` as one matrix per position.

    ``apply_rope(y, cos, sin)[s] == y[s] @ R[s]``: ``R[s]`` holds ``cos[s]`` on the diagonal
    and ``sin[s]`` at ``(swap(e), e)`` (interleaved pairs). Cached per ``cos`` tensor and
    dtype, outside ``torch.compile`` regions.

    Args:
        rope: ``(cos, sin)`` each ``(S, 1, E)``.
        dtype: dtype of the matrices.

    Returns:
        ``R`` ``(S, E, E)``.
    """
    cos, sin = rope
    cache = None if torch.compiler.is_compiling() else _ROPE_MATS.setdefault(cos, {})
    hit = None if cache is None else cache.get(dtype)
    if hit is not None and hit[0] is sin:
        return hit[1]
    s, _, e = cos.shape
    with torch.no_grad():
        idx = torch.arange(e, device=cos.device)
        swap = idx.view(-1, 2).flip(-1).flatten()
        mat = cos.new_zeros(s, e, e)  # (S, E, E)
        mat[:, idx, idx] = cos[:, 0]
        mat[:, swap, idx] = sin[:, 0]
        mat = mat.to(dtype)
    if cache is not None:
        cache[dtype] = (sin, mat)
    return mat


class InferenceWorkspace:
    """Buffers and views shared by every processor block of one inference forward.

    Without autograd the token stream is updated in place block after block and every
    intermediate is written into a buffer allocated here once per forward, so all the views
    the blocks need are built once and a block issues only its compute ops.

    Two token orders share the buffers: the temporal module works token-major (rows
    ``(B*T, S)``, as the stream), the spatial module sequence-major (rows ``(S, B*T)``): then
    the q and k of every spatial position are one ``(B*T*nh, E)`` matrix, so RoPE is one
    batched GEMM over positions. The temporal q/k/v buffers share storage with the spatial
    projections (they are dead by then).

    Args:
        x: ``(B, T, S, C)`` contiguous token stream; it is overwritten with the result.
        heads: attention heads nh.
        mlp_dim: feed-forward width M before the SwiGLU gate.
        dtype: compute dtype of the projections (the autocast dtype, or ``x.dtype``).
    """

    def __init__(self, x: Tensor, heads: int, mlp_dim: int, dtype: torch.dtype):
        if not x.is_contiguous():
            raise ValueError(
                f"InferenceWorkspace: the token stream {tuple(x.shape)} must be contiguous"
            )
        b, t, s, c = x.shape
        nh, e, m = heads, c // heads, mlp_dim
        n_tok, bt, w = b * t * s, b * t, m + c
        self.shape, self.heads, self.mlp_dim, self.dtype = (b, t, s, c), heads, mlp_dim, dtype
        self.stream = x
        self.x = x.view(n_tok, c)  # (B*T*S, C) the residual stream, token-major
        self.x_frames = x.view(bt, s, c)  # (B*T, S, C)
        # (B*T, S, C) view of a sequence-major (S, B*T, C) token matrix
        self.seq_major = ((bt, s, c), (c, bt * c, 1))
        self.h = x.new_empty(n_tok, c, dtype=dtype)  # (B*T*S, C) normalised tokens
        self.o = x.new_empty(n_tok, c, dtype=dtype)  # (B*T*S, C) output projections
        self.o_seq = self.o.as_strided(*self.seq_major)  # (B*T, S, C) of the spatial o
        buf = x.new_empty(n_tok * (w + 2 * c), dtype=dtype)
        # spatial [ff | v] (sequence-major rows), then raw q and k
        self.f = buf[: n_tok * w].view(n_tok, w)  # (S*B*T, M + C)
        self.sq, self.sk = (
            buf.as_strided((s, bt * nh, e), (bt * c, e, 1), n_tok * (w + i * c)) for i in range(2)
        )  # (S, B*T*nh, E) each
        self.sq_mat = buf.as_strided((n_tok, c), (c, 1), n_tok * w)  # (S*B*T, C)
        self.sk_mat = buf.as_strided((n_tok, c), (c, 1), n_tok * (w + c))
        # temporal q, k, v: contiguous (B*T*S, C) blocks at the start of buf
        self.tq, self.tk, self.tv = (
            buf.as_strided((n_tok, c), (c, 1), i * n_tok * c) for i in range(3)
        )
        self.tq_rows = buf.as_strided((n_tok * nh, e), (e, 1), 0)  # (B*T*S*nh, E)
        self.tk_rows = buf.as_strided((n_tok * nh, e), (e, 1), n_tok * c)
        self.t4 = ((b, s * nh, t, e), (t * s * c, e, s * c, 1))  # (B, S*nh, T, E) of a token buffer
        self.tv4 = buf.as_strided(*self.t4, 2 * n_tok * c)  # (B, S*nh, T, E)
        # spatial views: SwiGLU halves, v, rotated q and k
        self.ff_a, self.ff_g = self.f[:, : m // 2], self.f[:, m // 2 : m]  # (S*B*T, M/2) each
        self.sv4 = buf.as_strided((bt, nh, s, e), (w, e, bt * w, 1), m)  # (B*T, nh, S, E)
        rot = x.new_empty(2, s, bt * nh, e, dtype=dtype)  # RoPE(LN(q)), RoPE(LN(k))
        self.rot_q, self.rot_k = rot[0], rot[1]  # (S, B*T*nh, E) each
        self.sq4, self.sk4 = (
            r.as_strided((bt, nh, s, e), (c, e, bt * c, 1), r.storage_offset())
            for r in (self.rot_q, self.rot_k)
        )  # (B*T, nh, S, E)
        self._grouped: dict[tuple[int, bool], tuple[Tensor, Tensor]] = {}
        self._eps: dict[tuple[int, float], Tensor] = {}

    def normalize(self, groups: int, eps: float, seq_major: bool = False) -> Tensor:
        """RMS group normalisation of the stream into :attr:`h`, scaled by ``sqrt(k)``.

        Same statistic as :func:`walrus.nn.norms.rms_group_normalize` (mean square ``k *
        |x|^2`` over a frame's tokens and the group's channels, ``k = G / (S*C)``), written as
        ``x / hypot(|x|, sqrt(eps / k))``: that is ``sqrt(k)`` times the normalised tokens, so
        the projection that reads ``h`` carries ``1 / sqrt(k)`` (:meth:`norm_k`) and the
        norm weight. One pass over the stream for the statistic and one that divides and casts
        (``hypot`` acts on the small statistic).

        Args:
            groups: norm groups G.
            eps: added to the mean square.
            seq_major: write ``h`` sequence-major (rows ``(S, B*T)``, for the spatial module).

        Returns:
            ``h`` ``(B*T*S, C)`` in the compute dtype (rows in the chosen order).
        """
        b, t, s, c = self.shape
        key = (groups, seq_major)
        if key not in self._grouped:
            shape = (b * t, s, groups, c // groups)
            h = self.h.as_strided(*self.seq_major) if seq_major else self.h
            self._grouped[key] = (self.x.view(shape), h.view(shape))  # (N, S, G, Cg)
        xg, hg = self._grouped[key]
        stat = torch.promote_types(xg.dtype, torch.float32)
        if (groups, eps) not in self._eps:
            floor = math.sqrt(eps / self.norm_k(groups))
            self._eps[groups, eps] = torch.full((), floor, dtype=stat, device=xg.device)
        sq = torch.linalg.vector_norm(xg, dim=(1, 3), keepdim=True, dtype=stat)  # (N, 1, G, 1)
        torch.div(
            xg, torch.hypot(sq, self._eps[groups, eps]), out=hg
        )  # cast to the compute dtype fused
        return self.h

    def norm_k(self, groups: int) -> float:
        """``k = G / (S*C)``: the mean square is ``k`` times the group's squared norm."""
        _, _, s, c = self.shape
        return groups / (s * c)


# ---------------------------------------------------------------------------------------------
# temporal attention
# ---------------------------------------------------------------------------------------------


def _temporal_fused_params(
    m: TemporalAttention, cd: torch.dtype, t: int, s: int, device: torch.device
) -> tuple[Tensor, ...]:
    """Weights with the norm weight and layer scale folded in, in dtype ``cd``."""
    win, wout = m.input_head, m.output_head
    params = _present(m.norm1.weight, win.weight, win.bias, wout.weight, wout.bias)
    params += _present(m.gamma, m.rel_pos_bias.relative_attention_bias.weight)

    def build() -> tuple[Tensor, ...]:
        w_in = (win.weight * m.norm1.weight).to(cd).t()  # (C, 3C)
        w_out = _layer_scaled(wout.weight, m.gamma).to(cd).t()  # (C, C)
        b_out = _layer_scaled(wout.bias, m.gamma).to(cd)  # (C,)
        bias = m.rel_pos_bias(t, device).to(cd)  # (nh, T, T)
        bias = bias.expand(s, *bias.shape).reshape(-1, t, t)  # (S*nh, T, T)
        return w_in, win.bias.to(cd), w_out, b_out, bias

    return _derived(m).get((cd, t, s, device), params, build)


def temporal_fused(m: TemporalAttention, x: Tensor) -> Tensor:
    """``m(x)`` in fewer passes (no drop path).

    The norm weight is folded into the q/k/v weight and the layer scale into the output
    projection, which adds the residual in its GEMM (``addmm`` with ``x`` as input).

    Args:
        m: the temporal attention module.
        x: ``(B, T, S, C)``.

    Returns:
        ``(B, T, S, C)``.
    """
    b, t, s, c = x.shape
    nh, e = m.heads, m.head_dim
    cd = compute_dtype(x)
    w_in, b_in, w_out, b_out, bias = _temporal_fused_params(m, cd, t, s, x.device)
    with torch.autocast(x.device.type, enabled=False):
        h = rms_group_normalize(x, m.norm1.groups, m.norm1.eps, cd)  # (B*T*S, C)
        qkv = torch.addmm(b_in, h, w_in).view(b, t, s, 3, nh, e)  # (B, T, S, 3, nh, E)
        q, k, v = qkv.unbind(3)  # (B, T, S, nh, E) each; one backward op (no zero-filled grads)
        # sdpa takes strided operands (its output is then token-major); the batched-GEMM
        # kernels want each sequence contiguous, which LayerNorm writes from a permuted view
        seq = m.kernel != "sdpa"
        q, k = (x_.permute(0, 2, 3, 1, 4) if seq else x_ for x_ in (q, k))
        q = _layer_norm(q, m.qnorm)
        k = _layer_norm(k, m.knorm)
        if seq:  # (B, S, nh, T, E) contiguous
            q, k = q.view(b, s * nh, t, e), k.view(b, s * nh, t, e)  # (B, S*nh, T, E)
            v = v.permute(0, 2, 3, 1, 4).reshape(b, s * nh, t, e)  # one copy
        else:  # (B, T, S, nh, E) contiguous
            q = q.view(b, t, s * nh, e).transpose(1, 2)  # (B, S*nh, T, E)
            k = k.view(b, t, s * nh, e).transpose(1, 2)
            v = v.reshape(b, t, s * nh, e).transpose(1, 2)
        o = attention(q, k, v, bias=bias, causal=m.causal, kernel=m.kernel)
        o = o.transpose(1, 2).reshape(b * t * s, c)  # (B*T*S, C)
        out = _residual_gemms(x.view(b * t * s, c), [(o, w_out)], b_out)  # x + γ·proj(o)
    return out.view(b, t, s, c)


def _temporal_inference_params(
    m: TemporalAttention, cd: torch.dtype, t: int, s: int, k: float, device: torch.device
) -> tuple[Tensor, ...]:
    """Split q/k/v weights (norm weight and ``1/sqrt(k)`` folded in, see
    :meth:`InferenceWorkspace.normalize`), output weights and the attention mask, in ``cd``."""
    win, wout, c = m.input_head, m.output_head, m.input_head.in_features
    params = _present(m.norm1.weight, win.weight, win.bias, wout.weight, wout.bias)
    params += _present(m.gamma, m.rel_pos_bias.relative_attention_bias.weight)

    def build() -> tuple[Tensor, ...]:
        w_in = (win.weight * (m.norm1.weight / math.sqrt(k))).to(cd)  # (3C, C)
        b_in = win.bias.to(cd)  # (3C,)
        w_out = _layer_scaled(wout.weight, m.gamma).to(cd).t()  # (C, C)
        b_out = _layer_scaled(wout.bias, m.gamma).to(cd)  # (C,)
        bias = m.rel_pos_bias(t, device).to(cd)  # (nh, T, T)
        bias = bias.expand(s, *bias.shape).reshape(-1, t, t)  # (S*nh, T, T)
        mask = bias[None]  # (1, S*nh, T, T)
        if m.causal:
            keep = torch.ones(t, t, dtype=torch.bool, device=device).tril()
            mask = mask.masked_fill(~keep, float("-inf"))
        qkv = [(w_in[i * c : (i + 1) * c].t(), b_in[i * c : (i + 1) * c]) for i in range(3)]
        return (*[x for pair in qkv for x in pair], w_out, b_out, bias, mask)

    return _derived(m).get(("inference", cd, t, s, device), params, build)


def temporal_inference(m: TemporalAttention, ws: InferenceWorkspace) -> None:
    """``m``'s fused forward without autograd, in place on ``ws``'s token stream.

    q, k and v are three GEMMs into contiguous buffers (so q/k LayerNorm reads contiguous
    rows and every attention operand is a view); the causal mask is folded into the cached
    bias; the output projection lands in ``ws.o`` and is added to the stream.
    """
    b, t, s, c = ws.shape
    e = m.head_dim
    with torch.autocast(ws.x.device.type, enabled=False):
        w_q, b_q, w_k, b_k, w_v, b_v, w_out, b_out, bias, mask = _temporal_inference_params(
            m, ws.dtype, t, s, ws.norm_k(m.norm1.groups), ws.x.device
        )
        h = ws.normalize(m.norm1.groups, m.norm1.eps)  # (B*T*S, C), token-major
        torch.addmm(b_q, h, w_q, out=ws.tq)  # (B*T*S, C)
        torch.addmm(b_k, h, w_k, out=ws.tk)
        torch.addmm(b_v, h, w_v, out=ws.tv)
        qn, kn = m.qnorm, m.knorm
        q = _layer_norm(ws.tq_rows, qn).as_strided(*ws.t4)
        k = _layer_norm(ws.tk_rows, kn).as_strided(*ws.t4)
        if m.kernel == "sdpa":  # (B, S*nh, T, E)
            o = F.scaled_dot_product_attention(q, k, ws.tv4, attn_mask=mask, scale=e**-0.5)
        else:
            o = attention(q, k, ws.tv4, bias=bias, causal=m.causal, kernel=m.kernel)
        torch.addmm(b_out, _tokens(o, b * t * s, c), w_out, out=ws.o)  # γ·proj(o)
        ws.x.add_(ws.o)


# ---------------------------------------------------------------------------------------------
# spatial attention
# ---------------------------------------------------------------------------------------------


def _spatial_out_params(m: SpatialAttention, cd: torch.dtype) -> tuple[Tensor, ...]:
    """Output projections in dtype ``cd`` with the layer scale folded in: attention
    ``(C, C)``, feed-forward ``(M/2, C)`` and its bias ``(C,)``."""
    ff_out = m.ff_out[1]
    params = _present(ff_out.weight, ff_out.bias, m.attn_out.weight, m.gamma_att)

    def build() -> tuple[Tensor, ...]:
        g = m.gamma_att
        w_att = _layer_scaled(m.attn_out.weight, g).to(cd).t()  # (C, C)
        w_ff = _layer_scaled(ff_out.weight, g).to(cd).t()  # (M/2, C)
        b_ff = _layer_scaled(ff_out.bias, g).to(cd)  # (C,)
        return w_att, w_ff, b_ff

    return _derived(m).get(("out", cd), params, build)


def _spatial_rope_params(m: SpatialAttention, cd: torch.dtype, rope: Rope) -> tuple[Tensor, ...]:
    """RoPE after the q/k LayerNorm affine as one matrix and shift per (q|k, position).

    With ``n`` the normalised head and ``y = n * w + b``: ``rope(y) = y @ R = n @ (diag(w) R)
    + b @ R`` (:func:`rope_matrices`). Returns ``mats`` ``(2S, E, E)`` and ``shift``
    ``(2S, 1, E)`` in ``cd``, q rows first; they carry the LayerNorm parameters' gradients.
    """
    norms = (m.q_norm, m.k_norm)
    params = [p for n in norms for p in (n.weight, n.bias)]

    def build() -> tuple[Tensor, ...]:
        rot = rope_matrices(rope, torch.promote_types(cd, torch.float32))  # (S, E, E)
        w = torch.stack([n.weight for n in norms]).to(rot.dtype)  # (2, E)
        bias = torch.stack([n.bias for n in norms]).to(rot.dtype)  # (2, E)
        mats = (w[:, None, :, None] * rot).to(cd).flatten(0, 1)  # (2S, E, E)
        shift = torch.matmul(bias[:, None, None], rot).to(cd).flatten(0, 1)  # (2S, 1, E)
        return mats, shift

    key = ("rope", cd, rope[0].shape, rope[0].device)
    return _derived(m).get(key, params + list(rope), build)


def spatial_fused(
    m: SpatialAttention, x: Tensor, rope: Rope, *, reuse_input: bool = False
) -> Tensor:
    """``m(x, rope)`` in fewer passes (no drop path).

    The norm weight is folded into the per-group norm scale; q and k are normalised in one
    LayerNorm call written sequence-major, then rotated by one batched GEMM over (q|k,
    position) whose matrices carry the LayerNorm affine (:func:`_spatial_rope_params`);
    SwiGLU runs in place on the fused output when no gradient is recorded; the attention
    and feed-forward output projections accumulate into one buffer that starts as the
    residual (layer scale folded into their weights).

    Args:
        m: the spatial attention module.
        x: ``(B, T, S, C)``.
        rope: ``(cos, sin)`` each ``(S, 1, E)``.
        reuse_input: ``x`` may be overwritten with the result (no gradient recorded).

    Returns:
        ``(B, T, S, C)``.
    """
    b, t, s, c = x.shape
    nh, e, mlp = m.heads, m.head_dim, m.mlp_dim
    cd = compute_dtype(x)
    w_att, w_ff, b_ff = _spatial_out_params(m, cd)
    mats, shift = _spatial_rope_params(m, cd, rope)
    norm = m.norm1
    h = rms_group_normalize(x, norm.groups, norm.eps, cd, norm.weight)  # (B*T*S, C)
    f = m.fused_ff_qkv(h)  # (B*T*S, M + 3C): one GEMM on contiguous tokens
    with torch.autocast(x.device.type, enabled=False):
        # one split: its backward is one concatenation (slices would each zero-fill f's shape)
        a, g, qk, v = f.split([mlp // 2, mlp // 2, 2 * c, c], dim=1)  # (B*T*S, M/2 | 2C | C)
        qk = qk.view(b * t, s, 2, nh, e).permute(2, 1, 0, 3, 4)  # (2, S, B*T, nh, E) view
        n = F.layer_norm(qk, (e,), eps=m.q_norm.eps)  # (2, S, B*T, nh, E) contiguous
        qk = torch.baddbmm(shift, n.view(2 * s, b * t * nh, e), mats)  # RoPE(LN(q)), k
        q, k = qk.view(2, s, b * t, nh, e).permute(0, 2, 3, 1, 4).unbind(0)  # (B*T,nh,S,E)
        v = v.view(b * t, s, nh, e).transpose(1, 2)  # (B*T, nh, S, E)
        o = attention(q, k, v, kernel=m.kernel)  # (B*T, nh, S, E)
        o = o.transpose(1, 2).reshape(b * t * s, c)  # (B*T*S, C)
        if torch.is_grad_enabled():
            a = a * F.silu(g)
        else:
            a = a.mul_(F.silu(g, inplace=True))  # SwiGLU in place
        terms = [(o, w_att), (a, w_ff)]  # γ·attn_out(o) + γ·ff_out(swiglu)
        out = _residual_gemms(x.view(b * t * s, c), terms, b_ff, reuse_input)  # (B*T*S, C)
    return out.view(b, t, s, c)


def _spatial_inference_params(
    m: SpatialAttention, cd: torch.dtype, rope: Rope, k: float
) -> tuple[Tensor, ...]:
    """Projection weights for the workspace (norm weight and ``1/sqrt(k)`` folded in, see
    :meth:`InferenceWorkspace.normalize`): ``[ff | v]``, q and k, transposed, with biases;
    the output weights of :func:`_spatial_out_params` and the per-position RoPE matrices.
    """
    lin, c, mlp = m.fused_ff_qkv, m.fused_ff_qkv.in_features, m.mlp_dim
    params = [lin.weight, lin.bias, m.norm1.weight]

    def build() -> tuple[Tensor, ...]:
        w = (lin.weight * (m.norm1.weight / math.sqrt(k))).to(cd)  # (M + 3C, C)
        bias = lin.bias.to(cd)  # (M + 3C,)
        rows = [slice(0, mlp), slice(mlp + 2 * c, mlp + 3 * c)]  # ff, v
        w_fv = torch.cat([w[r] for r in rows]).t()  # (C, M + C)
        b_fv = torch.cat([bias[r] for r in rows])  # (M + C,)
        q, k_ = slice(mlp, mlp + c), slice(mlp + c, mlp + 2 * c)
        return w_fv, b_fv, w[q].t(), bias[q], w[k_].t(), bias[k_]

    cached = _derived(m).get(("inference", cd, k, rope[0].device), params, build)
    w_att, w_ff, b_ff = _spatial_out_params(m, cd)
    return (*cached, w_att, w_ff, b_ff, rope_matrices(rope, cd))


def spatial_inference(m: SpatialAttention, ws: InferenceWorkspace, rope: Rope) -> None:
    """``m``'s fused forward without autograd, in place on ``ws``'s token stream.

    Works sequence-major (rows ``(S, B*T)``): GEMMs into ``ws.f`` (``[ff | v]``) and the raw
    q and k buffers; q and k LayerNorm (affine in the kernel) read contiguous rows, and RoPE is
    one batched GEMM per operand over positions (:func:`rope_matrices`) into ``ws.rot``;
    SwiGLU in place; both output projections accumulate into ``ws.o``, which is added to the
    stream.

    Args:
        m: the spatial attention module.
        ws: the forward's workspace.
        rope: ``(cos, sin)`` each ``(S, 1, E)``.
    """
    b, t, s, c = ws.shape
    e = m.head_dim
    qn, kn = m.q_norm, m.k_norm
    with torch.autocast(ws.x.device.type, enabled=False):
        w_fv, b_fv, w_q, b_q, w_k, b_k, w_att, w_ff, b_ff, rot = _spatial_inference_params(
            m, ws.dtype, rope, ws.norm_k(m.norm1.groups)
        )
        h = ws.normalize(m.norm1.groups, m.norm1.eps, seq_major=True)  # (S*B*T, C)
        torch.addmm(b_fv, h, w_fv, out=ws.f)  # (S*B*T, M + C)
        torch.addmm(b_q, h, w_q, out=ws.sq_mat)  # (S*B*T, C)
        torch.addmm(b_k, h, w_k, out=ws.sk_mat)
        torch.bmm(_layer_norm(ws.sq, qn), rot, out=ws.rot_q)
        torch.bmm(_layer_norm(ws.sk, kn), rot, out=ws.rot_k)
        if m.kernel == "sdpa":  # (B*T, nh, S, E), sequence-major in memory
            o = F.scaled_dot_product_attention(ws.sq4, ws.sk4, ws.sv4, scale=e**-0.5)
        else:
            o = attention(ws.sq4, ws.sk4, ws.sv4, kernel=m.kernel)
        a = ws.ff_a.mul_(F.silu(ws.ff_g, inplace=True))  # SwiGLU in place
        torch.addmm(b_ff, _tokens_seq_major(o, b * t * s, c), w_att, out=ws.o)  # γ·attn_out(o)
        ws.o.addmm_(a, w_ff)  # + γ·ff_out(swiglu)
        ws.x_frames.add_(ws.o_seq)  # (B*T, S, C)
