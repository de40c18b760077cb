"""Processor blocks, reference maths: temporal attention, then spatial attention.

Each is pre-norm with a residual: ``x + gamma * drop_path(branch(norm(x)))``. Between blocks the
tokens are ``(b, t, s, c)``, contiguous and channels-last, with ``s = h*w*d`` the latent grid
flattened row-major, so every projection is one GEMM over all ``b*t*s`` tokens.

This file is the reference: :mod:`walrus.model.fast_blocks` computes the same results in fewer
passes and its :func:`~walrus.model.fast_blocks.run_processor` picks the path.

Notation (einops patterns and shape comments):

- ``b`` batch, ``t`` frames, ``s`` spatial tokens, ``c`` channels
- ``nh`` heads, ``e`` head dim (``c = nh * e``), ``m`` feed-forward width before the SwiGLU gate
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from einops import rearrange, repeat
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from walrus.nn.attention import attention
from walrus.nn.layer_scale import scaled_residual
from walrus.nn.norms import RMSGroupNorm, layer_norm_in_dtype
from walrus.nn.relpos import RelativePositionBias
from walrus.nn.rope import apply_rope
from walrus.nn.swiglu import SwiGLU


class TemporalAttention(nn.Module):
    """Attention over the t frames of every spatial token.

    RMS group norm, one q/k/v projection, q/k LayerNorm per head, T5 bucketed relative
    position bias, causal mask, output projection, layer scale and drop path.

    Args:
        dim: channels c.
        heads: attention heads nh.
        groups: norm groups.
        causal: frame t attends to frames <= t only (and the bias is unidirectional).
        kernel: attention kernel name (see :func:`walrus.nn.attention.attention`).
        drop_path: drop path probability.
        layer_scale_init: initial layer scale; ``None``: no layer scale (no ``gamma``).
        norm_eps: eps of the RMS group norm.
        rel_pos_buckets: relative position buckets.
        rel_pos_max_distance: largest distinguished frame distance.
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
        norm_eps: float = 1e-6,
        rel_pos_buckets: int = 32,
        rel_pos_max_distance: int = 128,
    ):
        super().__init__()
        self.heads, self.head_dim, self.kernel, self.causal = heads, dim // heads, kernel, causal
        self.drop_path, self.layer_scale_init = drop_path, layer_scale_init
        self.gamma = (
            None
            if layer_scale_init is None
            else nn.Parameter(torch.full((dim,), float(layer_scale_init)))
        )
        self.norm1 = RMSGroupNorm(dim, groups, norm_eps)
        self.input_head = nn.Linear(dim, 3 * dim)
        self.output_head = nn.Linear(dim, dim)
        self.qnorm = nn.LayerNorm(self.head_dim)
        self.knorm = nn.LayerNorm(self.head_dim)
        self.rel_pos_bias = RelativePositionBias(
            heads, rel_pos_buckets, rel_pos_max_distance, bidirectional=not causal
        )

    def forward(self, x: Tensor) -> Tensor:
        """Args: x ``(b, t, s, c)``. Returns ``(b, t, s, c)``."""
        b, t, s, c = x.shape
        h = self.norm1(x).view(b * t * s, c)  # 2-D so the projection is one addmm with its bias
        qkv = self.input_head(h).view(b, t, s, 3, self.heads, self.head_dim)  # (b,t,s,3,nh,e)
        # every spatial token (and head) is one sequence over the frames
        with torch.autocast(x.device.type, enabled=False):  # q/k norms in the dtype of v
            q = rearrange(
                layer_norm_in_dtype(qkv[:, :, :, 0], self.qnorm), "b t s nh e -> b (s nh) t e"
            )
            k = rearrange(
                layer_norm_in_dtype(qkv[:, :, :, 1], self.knorm), "b t s nh e -> b (s nh) t e"
            )
        v = rearrange(qkv[:, :, :, 2], "b t s nh e -> b (s nh) t e")
        bias = self.rel_pos_bias(t, x.device).to(qkv.dtype)  # (nh, t, t)
        bias = repeat(bias, "nh tq tk -> (s nh) tq tk", s=s)
        with torch.autocast(x.device.type, enabled=False):  # q, k, v, bias share one dtype
            o = attention(q, k, v, bias=bias, causal=self.causal, kernel=self.kernel)
        o = self.output_head(rearrange(o, "b (s nh) t e -> (b t s) (nh e)", s=s))
        return scaled_residual(x, o.view(b, t, s, c), self.gamma, self.drop_path, self.training)


class SpatialAttention(nn.Module):
    """Full attention over the s tokens of every frame, in parallel with a SwiGLU MLP.

    One fused linear produces ``[ff (m), q, k, v]``; q/k LayerNorm and axial RoPE; the output is
    ``attn_out(attn) + ff_out(swiglu(ff))``, then layer scale and drop path.

    Args:
        dim: channels c.
        heads: attention heads nh.
        groups: norm groups.
        mlp_dim: width m of the feed-forward branch before the SwiGLU gate (even).
        kernel: attention kernel name.
        drop_path: drop path probability.
        layer_scale_init: initial layer scale; ``None``: no layer scale (no ``gamma_att``).
        norm_eps: eps of the RMS group norm.
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
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        self.heads, self.head_dim, self.mlp_dim, self.kernel = heads, dim // heads, mlp_dim, kernel
        self.drop_path, self.layer_scale_init = drop_path, layer_scale_init
        self.gamma_att = (
            None
            if layer_scale_init is None
            else nn.Parameter(torch.full((dim,), float(layer_scale_init)))
        )
        self.norm1 = RMSGroupNorm(dim, groups, norm_eps)
        self.fused_ff_qkv = nn.Linear(dim, mlp_dim + 3 * dim)
        self.ff_out = nn.Sequential(SwiGLU(), nn.Linear(mlp_dim // 2, dim))
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.q_norm = nn.LayerNorm(self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """Args: x ``(b, t, s, c)``; rope ``(cos, sin)`` each ``(s, 1, e)``.
        Returns ``(b, t, s, c)``."""
        b, t, s, c = x.shape
        f = self.fused_ff_qkv(self.norm1(x).view(b * t * s, c))  # (b*t*s, m + 3c), one addmm
        ff, qkv = f.split([self.mlp_dim, 3 * c], dim=-1)  # (b*t*s, m), (b*t*s, 3c)
        qkv = qkv.view(b, t, s, 3, self.heads, self.head_dim)  # (b, t, s, 3, nh, e)
        cos, sin = (r.to(qkv.dtype) for r in rope)
        # every frame (and head) is one sequence over the spatial tokens
        with torch.autocast(x.device.type, enabled=False):  # q/k norms + RoPE in the dtype of v
            q = apply_rope(
                layer_norm_in_dtype(qkv[:, :, :, 0], self.q_norm), cos, sin
            )  # (b, t, s, nh, e)
            k = apply_rope(
                layer_norm_in_dtype(qkv[:, :, :, 1], self.k_norm), cos, sin
            )  # (b, t, s, nh, e)
        q = rearrange(q, "b t s nh e -> (b t) nh s e")
        k = rearrange(k, "b t s nh e -> (b t) nh s e")
        v = rearrange(qkv[:, :, :, 2], "b t s nh e -> (b t) nh s e")
        with torch.autocast(x.device.type, enabled=False):  # q, k, v share one dtype
            o = attention(q, k, v, kernel=self.kernel)  # ((b t), nh, s, e)
        o = rearrange(o, "(b t) nh s e -> (b t s) (nh e)", b=b)
        mlp = self.ff_out(ff)  # (b*t*s, c)
        out = torch.addmm(mlp, o, self.attn_out.weight.t())  # attn_out(o) + mlp: (b*t*s, c)
        return scaled_residual(
            x, out.view(b, t, s, c), self.gamma_att, self.drop_path, self.training
        )


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
        return self.space_mixing(self.time_mixing(x), (cos, sin))

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        impl: Callable[[ProcessorBlock, Tensor, Tensor, Tensor], Tensor] | None = None,
    ) -> Tensor:
        """Args: x ``(b, t, s, c)``; rope ``(cos, sin)`` tables; ``impl(block, x, cos, sin)``
        computes the same as the reference in another way (the fused path of
        :mod:`walrus.model.fast_blocks`), so that checkpointing and ``torch.compile`` of the
        block apply to it too. Returns ``(b, t, s, c)``."""
        fn = self._forward if impl is None else partial(impl, self)
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(fn, x, *rope, use_reentrant=False)
        return fn(x, *rope)
