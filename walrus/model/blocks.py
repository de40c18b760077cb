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
        layer_scale_init: initial layer scale.
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
        layer_scale_init: float = 0.1,
        rel_pos_buckets: int = 32,
        rel_pos_max_distance: int = 128,
        fused: bool = True,
    ):
        super().__init__()
        self.heads, self.head_dim, self.kernel, self.causal = heads, dim // heads, kernel, causal
        self.fused, self._derived = fused, _DerivedCache()
        self.drop_path, self.layer_scale_init = drop_path, layer_scale_init
        self.gamma = nn.Parameter(torch.full((dim,), layer_scale_init))
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
        o = attention(q, k, v, bias=bias, causal=self.causal, kernel=self.kernel)  # (B, S*nh, T, E)
        o = self.output_head(o.transpose(1, 2).reshape(b * t * s, c)).view(
            b, t, s, c
        )  # (B, T, S, C)
        return scaled_residual(x, o, self.gamma, self.drop_path, self.training)

    def _fused_params(self, cd: torch.dtype, t: int, s: int, device: torch.device) -> tuple:
        """Weights with the norm weight and layer scale folded in, in dtype ``cd``."""
        win, wout = self.input_head, self.output_head
        params = [self.norm1.weight, win.weight, win.bias, wout.weight, wout.bias, self.gamma]
        params += [self.rel_pos_bias.relative_attention_bias.weight]

        def build() -> tuple[Tensor, ...]:
            w_in = (win.weight * self.norm1.weight).to(cd).t()  # (C, 3C)
            w_out = (wout.weight * self.gamma[:, None]).to(cd).t()  # (C, C)
            b_out = (wout.bias * self.gamma).to(cd)  # (C,)
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
        layer_scale_init: initial layer scale.
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
        layer_scale_init: float = 0.1,
        fused: bool = True,
    ):
        super().__init__()
        self.heads, self.head_dim, self.mlp_dim, self.kernel = heads, dim // heads, mlp_dim, kernel
        self.fused, self._derived = fused, _DerivedCache()
        self.drop_path, self.layer_scale_init = drop_path, layer_scale_init
        self.gamma_att = nn.Parameter(torch.full((dim,), layer_scale_init))
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
        params = [ff_out.weight, ff_out.bias]
        params += [self.attn_out.weight, self.gamma_att] + [
            p for n in norms for p in (n.weight, n.bias)
        ]
        cos, sin = rope

        def build() -> tuple[Tensor, ...]:
            g = self.gamma_att[:, None]
            w_att = (self.attn_out.weight * g).to(cd).t()  # (C, C)
            w_ff = (ff_out.weight * g).to(cd).t()  # (M/2, C)
            b_ff = (ff_out.bias * self.gamma_att).to(cd)  # (C,)
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

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """Args: x ``(B, T, S, C)``; rope ``(cos, sin)`` tables. Returns ``(B, T, S, C)``."""
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, *rope, use_reentrant=False)
        return self._forward(x, *rope)
