"""Field embedding over a shared vocabulary of physical fields ("space bag").

The vocabulary has one learned column per field. A batch names its C fields by vocabulary
id; the per-pixel projection uses only those columns, rescaled by ``sqrt(n_fields / C)`` so a
batch with few fields sees the same activation scale as one with all of them.

:class:`SharedFieldEmbedding` (model option ``field_embedding="shared"``) is the
field-agnostic alternative: one shared lift that a learned identity vector per field modulates.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class FieldEmbedding(nn.Module):
    """Per-pixel projection ``n_fields -> dim`` restricted to the batch's fields.

    Args:
        n_fields: vocabulary size.
        dim: output channels (the projection dim).
        scale_bias: apply the ``sqrt(n_fields / C)`` rescale to the bias too, as the official
            legacy official Walrus does; by default only the weight is rescaled.
    """

    def __init__(self, n_fields: int, dim: int, scale_bias: bool = False):
        super().__init__()
        self.linear = nn.Linear(n_fields, dim)
        self.scale_bias = scale_bias

    @property
    def n_fields(self) -> int:
        return self.linear.in_features

    def forward(self, x: Tensor, fields: Tensor) -> Tensor:
        """Embed.

        Args:
            x: ``(N, C, *spatial)``.
            fields: ``(C,)`` long vocabulary ids, on the weight's device.

        Returns:
            ``(N, dim, *spatial)``.
        """
        n, c = x.shape[:2]
        w, bias = self.weight_and_bias(fields)  # (dim, C), (dim,)
        y = F.conv1d(x.reshape(n, c, -1), w[:, :, None], bias)  # (N, dim, S)
        return y.view(n, -1, *x.shape[2:])

    def weight_and_bias(self, fields: Tensor) -> tuple[Tensor, Tensor]:
        """The projection applied to a batch with ``fields`` ``(C,)``: ``(dim, C)`` weight
        (rescaled) and ``(dim,)`` bias."""
        scale = math.sqrt(self.n_fields / fields.numel())
        w = self.linear.weight[:, fields] * scale  # (dim, C)
        bias = self.linear.bias * scale if self.scale_bias else self.linear.bias  # (dim,)
        return w, bias


class SharedFieldEmbedding(nn.Module):
    """Field-agnostic projection: one shared lift, modulated per field by an identity vector.

    Field ``f``'s column is ``lift * identity[f]`` (elementwise, ``(dim,)``), so every field is
    read through the same trained lift and a field differs from another only by its identity
    vector. The projection of a batch with C fields is ``C^-1/2 sum_c x_c (lift * identity[f_c])
    + bias``. A new field's identity starts from the known ones (:meth:`init_fields`), not at
    a random column.

    Args:
        n_fields: vocabulary size.
        dim: output channels (the projection dim).
    """

    def __init__(self, n_fields: int, dim: int):
        super().__init__()
        self.lift = nn.Parameter(torch.empty(dim))
        self.identity = nn.Parameter(torch.empty(n_fields, dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    @property
    def n_fields(self) -> int:
        return self.identity.shape[0]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Lift ``N(0, 1/2)``, identities ``1 + N(0, 1)`` (column entries of variance one, two
        fields' columns correlated by about one half), bias zero."""
        nn.init.normal_(self.lift, std=0.5**0.5)
        nn.init.normal_(self.identity, mean=1.0, std=1.0)
        nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, fields: Tensor) -> Tensor:
        """Embed ``x`` ``(N, C, *spatial)`` with ``fields`` ``(C,)`` ids: ``(N, dim, *spatial)``."""
        n, c = x.shape[:2]
        w, bias = self.weight_and_bias(fields)  # (dim, C), (dim,)
        y = F.conv1d(x.reshape(n, c, -1), w[:, :, None], bias)  # (N, dim, S)
        return y.view(n, -1, *x.shape[2:])

    def weight_and_bias(self, fields: Tensor) -> tuple[Tensor, Tensor]:
        """The projection for ``fields`` ``(C,)``: ``(dim, C)`` weight and ``(dim,)`` bias."""
        w = (self.identity[fields] * self.lift).t() * fields.numel() ** -0.5  # (dim, C)
        return w, self.bias

    @torch.no_grad()
    def grow(self, n_fields: int) -> None:
        """Extend the vocabulary to ``n_fields``; new identities get the usual init."""
        old = self.identity
        new = old.new_empty(n_fields, old.shape[1]).normal_(mean=1.0, std=1.0)
        new[: old.shape[0]] = old
        self.identity = nn.Parameter(new)

    @torch.no_grad()
    def init_fields(self, new: Tensor, known: Tensor, spread: float = 1.0) -> None:
        """Set the identities of the ``new`` ids from those of the ``known`` ids (both ``(K,)``
        long tensors): their mean plus ``spread`` times their per-entry standard deviation
        (population) times a standard normal draw, one per new id and entry."""
        if known.numel() == 0:
            raise ValueError("init_fields needs at least one known field")
        std, mean = torch.std_mean(self.identity[known], dim=0, correction=0)  # (dim,) each
        noise = torch.randn(new.numel(), mean.numel()).to(mean)  # (K, dim), global generator
        self.identity[new] = mean + spread * std * noise
