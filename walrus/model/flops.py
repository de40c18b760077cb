"""Analytic FLOP count of the processor and a model-FLOPs-utilisation (MFU) estimate.

The count is for one sample's forward through the processor blocks (the encoder and decoder add
about 2 % at official size). A multiply-add is 2 FLOPs. Attention is counted dense: the causal
temporal mask does not halve it (the kernels compute the masked scores too). A training step
costs about 3 forwards (backward: gradients for inputs and for weights).
"""

from __future__ import annotations


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
