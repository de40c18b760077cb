"""Invertible normalisation of input windows and predicted frame deltas.

Both schemes reduce to one affine map per sample and field, held in ``NormStats``:
``x_n = (x - shift) / scale`` for states and ``d_n = d / delta_scale`` for frame deltas.

- ``RMSNormalizer`` (default, the Walrus scheme): per-sample RMS of the input window,
  and per-sample RMS of its frame-to-frame deltas. No file needed.
- ``ZScoreNormalizer``: global per-field mean/std (and delta std) from a dataset's
  ``stats.yaml``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class NormStats:
    """Per-sample, per-field affine statistics, each ``(B, 1, C, 1, ...)``."""

    shift: Tensor
    scale: Tensor
    delta_scale: Tensor

    def normalize(self, x: Tensor) -> Tensor:
        return (x - self.shift) / self.scale

    def denormalize(self, x: Tensor) -> Tensor:
        return x * self.scale + self.shift

    def normalize_delta(self, d: Tensor) -> Tensor:
        return d / self.delta_scale

    def denormalize_delta(self, d: Tensor) -> Tensor:
        return d * self.delta_scale


def _per_field(x: Tensor) -> tuple[int, ...]:
    """Reduction axes that leave (B, C): time and space of a (B, T, C, *spatial) tensor."""
    return (1, *range(3, x.ndim))


class RMSNormalizer:
    """Per-sample RMS normalisation of the input window (Walrus).

    Args:
        eps: floor added to every RMS so constant-zero fields stay finite.
    """

    def __init__(self, eps: float = 1e-4) -> None:
        self.eps = eps

    def fit(self, x: Tensor, field_names: Sequence[str] | None = None) -> NormStats:
        """Statistics of an input window ``x`` ``(B, T, C, *spatial)``."""
        dims = _per_field(x)
        xf = x.float()
        scale = xf.square().mean(dim=dims, keepdim=True).sqrt() + self.eps  # (B, 1, C, 1, ...)
        if x.shape[1] > 1:
            d = xf[:, 1:] - xf[:, :-1]  # (B, T-1, C, *spatial)
            delta_scale = d.square().mean(dim=dims, keepdim=True).sqrt() + self.eps
        else:
            delta_scale = scale
        return NormStats(shift=torch.zeros_like(scale), scale=scale, delta_scale=delta_scale)


class ZScoreNormalizer:
    """Global per-field z-score from ``stats.yaml`` entries ``mean``, ``std``, ``std_delta``.

    Args:
        stats: mapping with keys ``mean``, ``std`` and optionally ``std_delta``, each a
            mapping from field name to float.
        eps: floor added to every std.
    """

    def __init__(self, stats: Mapping[str, Mapping[str, float]], eps: float = 1e-6) -> None:
        for key in ("mean", "std"):
            if key not in stats:
                raise ValueError(f"normalisation stats lack the {key!r} section")
        self.stats = stats
        self.eps = eps

    def _vector(self, section: str, names: Sequence[str], like: Tensor) -> Tensor:
        table = self.stats.get(section) or self.stats["std"]
        missing = [n for n in names if n not in table]
        if missing:
            raise ValueError(f"normalisation stats section {section!r} has no entry for {missing}")
        return torch.tensor([float(table[n]) for n in names], dtype=torch.float32, device=like.device)

    def fit(self, x: Tensor, field_names: Sequence[str] | None = None) -> NormStats:
        if field_names is None or len(field_names) != x.shape[2]:
            raise ValueError("ZScoreNormalizer needs one field name per channel")
        view = (1, 1, x.shape[2]) + (1,) * (x.ndim - 3)
        b = x.shape[0]
        mean = self._vector("mean", field_names, x).view(view).expand(b, *view[1:])
        std = self._vector("std", field_names, x).view(view).expand(b, *view[1:]) + self.eps
        dstd = self._vector("std_delta", field_names, x).view(view).expand(b, *view[1:]) + self.eps
        return NormStats(shift=mean, scale=std, delta_scale=dstd)
