"""Analytic FLOP counts (processor, encoder, decoder), parameter shares and an MFU estimate.

:func:`processor_flops` is one sample's forward through the processor blocks;
:func:`forward_flops` splits a whole forward into field embedding, encoder, processor and
decoder (the encoder and decoder add about 2 % at official size, most of a conv-encoder
``small``). A multiply-add is 2 FLOPs. Attention is counted dense: the causal temporal mask
does not halve it (the kernels compute the masked scores too). Norms, activations, RoPE and
padding are not counted (as in torch's ``FlopCounterMode``). A training step costs about 3
forwards (backward: gradients for inputs and for weights).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from walrus.model.walrus import Walrus


def processor_flops(dim: int, depth: int, mlp_dim: int, frames: int, tokens: int) -> int:
    """Forward FLOPs of the processor for one sample, attention included.

    Per token and block: temporal q/k/v and output projections ``8 C^2``; the spatial fused
    ``[ff, q, k, v]`` linear ``2 C (M + 3C)``, its attention output ``2 C^2`` and SwiGLU output
    ``2 (M/2) C``; attention ``4 L C`` for a sequence of length L (scores and values), with
    ``L = T`` in time and ``L = S`` in space. Norms, RoPE, softmax and SwiGLU gating are not
    counted (as in torch's ``FlopCounterMode``).

    Args:
        dim: channels C.
        depth: processor blocks.
        mlp_dim: feed-forward width M before the SwiGLU gate.
        frames: frames T.
        tokens: latent tokens S per frame.

    Returns:
        FLOPs per sample.
    """
    sizes = {"dim": dim, "depth": depth, "mlp_dim": mlp_dim, "frames": frames, "tokens": tokens}
    for name, v in sizes.items():
        if v < 1:
            raise ValueError(f"processor_flops: {name}={v} must be >= 1")
    c, m = dim, mlp_dim
    per_token = 8 * c * c + 2 * c * (m + 3 * c) + 2 * c * c + m * c  # projections
    per_token += 4 * frames * c + 4 * tokens * c  # temporal and spatial attention
    return per_token * frames * tokens * depth


def estimate_mfu(flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the hardware peak.

    Args:
        flops: model FLOPs of the timed work, e.g. ``batch * processor_flops(...)`` for a
            forward, about three times that for a training step.
        seconds: wall time of that work.
        peak_flops_per_s: the peak to compare with (a datasheet figure, or a GEMM rate
            measured on the same machine).

    Returns:
        The fraction of the peak (1.0 = peak).
    """
    if seconds <= 0 or peak_flops_per_s <= 0:
        raise ValueError(
            f"estimate_mfu: seconds ({seconds}) and peak_flops_per_s ({peak_flops_per_s}) "
            "must be positive"
        )
    return flops / seconds / peak_flops_per_s


def forward_flops(
    model: Walrus,
    batch: int,
    frames: int,
    channels: int,
    spatial: Sequence[int],
    bcs: Tensor | Sequence,
) -> dict[str, int]:
    """Forward FLOPs of ``model`` on a ``(batch, frames, channels, *spatial)`` input, by part.

    Conv and patch encoders share one count: a conv stage with kernel ``k`` and stride ``s``
    costs ``2 * out_positions * c_in * c_out * k^a`` over the ``a`` axes longer than one point
    (kernels summed over the others), a transposed one ``2 * in_positions * c_in * c_out * k^a``
    (with the periodic wrap of the current official layout); the patch form is the case
    ``k = s``. Where the patch encoder folds the field embedding into its first GEMM
    (:meth:`Walrus.embedding_folded`), the embedding costs only the fold and the first stage
    reads the raw fields and 3 flag channels.

    Args:
        model: the model (its config, padding plan and train/eval mode give the shapes).
        batch, frames, channels: ``B``, ``T`` and ``C`` of the input.
        spatial: the spatial shape.
        bcs: boundary codes per spatial axis, as for the model's forward.

    Returns:
        ``{"embedding", "encoder", "processor", "decoder", "total"}`` FLOPs.
    """
    cfg = model.config
    padded, strides, periodic = model.encoder_layout(spatial, bcs)
    (k1, k2), a = cfg.kernel_sizes, len(padded)
    n_in = batch * frames
    n_out = batch * (frames if cfg.causal else 1)
    inter, dim = cfg.intermediate_dim, cfg.dim
    folded = model.embedding_folded()
    # encoder input: raw fields + 3 flags (the current official layout, and the patch encoder
    # with the embedding folded into its first GEMM), else the embedded fields
    c_in = channels + 3 if model.space_bag is None or folded else cfg.projection_dim
    embedding = 0  # the current official layout has no embedding
    if folded:  # the weight fold, once per forward
        embedding = 2 * inter * cfg.projection_dim * c_in * k1**a
    elif model.space_bag is not None:
        embedding = 2 * n_in * math.prod(spatial) * channels * cfg.projection_dim
    l1 = [(n - k1) // s1 + 1 for n, (s1, _) in zip(padded, strides)]
    l2 = [(n - k2) // s2 + 1 for n, (_, s2) in zip(l1, strides)]
    encoder = (
        2 * n_in * (math.prod(l1) * c_in * inter * k1**a + math.prod(l2) * inter * dim * k2**a)
    )
    wrap = model.profile.decoder_periodic_wrap and not model.patch
    w1 = [(k2 - s2) // s2 if wrap and p else 0 for (_, s2), p in zip(strides, periodic)]
    w2 = [(k1 - s1) // s1 if wrap and p else 0 for (s1, _), p in zip(strides, periodic)]
    m1 = [(n - 1) * s2 + k2 for n, (_, s2) in zip(l2, strides)]  # stage-1 output, cropped
    dec_in1 = math.prod(n + 2 * p for n, p in zip(l2, w1))
    dec_in2 = math.prod(n + 2 * p for n, p in zip(m1, w2))
    kd = k1  # last decoder stage's kernel
    if model.patch and cfg.decoder_overlap:  # 2 k1, one token of circular padding per wrap side
        kd = 2 * k1
        lengths = [n for n in spatial if n > 1]
        wraps = [p and n == m for p, n, m in zip(periodic, padded, lengths)]
        dec_in2 = math.prod(n + 2 if w else n for n, w in zip(m1, wraps))
    decoder = 2 * n_out * (dec_in1 * dim * inter * k2**a + dec_in2 * inter * channels * kd**a)
    processor = batch * processor_flops(dim, cfg.depth, cfg.mlp_dim, frames, math.prod(l2))
    parts = {"embedding": embedding, "encoder": encoder, "processor": processor, "decoder": decoder}
    parts["total"] = sum(parts.values())
    return parts


def parameter_counts(model: Walrus) -> dict[str, int]:
    """Parameters by part: ``embedding`` (field embedding, padding tokens, input scale),
    ``encoder`` and ``decoder`` (every included set), ``processor`` (the blocks), ``total``."""
    embedding = [*model.space_bag.parameters()] if model.space_bag is not None else []
    if model.patch_jitterer is not None:
        embedding += list(model.patch_jitterer.parameters())
    if model.encoder_dummy is not None:
        embedding.append(model.encoder_dummy)
    parts = {
        "embedding": sum(p.numel() for p in embedding),
        "encoder": sum(p.numel() for p in model.embed.parameters()),
        "processor": sum(p.numel() for p in model.blocks.parameters()),
        "decoder": sum(p.numel() for p in model.debed.parameters()),
    }
    parts["total"] = sum(parts.values())
    return parts
