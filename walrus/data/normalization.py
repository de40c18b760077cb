"""Invertible normalisation of input windows and predicted frame deltas.

Every scheme reduces to one affine map per sample and field, held in ``NormStats``:
``x_n = (x - shift) / scale`` for states and ``d_n = (d - delta_shift) / delta_scale`` for
frame deltas.

- ``RMSNormalizer`` (default): per-sample RMS of the input window, and per-sample RMS of its
  frame-to-frame deltas. No file needed.
- ``MeanStdNormalizer``: per-sample mean/std of the window and of its deltas (what the official
  Walrus training used; converted official checkpoints select it).
- ``ZScoreNormalizer``: global per-field mean/std (and delta std) from a dataset's
  ``stats.yaml``.

Each normaliser's ``config()`` is a plain dict stored in checkpoints; ``build_normalizer``
rebuilds it (only the classes of this module).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class NormStats:
    """Per-sample, per-field affine statistics, each ``(B, 1, C, 1, ...)``."""

    shift: Tensor
    scale: Tensor
    delta_scale: Tensor
    delta_shift: Tensor | float = 0.0

    def normalize(self, x: Tensor) -> Tensor:
        return (x - self.shift) / self.scale

    def denormalize(self, x: Tensor) -> Tensor:
        return x * self.scale + self.shift

    def normalize_delta(self, d: Tensor) -> Tensor:
        return (d - self.delta_shift) / self.delta_scale

    def denormalize_delta(self, d: Tensor) -> Tensor:
        return d * self.delta_scale + self.delta_shift

    def next_frame(self, last: Tensor, pred: Tensor, predict_delta: bool) -> Tensor:
        """The physical frame a normalised model output ``pred`` stands for.

        Args:
            last: ``(B, 1, C, *spatial)`` last input frame, physical units.
            pred: ``(B, 1, C, *spatial)`` normalised output: the delta from ``last``
                (``predict_delta``) or the next frame itself.

        Returns:
            ``(B, 1, C, *spatial)`` next frame in physical units.
        """
        if predict_delta:
            return last + self.denormalize_delta(pred)
        return self.denormalize(pred)


def _per_field(x: Tensor) -> tuple[int, ...]:
    """Reduction axes that leave (B, C): time and space of a (B, T, C, *spatial) tensor."""
    return (1, *range(3, x.ndim))


DELTA_UNITS = ("window", "state")


def _check_eps(eps: Any, owner: str) -> float:
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < float("inf"):
        raise ValueError(f"{owner} eps must be a positive number, got {eps!r}")
    return float(eps)


def _check_stats(stats: Any) -> None:
    if not isinstance(stats, Mapping):
        raise ValueError(
            f"normalisation stats must be a mapping of sections, got {type(stats).__name__}"
        )
    for section, table in stats.items():
        if not isinstance(table, Mapping):
            raise ValueError(
                f"normalisation stats section {section!r} must map field names to numbers"
            )
        for name, value in table.items():
            if (
                not isinstance(name, str)
                or isinstance(value, bool)
                or not isinstance(value, int | float)
            ):
                raise ValueError(
                    f"normalisation stats section {section!r} entry {name!r} must be a number, "
                    f"got {type(value).__name__}"
                )


class RMSNormalizer:
    """Per-sample RMS normalisation of the input window (Walrus).

    Args:
        eps: floor added to every RMS so constant-zero fields stay finite.
        delta: unit of the predicted frame deltas. ``"window"``: the RMS of the window's own
            frame-to-frame deltas (Walrus). In a rollout the window soon holds the model's own
            predictions, so an error in their size feeds back into the unit of the next
            prediction, and the size error compounds step after step (rollouts freeze or blow
            up). ``"state"``: the RMS of the window's values, which errors barely move; the
            model then predicts how large the change is.
    """

    def __init__(self, eps: float = 1e-4, delta: str = "window") -> None:
        if delta not in DELTA_UNITS:
            raise ValueError(f"RMSNormalizer delta must be one of {DELTA_UNITS}, got {delta!r}")
        self.eps = _check_eps(eps, "RMSNormalizer")
        self.delta = delta

    def fit(self, x: Tensor, field_names: Sequence[str] | None = None) -> NormStats:
        """Statistics of an input window ``x`` ``(B, T, C, *spatial)``."""
        dims = _per_field(x)
        xf = x.float()
        scale = xf.square().mean(dim=dims, keepdim=True).sqrt() + self.eps  # (B, 1, C, 1, ...)
        if self.delta == "state":
            return NormStats(shift=torch.zeros_like(scale), scale=scale, delta_scale=scale)
        if x.shape[1] > 1:
            d = xf[:, 1:] - xf[:, :-1]  # (B, T-1, C, *spatial)
            delta_scale = d.square().mean(dim=dims, keepdim=True).sqrt() + self.eps
        else:
            delta_scale = scale
        return NormStats(shift=torch.zeros_like(scale), scale=scale, delta_scale=delta_scale)

    def config(self) -> dict[str, Any]:
        return {"_target_": f"{__name__}.RMSNormalizer", "eps": self.eps, "delta": self.delta}


class MeanStdNormalizer:
    """Per-sample mean/std of the input window and of its frame deltas (official Walrus).

    ``x_n = (x - mean) / (std + eps)``; ``d_n = (d - mean_d) / (std_d + eps)`` with ``mean_d``,
    ``std_d`` over the window's frame-to-frame deltas (the window's own statistics for T = 1).

    Args:
        eps: added to every std.
    """

    def __init__(self, eps: float = 1e-4) -> None:
        self.eps = _check_eps(eps, "MeanStdNormalizer")

    def fit(self, x: Tensor, field_names: Sequence[str] | None = None) -> NormStats:
        """Statistics of an input window ``x`` ``(B, T, C, *spatial)``."""
        dims = _per_field(x)
        xf = x.float()
        std, mean = torch.std_mean(xf, dim=dims, keepdim=True, correction=0)  # (B, 1, C, 1, ...)
        if x.shape[1] > 1:
            d = xf[:, 1:] - xf[:, :-1]  # (B, T-1, C, *spatial)
            d_std, d_mean = torch.std_mean(d, dim=dims, keepdim=True, correction=0)
        else:
            d_std, d_mean = std, torch.zeros_like(mean)
        return NormStats(
            shift=mean, scale=std + self.eps, delta_scale=d_std + self.eps, delta_shift=d_mean
        )

    def config(self) -> dict[str, Any]:
        return {"_target_": f"{__name__}.MeanStdNormalizer", "eps": self.eps}


class ZScoreNormalizer:
    """Global per-field z-score from ``stats.yaml`` entries ``mean``, ``std``, ``std_delta``.

    Args:
        stats: mapping with keys ``mean``, ``std`` and optionally ``std_delta``, each a
            mapping from field name to float.
        eps: floor added to every std.
    """

    def __init__(self, stats: Mapping[str, Mapping[str, float]], eps: float = 1e-6) -> None:
        _check_stats(stats)
        for key in ("mean", "std"):
            if key not in stats:
                raise ValueError(f"normalisation stats lack the {key!r} section")
        self.stats = stats
        self.eps = _check_eps(eps, "ZScoreNormalizer")

    def _vector(self, section: str, names: Sequence[str], like: Tensor) -> Tensor:
        table = self.stats.get(section) or self.stats["std"]
        missing = [n for n in names if n not in table]
        if missing:
            raise ValueError(f"normalisation stats section {section!r} has no entry for {missing}")
        return torch.tensor(
            [float(table[n]) for n in names], dtype=torch.float32, device=like.device
        )

    def fit(self, x: Tensor, field_names: Sequence[str] | None = None) -> NormStats:
        if field_names is None or len(field_names) != x.shape[2]:
            raise ValueError("ZScoreNormalizer needs one field name per channel")
        view = (1, 1, x.shape[2]) + (1,) * (x.ndim - 3)
        b = x.shape[0]
        mean = self._vector("mean", field_names, x).view(view).expand(b, *view[1:])
        std = self._vector("std", field_names, x).view(view).expand(b, *view[1:]) + self.eps
        dstd = self._vector("std_delta", field_names, x).view(view).expand(b, *view[1:]) + self.eps
        return NormStats(shift=mean, scale=std, delta_scale=dstd)

    def config(self) -> dict[str, Any]:
        stats = {k: dict(v) for k, v in self.stats.items() if isinstance(v, Mapping)}
        return {"_target_": f"{__name__}.ZScoreNormalizer", "stats": stats, "eps": self.eps}


# Any of the normalisers above (each has ``fit(x, field_names) -> NormStats`` and ``config()``).
Normalizer = RMSNormalizer | MeanStdNormalizer | ZScoreNormalizer

NORMALIZERS = {
    f"{__name__}.{cls.__name__}": cls
    for cls in (RMSNormalizer, MeanStdNormalizer, ZScoreNormalizer)
}


def build_normalizer(config: Mapping[str, Any] | None) -> Normalizer:
    """Rebuild a normaliser from its ``config()``; ``None`` gives the default ``RMSNormalizer``."""
    if not config:
        return RMSNormalizer()
    kwargs = dict(config)
    target = kwargs.pop("_target_", None)
    if target not in NORMALIZERS:
        raise ValueError(f"unknown normaliser {target!r}; known: {sorted(NORMALIZERS)}")
    cls = NORMALIZERS[target]
    known = set(inspect.signature(cls).parameters)
    unknown = sorted(str(k) for k in kwargs if k not in known)
    if unknown:
        raise ValueError(
            f"normaliser {target!r} has no option(s) {unknown}; known: {sorted(known)}"
        )
    return cls(**kwargs)
