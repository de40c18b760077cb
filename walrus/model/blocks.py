"""Processor blocks: temporal attention, then spatial attention (each pre-norm + residual).

Token layout between blocks is ``(B, T, S, C)``, contiguous and channels-last, where
``S = h*w*d`` is the latent grid flattened row-major. Every projection is then one GEMM over
all ``B*T*S`` tokens.

Notation: B batch, T frames, S spatial tokens, C channels, nh heads, E head_dim, M mlp_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from walrus.nn.attention import attention
from walrus.nn.layer_scale import scaled_residual
from walrus.nn.norms import RMSGroupNorm, rms_group_normalize
from walrus.nn.relpos import RelativePositionBias
from walrus.nn.rope import apply_rope
from walrus.nn.swiglu import SwiGLU


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype projections run in: the autocast dtype when autocast is on, else ``x.dtype``."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _layer_scaled(t: Tensor, gamma: Tensor | None) -> Tensor:
    """``t`` scaled per output channel (its first axis) by the layer scale; ``t`` without one."""
    return t if gamma is None else t * gamma.view(-1, *(1,) * (t.ndim - 1))


def _present(*params: Tensor | None) -> list[Tensor]:
    """The given parameters without the absent (``None``) ones."""
    return [p for p in params if p is not None]


def _swap_pairs(x: Tensor) -> Tensor:
    """Swap interleaved channel pairs ``(x0, x1, x2, x3, ...) -> (x1, x0, x3, x2, ...)`` (a copy)."""
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


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


class _DerivedCache:
    """Inference cache of tensors derived from parameters (cast, folded, transposed weights).

    Entries are rebuilt when a parameter changes (its version counter), the dtype or the
    device changes. Nothing is cached while gradients are recorded for a parameter. Inference
    tensors (made under ``torch.inference_mode``) have no version counter: they are keyed by
    identity only.
    """

    def __init__(self) -> None:
        self._store: dict[tuple, tuple[tuple, tuple, tuple[Tensor, ...]]] = {}

    def get(self, key: tuple, params: list[Tensor], build) -> tuple[Tensor, ...]:  # noqa: ANN001
        """Return ``build()`` (a tuple of tensors), cached while ``params`` are unchanged."""
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return build()
        versions = tuple(0 if p.is_inference() else p._version for p in params)
        hit = self._store.get(key)
        if hit is None or hit[1] != versions or any(a is not b for a, b in zip(hit[0], params)):
            with torch.no_grad():
                hit = (tuple(params), versions, build())
            self._store[key] = hit
        return hit[2]


def _tokens(o: Tensor, n_tok: int, c: int) -> Tensor:
    """Attention output ``(N, H, L, E)`` as the token matrix ``(n_tok, C)``.

    The CPU and CUDA flash kernels write their output token-major (``(N, L, H, E)`` in memory),
    so this is one view; any other layout is copied.
    """
    _, h, seq, e = o.shape
    if o.stride() == (seq * h * e, e, h * e, 1):
        return o.as_strided((n_tok, c), (c, 1))  # (n_tok, C)
    return o.transpose(1, 2).reshape(n_tok, c)


class InferenceWorkspace:
    """Buffers and views shared by every processor block of one inference forward.

    Without autograd the token stream is updated in place block after block and every
    intermediate is written into a buffer allocated here once per forward, so all the views
    the blocks need are built once and a block issues only its compute ops. The temporal
    q/k/v buffers share storage with the spatial fused output (they are dead by then).

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
        n_tok, w = b * t * s, m + 3 * c
        self.shape, self.heads, self.mlp_dim, self.dtype = (b, t, s, c), heads, mlp_dim, dtype
        self.stream = x
        self.x = x.view(n_tok, c)  # (B*T*S, C) the residual stream
        self.h = x.new_empty(n_tok, c, dtype=dtype)  # (B*T*S, C) normalised tokens
        self.o = x.new_empty(n_tok, c, dtype=dtype)  # (B*T*S, C) output projections
        f = x.new_empty(n_tok, w, dtype=dtype)  # (B*T*S, M + 3C) spatial [ff | q | k | v]
        self.f = f
        # temporal q, k, v: contiguous (B*T*S, C) blocks of f's storage
        self.tq, self.tk, self.tv = (
            f.as_strided((n_tok, c), (c, 1), i * n_tok * c) for i in range(3)
        )
        self.tq_rows = f.as_strided((n_tok * nh, e), (e, 1), 0)  # (B*T*S*nh, E)
        self.tk_rows = f.as_strided((n_tok * nh, e), (e, 1), n_tok * c)
        self.t4 = ((b, s * nh, t, e), (t * s * c, e, s * c, 1))  # (B, S*nh, T, E) of a token buffer
        self.tv4 = f.as_strided(*self.t4, 2 * n_tok * c)  # (B, S*nh, T, E)
        # spatial views of f
        self.ff_a, self.ff_g = f[:, : m // 2], f[:, m // 2 : m]  # (B*T*S, M/2) each
        self.qk_in = f.as_strided((b * t, s, 2, nh, e), (s * w, w, c, e, 1), m)  # (B*T,S,2,nh,E)
        self.sv4 = f.as_strided((b * t, nh, s, e), (s * w, e, w, 1), m + 2 * c)  # (B*T,nh,S,E)
        self.rot = x.new_empty(b * t, s, 2, nh, e, dtype=dtype)  # rotated q, k
        self.sq4 = self.rot.as_strided((b * t, nh, s, e), (s * 2 * c, e, 2 * c, 1), 0)
        self.sk4 = self.rot.as_strided((b * t, nh, s, e), (s * 2 * c, e, 2 * c, 1), c)
        self._grouped: dict[int, tuple[Tensor, Tensor]] = {}
        self._eps: dict[float, Tensor] = {}

    def normalize(self, groups: int, eps: float) -> Tensor:
        """RMS group normalisation of the stream into :attr:`h` (weight left to the caller).

        Same statistic as :func:`walrus.nn.norms.rms_group_normalize`. Returns ``h``
        ``(B*T*S, C)`` in the compute dtype.
        """
        b, t, s, c = self.shape
        if groups not in self._grouped:
            shape = (b * t, s, groups, c // groups)
            self._grouped[groups] = (self.x.view(shape), self.h.view(shape))  # (N, S, G, Cg)
        xg, hg = self._grouped[groups]
        stat = torch.promote_types(xg.dtype, torch.float32)
        if eps not in self._eps:
            self._eps[eps] = torch.full((), eps, dtype=stat, device=xg.device)
        sq = torch.linalg.vector_norm(xg, dim=(1, 3), keepdim=True, dtype=stat)  # (N, 1, G, 1)
        inv = torch.addcmul(self._eps[eps], sq, sq, value=groups / (s * c)).rsqrt_()
        torch.mul(xg, inv, out=hg)  # cast to the compute dtype fused
        return self.h


class TemporalAttention(nn.Module):
    """Attention over the T frames of every spatial token.

    RMS group norm, one q/k/v projection, q/k LayerNorm per head, T5 bucketed relative
    position bias, causal mask, output projection, layer scale and drop path.

    Args:
        dim: channels C.
        heads: attention heads.
        groups: norm groups.
        causal: frame t attends to frames <= t only (and the bias is unidirectional).
        kernel: attention kernel name (see :func:`walrus.nn.attention.attention`).
        drop_path: drop path probability.
        layer_scale_init: initial layer scale; ``None``: no layer scale (no ``gamma``).
        fused: run the fused forward (:meth:`forward_fused`); ``False`` runs the plain one.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        groups: int,
        *,
        causal: bool = True,
        kernel: str = "sdpa",
        drop_path: float = 0.0,
        layer_scale_init: float | None = 0.1,
        rel_pos_buckets: int = 32,
        rel_pos_max_distance: int = 128,
        fused: bool = True,
    ):
        super().__init__()
        self.heads, self.head_dim, self.kernel, self.causal = heads, dim // heads, kernel, causal
        self.fused, self._derived = fused, _DerivedCache()
        self.drop_path, self.layer_scale_init = drop_path, layer_scale_init
        self.gamma = (
            None
            if layer_scale_init is None
            else nn.Parameter(torch.full((dim,), float(layer_scale_init)))
        )
        self.norm1 = RMSGroupNorm(dim, groups)
        self.input_head = nn.Linear(dim, 3 * dim)
        self.output_head = nn.Linear(dim, dim)
        self.qnorm = nn.LayerNorm(self.head_dim)
        self.knorm = nn.LayerNorm(self.head_dim)
        self.rel_pos_bias = RelativePositionBias(
            heads, rel_pos_buckets, rel_pos_max_distance, bidirectional=not causal
        )

    def forward(self, x: Tensor) -> Tensor:
        """Args: x ``(B, T, S, C)``. Returns ``(B, T, S, C)``."""
        if self.fused and not (self.training and self.drop_path > 0.0):
            return self.forward_fused(x)
        b, t, s, c = x.shape
        nh, e = self.heads, self.head_dim
        h = self.norm1(x).view(b * t * s, c)  # 2-D so the projection is one addmm with its bias
        qkv = self.input_head(h).view(b, t, s, 3, nh, e)  # (B, T, S, 3, nh, E)
        with torch.autocast(x.device.type, enabled=False):  # q/k norms in the dtype of v
            q = self.qnorm(qkv[:, :, :, 0]).view(b, t, s * nh, e).transpose(1, 2)  # (B,S*nh,T,E)
            k = self.knorm(qkv[:, :, :, 1]).view(b, t, s * nh, e).transpose(1, 2)  # (B,S*nh,T,E)
        v = qkv[:, :, :, 2].reshape(b, t, s * nh, e).transpose(1, 2)  # (B, S*nh, T, E)
        bias = self.rel_pos_bias(t, x.device).to(qkv.dtype)  # (nh, T, T)
        bias = bias.expand(s, nh, t, t).reshape(s * nh, t, t)  # (S*nh, T, T)
        with torch.autocast(x.device.type, enabled=False):  # q, k, v, bias share one dtype
            o = attention(q, k, v, bias=bias, causal=self.causal, kernel=self.kernel)
        o = self.output_head(o.transpose(1, 2).reshape(b * t * s, c)).view(
            b, t, s, c
        )  # (B, T, S, C)
        return scaled_residual(x, o, self.gamma, self.drop_path, self.training)

    def _fused_params(self, cd: torch.dtype, t: int, s: int, device: torch.device) -> tuple:
        """Weights with the norm weight and layer scale folded in, in dtype ``cd``."""
        win, wout = self.input_head, self.output_head
        params = _present(self.norm1.weight, win.weight, win.bias, wout.weight, wout.bias)
        params += _present(self.gamma, self.rel_pos_bias.relative_attention_bias.weight)

        def build() -> tuple[Tensor, ...]:
            w_in = (win.weight * self.norm1.weight).to(cd).t()  # (C, 3C)
            w_out = _layer_scaled(wout.weight, self.gamma).to(cd).t()  # (C, C)
            b_out = _layer_scaled(wout.bias, self.gamma).to(cd)  # (C,)
            bias = self.rel_pos_bias(t, device).to(cd)  # (nh, T, T)
            bias = bias.expand(s, *bias.shape).reshape(-1, t, t)  # (S*nh, T, T)
            return w_in, win.bias.to(cd), w_out, b_out, bias

        return self._derived.get((cd, t, s, device), params, build)

    def forward_fused(self, x: Tensor) -> Tensor:
        """Same result as the plain forward, in fewer passes (no drop path).

        The norm weight is folded into the q/k/v weight and the layer scale into the output
        projection, which adds the residual in its GEMM (``addmm`` with ``x`` as input).

        Args:
            x: ``(B, T, S, C)``.

        Returns:
            ``(B, T, S, C)``.
        """
        b, t, s, c = x.shape
        nh, e = self.heads, self.head_dim
        cd = compute_dtype(x)
        w_in, b_in, w_out, b_out, bias = self._fused_params(cd, t, s, x.device)
        with torch.autocast(x.device.type, enabled=False):
            h = rms_group_normalize(x, self.norm1.groups, self.norm1.eps, cd)  # (B*T*S, C)
            qkv = torch.addmm(b_in, h, w_in).view(b, t, s, 3, nh, e)  # (B, T, S, 3, nh, E)
            q = F.layer_norm(
                qkv[:, :, :, 0], (e,), self.qnorm.weight, self.qnorm.bias, self.qnorm.eps
            )
            k = F.layer_norm(
                qkv[:, :, :, 1], (e,), self.knorm.weight, self.knorm.bias, self.knorm.eps
            )
            q = q.view(b, t, s * nh, e).transpose(1, 2)  # (B, S*nh, T, E)
            k = k.view(b, t, s * nh, e).transpose(1, 2)  # (B, S*nh, T, E)
            v = qkv[:, :, :, 2].reshape(b, t, s * nh, e).transpose(1, 2)  # (B, S*nh, T, E)
            o = attention(q, k, v, bias=bias, causal=self.causal, kernel=self.kernel)
            o = o.transpose(1, 2).reshape(b * t * s, c)  # (B*T*S, C)
            out = _residual_gemms(x.view(b * t * s, c), [(o, w_out)], b_out)  # x + γ·proj(o)
        return out.view(b, t, s, c)

    def _inference_params(self, cd: torch.dtype, t: int, s: int, device: torch.device) -> tuple:
        """Split q/k/v weights, output weights and the attention mask, in dtype ``cd``."""
        win, wout, c = self.input_head, self.output_head, self.input_head.in_features
        params = _present(self.norm1.weight, win.weight, win.bias, wout.weight, wout.bias)
        params += _present(self.gamma, self.rel_pos_bias.relative_attention_bias.weight)

        def build() -> tuple[Tensor, ...]:
            w_in = (win.weight * self.norm1.weight).to(cd)  # (3C, C)
            b_in = win.bias.to(cd)  # (3C,)
            w_out = _layer_scaled(wout.weight, self.gamma).to(cd).t()  # (C, C)
            b_out = _layer_scaled(wout.bias, self.gamma).to(cd)  # (C,)
            bias = self.rel_pos_bias(t, device).to(cd)  # (nh, T, T)
            bias = bias.expand(s, *bias.shape).reshape(-1, t, t)  # (S*nh, T, T)
            mask = bias[None]  # (1, S*nh, T, T)
            if self.causal:
                keep = torch.ones(t, t, dtype=torch.bool, device=device).tril()
                mask = mask.masked_fill(~keep, float("-inf"))
            qkv = [(w_in[i * c : (i + 1) * c].t(), b_in[i * c : (i + 1) * c]) for i in range(3)]
            return (*[x for pair in qkv for x in pair], w_out, b_out, bias, mask)

        return self._derived.get(("inference", cd, t, s, device), params, build)

    def forward_inference(self, ws: InferenceWorkspace) -> None:
        """The fused forward without autograd, in place on ``ws``'s token stream.

        q, k and v are three GEMMs into contiguous buffers (so q/k LayerNorm reads contiguous
        rows and every attention operand is a view); the causal mask is folded into the cached
        bias; the output projection lands in ``ws.o`` and is added to the stream.
        """
        b, t, s, c = ws.shape
        e = self.head_dim
        with torch.autocast(ws.x.device.type, enabled=False):
            w_q, b_q, w_k, b_k, w_v, b_v, w_out, b_out, bias, mask = self._inference_params(
                ws.dtype, t, s, ws.x.device
            )
            h = ws.normalize(self.norm1.groups, self.norm1.eps)  # (B*T*S, C)
            torch.addmm(b_q, h, w_q, out=ws.tq)  # (B*T*S, C)
            torch.addmm(b_k, h, w_k, out=ws.tk)
            torch.addmm(b_v, h, w_v, out=ws.tv)
            qn, kn = self.qnorm, self.knorm
            q = F.layer_norm(ws.tq_rows, (e,), qn.weight, qn.bias, qn.eps).as_strided(*ws.t4)
            k = F.layer_norm(ws.tk_rows, (e,), kn.weight, kn.bias, kn.eps).as_strided(*ws.t4)
            if self.kernel == "sdpa":  # (B, S*nh, T, E)
                o = F.scaled_dot_product_attention(q, k, ws.tv4, attn_mask=mask, scale=e**-0.5)
            else:
                o = attention(q, k, ws.tv4, bias=bias, causal=self.causal, kernel=self.kernel)
            torch.addmm(b_out, _tokens(o, b * t * s, c), w_out, out=ws.o)  # γ·proj(o)
            ws.x.add_(ws.o)


class SpatialAttention(nn.Module):
    """Full attention over the S tokens of every frame, in parallel with a SwiGLU MLP.

    One fused linear produces ``[ff (M), q, k, v]``; q/k LayerNorm and axial RoPE; the output is
    ``attn_out(attn) + ff_out(swiglu(ff))``, then layer scale and drop path.

    Args:
        dim: channels C.
        heads: attention heads.
        groups: norm groups.
        mlp_dim: width M of the feed-forward branch before the SwiGLU gate (even).
        kernel: attention kernel name.
        drop_path: drop path probability.
        layer_scale_init: initial layer scale; ``None``: no layer scale (no ``gamma_att``).
        fused: run the fused forward (:meth:`forward_fused`); ``False`` runs the plain one.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        groups: int,
        mlp_dim: int,
        *,
        kernel: str = "sdpa",
        drop_path: float = 0.0,
        layer_scale_init: float | None = 0.1,
        fused: bool = True,
    ):
        super().__init__()
        self.heads, self.head_dim, self.mlp_dim, self.kernel = heads, dim // heads, mlp_dim, kernel
        self.fused, self._derived = fused, _DerivedCache()
        self.drop_path, self.layer_scale_init = drop_path, layer_scale_init
        self.gamma_att = (
            None
            if layer_scale_init is None
            else nn.Parameter(torch.full((dim,), float(layer_scale_init)))
        )
        self.norm1 = RMSGroupNorm(dim, groups)
        self.fused_ff_qkv = nn.Linear(dim, mlp_dim + 3 * dim)
        self.ff_out = nn.Sequential(SwiGLU(), nn.Linear(mlp_dim // 2, dim))
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.q_norm = nn.LayerNorm(self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], *, reuse_input: bool = False
    ) -> Tensor:
        """Args: x ``(B, T, S, C)``; rope ``(cos, sin)`` each ``(S, 1, E)``; ``reuse_input``:
        the fused forward may add the residual into ``x`` in place when no gradient is recorded.
        Returns ``(B, T, S, C)``."""
        if self.fused and not (self.training and self.drop_path > 0.0):
            return self.forward_fused(x, rope, reuse_input=reuse_input)
        b, t, s, c = x.shape
        nh, e = self.heads, self.head_dim
        f = self.fused_ff_qkv(self.norm1(x).view(b * t * s, c))  # (B*T*S, M + 3C), one addmm
        ff, qkv = f.split([self.mlp_dim, 3 * c], dim=-1)
        qkv = qkv.view(b, t, s, 3, nh, e)  # (B, T, S, 3, nh, E)
        cos, sin = (r.to(qkv.dtype) for r in rope)
        with torch.autocast(x.device.type, enabled=False):  # q/k norms + RoPE in the dtype of v
            q = apply_rope(self.q_norm(qkv[..., 0, :, :]), cos, sin)  # (B, T, S, nh, E)
            k = apply_rope(self.k_norm(qkv[..., 1, :, :]), cos, sin)  # (B, T, S, nh, E)
        q = q.view(b * t, s, nh, e).transpose(1, 2)  # (B*T, nh, S, E)
        k = k.view(b * t, s, nh, e).transpose(1, 2)  # (B*T, nh, S, E)
        v = qkv[..., 2, :, :].flatten(0, 1).transpose(1, 2)  # (B*T, nh, S, E)
        with torch.autocast(x.device.type, enabled=False):  # q, k, v share one dtype
            o = attention(q, k, v, kernel=self.kernel)  # (B*T, nh, S, E)
        o = o.transpose(1, 2).reshape(b * t * s, c)  # (B*T*S, C)
        mlp = self.ff_out(ff)  # (B*T*S, C)
        out = torch.addmm(mlp, o, self.attn_out.weight.t()).view(b, t, s, c)  # attn_out(o) + mlp
        return scaled_residual(x, out, self.gamma_att, self.drop_path, self.training)

    def _fused_params(self, cd: torch.dtype, rope: tuple[Tensor, Tensor]) -> tuple:
        """Folded weights in dtype ``cd``; q/k LayerNorm affines folded into the RoPE tables.

        With ``y = n * w + b`` (``n`` the normalised head), ``rope(y) = n * A + swap(n) * B + D``
        where ``A = w cos``, ``B = swap(w) sin``, ``D = b cos + swap(b) sin``; q and k stacked.
        """
        ff_out = self.ff_out[1]
        norms = (self.q_norm, self.k_norm)
        params = _present(ff_out.weight, ff_out.bias, self.attn_out.weight, self.gamma_att)
        params += [p for n in norms for p in (n.weight, n.bias)]
        cos, sin = rope

        def build() -> tuple[Tensor, ...]:
            g = self.gamma_att
            w_att = _layer_scaled(self.attn_out.weight, g).to(cd).t()  # (C, C)
            w_ff = _layer_scaled(ff_out.weight, g).to(cd).t()  # (M/2, C)
            b_ff = _layer_scaled(ff_out.bias, g).to(cd)  # (C,)
            w = torch.stack([n.weight for n in norms])  # (2, E)
            bias = torch.stack([n.bias for n in norms])  # (2, E)
            c32, s32 = cos.float()[:, None], sin.float()[:, None]  # (S, 1, 1, E)
            tab_a = (w[:, None] * c32).to(cd)  # (S, 2, 1, E)
            tab_b = (_swap_pairs(w)[:, None] * s32).to(cd)
            tab_d = (bias[:, None] * c32 + _swap_pairs(bias)[:, None] * s32).to(cd)
            return w_att, w_ff, b_ff, tab_a, tab_b, tab_d

        key = (cd, cos.shape, cos.device)
        return self._derived.get(key, params + [cos, sin], build)

    def forward_fused(
        self, x: Tensor, rope: tuple[Tensor, Tensor], *, reuse_input: bool = False
    ) -> Tensor:
        """Same result as the plain forward, in fewer passes (no drop path).

        The norm weight is folded into the per-group norm scale; q and k are normalised in one
        LayerNorm call and rotated in place with tables that carry the LayerNorm affine;
        SwiGLU runs in place on the fused output when no gradient is recorded; the attention
        and feed-forward output projections accumulate into one buffer that starts as the
        residual (layer scale folded into their weights).

        Args:
            x: ``(B, T, S, C)``.
            rope: ``(cos, sin)`` each ``(S, 1, E)``.
            reuse_input: ``x`` may be overwritten with the result (no gradient recorded).

        Returns:
            ``(B, T, S, C)``.
        """
        b, t, s, c = x.shape
        nh, e, m = self.heads, self.head_dim, self.mlp_dim
        cd = compute_dtype(x)
        w_att, w_ff, b_ff, tab_a, tab_b, tab_d = self._fused_params(cd, rope)
        norm = self.norm1
        h = rms_group_normalize(x, norm.groups, norm.eps, cd, norm.weight)  # (B*T*S, C)
        f = self.fused_ff_qkv(h)  # (B*T*S, M + 3C): one GEMM on contiguous tokens
        with torch.autocast(x.device.type, enabled=False):
            qkv = f[:, m:].view(b * t, s, 3, nh, e)  # (B*T, S, 3, nh, E)
            n = F.layer_norm(qkv[:, :, :2], (e,), eps=self.q_norm.eps)  # (B*T, S, 2, nh, E)
            qk = _swap_pairs(n).mul_(tab_b).addcmul_(n, tab_a).add_(tab_d)  # RoPE(LN(q)), k
            q = qk[:, :, 0].transpose(1, 2)  # (B*T, nh, S, E)
            k = qk[:, :, 1].transpose(1, 2)  # (B*T, nh, S, E)
            v = qkv[:, :, 2].transpose(1, 2)  # (B*T, nh, S, E)
            o = attention(q, k, v, kernel=self.kernel)  # (B*T, nh, S, E)
            o = o.transpose(1, 2).reshape(b * t * s, c)  # (B*T*S, C)
            a, g = f[:, : m // 2], f[:, m // 2 : m]  # (B*T*S, M/2) each
            if torch.is_grad_enabled():
                a = a * F.silu(g)
            else:
                a = a.mul_(F.silu(g, inplace=True))  # SwiGLU in place
            terms = [(o, w_att), (a, w_ff)]  # γ·attn_out(o) + γ·ff_out(swiglu)
            out = _residual_gemms(x.view(b * t * s, c), terms, b_ff, reuse_input)  # (B*T*S, C)
        return out.view(b, t, s, c)

    def _inference_params(self, cd: torch.dtype, rope: tuple[Tensor, Tensor]) -> tuple:
        """:meth:`_fused_params` plus the fused ff/q/k/v weight with the norm weight folded in,
        its bias, and the channel-pair swap index."""
        lin, cos = self.fused_ff_qkv, rope[0]
        params = [lin.weight, lin.bias, self.norm1.weight]

        def build() -> tuple[Tensor, ...]:
            w_in = (lin.weight * self.norm1.weight).to(cd).t()  # (C, M + 3C)
            swap = torch.arange(self.head_dim, device=cos.device).view(-1, 2).flip(-1).flatten()
            return w_in, lin.bias.to(cd), swap

        extra = self._derived.get(("inference", cd, cos.device), params, build)
        return (*extra, *self._fused_params(cd, rope))

    def forward_inference(self, ws: InferenceWorkspace, rope: tuple[Tensor, Tensor]) -> None:
        """The fused forward without autograd, in place on ``ws``'s token stream.

        One GEMM into ``ws.f``; q and k normalised in one LayerNorm call and rotated into
        ``ws.rot`` with tables that carry the LayerNorm affine; SwiGLU in place; both output
        projections accumulate into ``ws.o``, which is added to the stream.

        Args:
            ws: the forward's workspace.
            rope: ``(cos, sin)`` each ``(S, 1, E)``.
        """
        b, t, s, c = ws.shape
        e = self.head_dim
        with torch.autocast(ws.x.device.type, enabled=False):
            w_in, b_in, swap, w_att, w_ff, b_ff, tab_a, tab_b, tab_d = self._inference_params(
                ws.dtype, rope
            )
            h = ws.normalize(self.norm1.groups, self.norm1.eps)  # (B*T*S, C)
            torch.addmm(b_in, h, w_in, out=ws.f)  # (B*T*S, M + 3C): one GEMM, contiguous input
            n = F.layer_norm(ws.qk_in, (e,), eps=self.q_norm.eps)  # (B*T, S, 2, nh, E)
            rot = torch.index_select(n, -1, swap, out=ws.rot)  # pairs swapped
            torch.addcmul(tab_d, rot, tab_b, out=rot).addcmul_(n, tab_a)  # RoPE(LN(q)), k
            if self.kernel == "sdpa":  # (B*T, nh, S, E)
                o = F.scaled_dot_product_attention(ws.sq4, ws.sk4, ws.sv4, scale=e**-0.5)
            else:
                o = attention(ws.sq4, ws.sk4, ws.sv4, kernel=self.kernel)
            a = ws.ff_a.mul_(F.silu(ws.ff_g, inplace=True))  # SwiGLU in place
            torch.addmm(b_ff, _tokens(o, b * t * s, c), w_att, out=ws.o)  # γ·attn_out(o)
            ws.x.add_(ws.o.addmm_(a, w_ff))  # + γ·ff_out(swiglu)


class ProcessorBlock(nn.Module):
    """Temporal attention then spatial attention, with optional gradient checkpointing.

    Args:
        time_mixing: the block's :class:`TemporalAttention`.
        space_mixing: the block's :class:`SpatialAttention`.
        grad_checkpointing: recompute this block's activations in backward.
    """

    def __init__(
        self,
        time_mixing: TemporalAttention,
        space_mixing: SpatialAttention,
        grad_checkpointing: bool = False,
    ):
        super().__init__()
        self.time_mixing = time_mixing
        self.space_mixing = space_mixing
        self.grad_checkpointing = grad_checkpointing

    def _forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # the temporal output is a fresh tensor: the spatial residual may be added into it
        return self.space_mixing(self.time_mixing(x), (cos, sin), reuse_input=True)

    def inference_ready(self) -> bool:
        """Whether :meth:`forward_inference` gives this block's result (fused, no drop path)."""
        tm, sm = self.time_mixing, self.space_mixing
        return all(m.fused and not (m.training and m.drop_path > 0.0) for m in (tm, sm))

    def forward_inference(self, ws: InferenceWorkspace, rope: tuple[Tensor, Tensor]) -> None:
        """:meth:`forward` without autograd, in place on ``ws``'s token stream."""
        self.time_mixing.forward_inference(ws)
        self.space_mixing.forward_inference(ws, rope)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """Args: x ``(B, T, S, C)``; rope ``(cos, sin)`` tables. Returns ``(B, T, S, C)``."""
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, *rope, use_reentrant=False)
        return self._forward(x, *rope)
