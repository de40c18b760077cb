"""Peak activation memory of one forward (inference) or one training step, before it runs.

:func:`activation_bytes` counts, analytically and on the conservative side, the tensors a
forward creates at each stage and how many of them are alive together. It is what
:func:`walrus.memory.check_forward_fits` compares with the free memory before the first batch.

Assumptions (each one errs towards more memory):

- Every intermediate a block creates is counted, as if none were freed or computed in place:
  per latent token, ``13 D`` in temporal attention (norm, q/k/v, q/k norms, the three
  re-layouts, output, projection, residual) and ``16 D + 1.5 M`` in spatial attention (norm,
  the fused ``[ff, q, k, v]`` of ``M + 3 D``, q/k norms and RoPE, re-layouts, output, SwiGLU's
  ``M / 2``, MLP output, sum, residual).
- Attention scores (bias, scores, softmax: three copies) of ``(T x T)`` per token and head in
  time; in space ``(S x S)`` only for ``spatial_kernel="math"``, and one score
  block (``chunk_bytes``, 256 MiB at most) for ``"chunked"``. ``"sdpa"`` is taken to run a fused
  (flash / memory-efficient) kernel, which keeps no ``S x S`` matrix.
- Encoder: the padded encoder input (raw fields and 3 flag channels, plus the embedded fields
  unless the patch encoder folds the embedding in) three times, stage 1 four times (conv, norm,
  activation, copy), stage 2 twice; the decoder alike; the loss takes four copies of the
  output. Boundaries default to walls (the most padding).
- Inference keeps the input, the output and the largest stage. A training step keeps every
  stage of every block for backward (``grad_checkpointing``: only each block's input, plus one
  block recomputed), plus one block's gradients, times the number of unrolled steps with
  gradient.
- Elements take ``dtype_bytes`` (4: fp32). Weights, gradients and optimizer state are not
  included (:func:`walrus.memory.check_model_fits` counts them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from walrus.bcs import BoundaryType

if TYPE_CHECKING:
    from torch import Tensor

    from walrus.model.walrus import Walrus

# largest score block the chunked kernel holds (its default budget off the CPU)
CHUNK_BYTES = 256 << 20


def activation_bytes(
    model: Walrus,
    batch: int,
    frames: int,
    channels: int,
    spatial: Sequence[int],
    *,
    training: bool,
    bcs: Tensor | Sequence | None = None,
    dtype_bytes: int = 4,
    grad_steps: int = 1,
) -> int:
    """Peak bytes of activations for ``model`` on a ``(batch, frames, channels, *spatial)`` input.

    Args:
        model: the model (a ``meta``-device build is enough: only its config and layout are read).
        batch, frames, channels: ``B``, ``T`` and ``C`` of the input.
        spatial: the spatial grid (1-3 axes).
        training: a training step (activations kept for backward) rather than a no-grad forward.
        bcs: boundary codes per axis as for the forward; ``None``: walls everywhere.
        dtype_bytes: bytes per activation element.
        grad_steps: forwards whose activations are kept together (an unrolled training step).

    Returns:
        The estimate in bytes (see the module docstring for what it assumes).
    """
    cfg = model.config
    if bcs is None:
        bcs = [(int(BoundaryType.WALL),) * 2] * len(spatial)
    padded, strides, _ = model.encoder_layout(spatial, bcs)
    k1, k2 = cfg.kernel_sizes
    l1 = [(n - k1) // s1 + 1 for n, (s1, _) in zip(padded, strides)]
    l2 = [(n - k2) // s2 + 1 for n, (_, s2) in zip(l1, strides)]
    m1 = [(n - 1) * s2 + k2 + 2 for n, (_, s2) in zip(l2, strides)]  # decoder stage 1, wrapped
    grid, pad, s = math.prod(spatial), math.prod(padded), math.prod(l2)
    g1 = max(math.prod(l1), math.prod(m1))
    n_in, n_out = batch * frames, batch * (frames if cfg.causal else 1)
    d, m, nh = cfg.dim, cfg.mlp_dim, cfg.heads
    inter = cfg.intermediate_dim
    # encoder input: raw fields + 3 flag channels where the embedding is folded into the
    # first GEMM (or absent), else the embedded fields too
    folded = cfg.encoder == "patch" and not (training and cfg.input_drop > 0)
    c_emb = channels + 3 + (0 if model.space_bag is None or folded else cfg.projection_dim)

    io = 2 * n_in * channels * grid + 4 * n_out * channels * grid  # input, output and loss
    encoder = n_in * (3 * c_emb * pad + 4 * inter * g1 + 2 * d * s)
    decoder = n_out * (d * s + 4 * inter * g1 + 2 * channels * pad)
    tokens = n_in * s
    temporal = tokens * (13 * d + 3 * nh * frames)
    spatial_scores = 0
    if cfg.spatial_kernel == "math":
        spatial_scores = 3 * tokens * nh * s
    elif cfg.spatial_kernel == "chunked":
        spatial_scores = CHUNK_BYTES // dtype_bytes
    space = tokens * (16 * d + 3 * m // 2) + spatial_scores
    block = temporal + space
    stream = 2 * tokens * d  # the token stream and its contiguous copy
    if not training:
        return dtype_bytes * (io + max(encoder, stream + max(temporal, space), decoder))
    if cfg.grad_checkpointing:
        kept = encoder + cfg.depth * tokens * d + block + decoder
    else:
        kept = encoder + cfg.depth * block + decoder
    return dtype_bytes * (io + grad_steps * kept + block + stream)
