"""Rollout error metrics following The Well's definitions, and their accumulation.

Every metric takes ``pred`` and ``truth`` shaped ``(..., C, *spatial)``, reduces over the
spatial axes only, and returns one value per field ``(..., C)``. ``n_spatial`` is the number of
trailing spatial axes; when omitted it is inferred as ``ndim - 2``, i.e. the tensors must then be
``(B, C, *spatial)`` with exactly one leading axis.

Definitions (mean over space written <.>):

- ``mse``    = <(pred - truth)^2>
- ``vrmse``  = sqrt(mse / (<(truth - <truth>)^2> + eps)), eps = 1e-7 as in The Well. 1.0 is as
  good as predicting the spatial mean; 0 is exact.
- ``nrmse``  = sqrt(mse / (<truth^2> + eps)), eps = 1e-7.
- ``spectral_error`` = mean over radial wavenumber shells k = 1..n_bins of
  (log10((P_pred(k) + f) / (P_truth(k) + f)))^2, the mean squared log10 error of the isotropic
  power spectrum. P(k) is the power of the modes whose normalised wavenumber
  |kappa| = sqrt(sum_i (2 f_i)^2) (f_i in cycles per grid cell, so |kappa| = 1 is Nyquist) rounds
  to k / n_bins; the mean (k = 0) and the corner modes beyond Nyquist are left out.
  ``n_bins`` defaults to half the smallest non-singleton grid size, i.e. one shell per integer
  wavenumber on a square grid. The floor f = 1e-8 * total truth power keeps shells where both
  spectra are (numerically) empty from counting. A prediction off by a factor a everywhere scores
  (2 log10 a)^2 in every shell that holds power.

Step windows: ``window_means`` averages per-step values over the windows 1, 2-10, 11-30, 31-60 and
61+ (1-based steps), and ``RolloutMetrics`` accumulates sums and counts, so that results gathered
across processes equal a single-process run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

EPS = 1e-7
SPECTRAL_FLOOR = 1e-8
METRICS = ("vrmse", "nrmse", "spectral")
SOURCES = ("model", "persistence")
WINDOWS: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 10), (11, 30), (31, 60), (61, None))


def _spatial_axes(pred: Tensor, truth: Tensor, n_spatial: int | None) -> tuple[int, ...]:
    """Validate shapes and return the trailing spatial axes."""
    if pred.shape != truth.shape:
        raise ValueError(f"pred shape {tuple(pred.shape)} != truth shape {tuple(truth.shape)}")
    if n_spatial is None:
        n_spatial = truth.ndim - 2
    if not 1 <= n_spatial <= 3 or truth.ndim < n_spatial + 1:
        raise ValueError(
            f"need (..., C, *spatial) with 1-3 spatial axes, got shape {tuple(truth.shape)} "
            f"and n_spatial={n_spatial}"
        )
    return tuple(range(-n_spatial, 0))


def mse(pred: Tensor, truth: Tensor, *, n_spatial: int | None = None) -> Tensor:
    """Mean squared error over space: ``(..., C, *spatial) -> (..., C)``."""
    axes = _spatial_axes(pred, truth, n_spatial)
    return (pred.float() - truth.float()).square().mean(dim=axes)


def vrmse(pred: Tensor, truth: Tensor, *, n_spatial: int | None = None, eps: float = EPS) -> Tensor:
    """Variance-scaled RMSE: ``sqrt(mse / (var(truth) + eps))``, ``(..., C, *sp) -> (..., C)``."""
    axes = _spatial_axes(pred, truth, n_spatial)
    var = truth.float().var(dim=axes, unbiased=False)  # (..., C)
    return (mse(pred, truth, n_spatial=len(axes)) / (var + eps)).sqrt()


def nrmse(pred: Tensor, truth: Tensor, *, n_spatial: int | None = None, eps: float = EPS) -> Tensor:
    """Norm-scaled RMSE: ``sqrt(mse / (mean(truth^2) + eps))``, ``(..., C, *sp) -> (..., C)``."""
    axes = _spatial_axes(pred, truth, n_spatial)
    norm = truth.float().square().mean(dim=axes)  # (..., C)
    return (mse(pred, truth, n_spatial=len(axes)) / (norm + eps)).sqrt()


def _default_bins(spatial: Sequence[int]) -> int:
    sizes = [n for n in spatial if n > 1]
    if not sizes:
        raise ValueError(f"spectral metrics need a spatial axis longer than 1, got {spatial}")
    return max(1, min(sizes) // 2)


def _shell_index(spatial: Sequence[int], n_bins: int, device: torch.device) -> Tensor:
    """Shell of every Fourier mode, flattened ``(prod(spatial),)`` long in ``[0, n_bins + 1]``."""
    grids = torch.meshgrid(
        *[2.0 * torch.fft.fftfreq(n, device=device, dtype=torch.float64) for n in spatial],
        indexing="ij",
    )
    kappa = torch.sqrt(sum(g.square() for g in grids))  # (*spatial,)
    shell = torch.round(kappa * n_bins).long().flatten()
    return shell.clamp(max=n_bins + 1)  # shells beyond Nyquist go to a discarded bin


def radial_power_spectrum(
    x: Tensor, *, n_spatial: int | None = None, n_bins: int | None = None
) -> Tensor:
    """Isotropic power spectrum over radial wavenumber shells 1..n_bins.

    Normalised so that the shells plus the mean and the corner modes sum to ``mean(x^2)``
    (Parseval). Computed in float64 where the device supports it.

    Args:
        x: ``(..., C, *spatial)``.
        n_spatial: number of spatial axes; inferred as ``x.ndim - 2`` when omitted.
        n_bins: number of shells; half the smallest non-singleton grid size by default.

    Returns:
        ``(..., C, n_bins)`` power per shell.
    """
    axes = _spatial_axes(x, x, n_spatial)
    spatial = x.shape[axes[0] :]
    n_bins = _default_bins(spatial) if n_bins is None else n_bins
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    dtype = torch.float32 if x.device.type == "mps" else torch.float64
    n_points = math.prod(spatial)
    coeffs = torch.fft.fftn(x.to(dtype), dim=axes)  # (..., C, *spatial) complex
    power = (coeffs.abs().square() / n_points**2).flatten(start_dim=axes[0])  # (..., C, N)
    shells = _shell_index(spatial, n_bins, x.device)  # (N,)
    out = power.new_zeros(*power.shape[:-1], n_bins + 2)  # (..., C, n_bins + 2)
    out.index_add_(-1, shells, power)
    return out[..., 1 : n_bins + 1]


def spectral_error(
    pred: Tensor,
    truth: Tensor,
    *,
    n_spatial: int | None = None,
    n_bins: int | None = None,
    floor: float = SPECTRAL_FLOOR,
) -> Tensor:
    """Mean squared log10 error of the radially binned power spectrum (see module docstring).

    Args:
        pred: ``(..., C, *spatial)``.
        truth: same shape.
        n_spatial: number of spatial axes; inferred as ``ndim - 2`` when omitted.
        n_bins: number of wavenumber shells; half the smallest grid size by default.
        floor: relative floor, as a fraction of the truth's total shell power.

    Returns:
        ``(..., C)`` float32.
    """
    _spatial_axes(pred, truth, n_spatial)
    p_pred = radial_power_spectrum(pred, n_spatial=n_spatial, n_bins=n_bins)  # (..., C, K)
    p_true = radial_power_spectrum(truth, n_spatial=n_spatial, n_bins=n_bins)  # (..., C, K)
    f = floor * p_true.sum(dim=-1, keepdim=True) + torch.finfo(p_true.dtype).tiny
    log_ratio = torch.log10((p_pred + f) / (p_true + f))  # (..., C, K)
    return log_ratio.square().mean(dim=-1).float()


def persistence(input_fields: Tensor, steps: int) -> Tensor:
    """Persistence baseline: the last input frame repeated.

    Args:
        input_fields: ``(B, T_in, C, *spatial)``.
        steps: number of predicted steps.

    Returns:
        ``(B, steps, C, *spatial)`` expanded view (no copy) of ``input_fields[:, -1]``.
    """
    if input_fields.ndim < 4:
        raise ValueError(
            f"input_fields must be (B, T, C, *spatial), got {tuple(input_fields.shape)}"
        )
    last = input_fields[:, -1:]  # (B, 1, C, *spatial)
    return last.expand(last.shape[0], steps, *last.shape[2:])


def _window_label(start: int, stop: int | None) -> str:
    if stop is None:
        return f"{start}+"
    return str(start) if start == stop else f"{start}-{stop}"


def window_means(
    per_step: Tensor, windows: Sequence[tuple[int, int | None]] = WINDOWS
) -> dict[str, Tensor]:
    """Average per-step values over windows of 1-based steps.

    Args:
        per_step: ``(steps, ...)``, row ``i`` holds step ``i + 1``.
        windows: inclusive ``(first, last)`` step pairs; ``last=None`` means to the end.

    Returns:
        ``{"1": (...), "2-10": (...), ...}``, only for windows that contain at least one step;
        a window cut short by the end averages the steps it has.
    """
    n_steps = per_step.shape[0]
    out: dict[str, Tensor] = {}
    for start, stop in windows:
        if start < 1 or (stop is not None and stop < start):
            raise ValueError(f"bad step window ({start}, {stop}); need 1 <= first <= last")
        if start > n_steps:
            continue
        end = n_steps if stop is None else min(stop, n_steps)
        out[_window_label(start, stop)] = per_step[start - 1 : end].mean(dim=0)
    return out


class RolloutMetrics:
    """Accumulates per-step VRMSE, NRMSE and spectral error of a model and of persistence.

    Values are averaged over samples at each step: sums and sample counts are kept in fixed-size
    float64 tensors, so merging or all-reducing the states of several processes gives the
    single-process result (up to float64 rounding).

    Args:
        field_names: the C field names.
        steps: the largest 1-based step that will be recorded.
        eps: VRMSE/NRMSE denominator epsilon.
        n_bins: spectral shells (default: half the smallest grid size).
        device: where the sums live (use the accelerator's device for NCCL all-reduce).
    """

    def __init__(
        self,
        field_names: Sequence[str],
        steps: int,
        *,
        eps: float = EPS,
        n_bins: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.field_names = [str(n) for n in field_names]
        if not self.field_names:
            raise ValueError("field_names must not be empty")
        self.steps = steps
        self.eps = eps
        self.n_bins = n_bins
        c = len(self.field_names)
        self.sum = torch.zeros(
            len(SOURCES), len(METRICS), steps, c, dtype=torch.float64, device=device
        )
        self.count = torch.zeros(steps, dtype=torch.float64, device=device)

    def _values(self, pred: Tensor, truth: Tensor) -> Tensor:
        """``(B, C, *sp)`` pair -> ``(len(METRICS), C)`` sums over the batch."""
        vals = torch.stack(
            [
                vrmse(pred, truth, eps=self.eps),
                nrmse(pred, truth, eps=self.eps),
                spectral_error(pred, truth, n_bins=self.n_bins),
            ]
        )  # (M, B, C)
        return vals.to(torch.float64).sum(dim=1).to(self.sum.device)

    @torch.no_grad()
    def update(self, step: int, pred: Tensor, truth: Tensor, last_input: Tensor) -> None:
        """Record one step for a batch of trajectories.

        Args:
            step: 1-based rollout step.
            pred: ``(B, C, *spatial)`` model prediction.
            truth: ``(B, C, *spatial)`` ground truth.
            last_input: ``(B, C, *spatial)`` last input frame (the persistence prediction).
        """
        if not 1 <= step <= self.steps:
            raise ValueError(f"step {step} outside 1..{self.steps}")
        if truth.ndim < 3 or truth.shape[1] != len(self.field_names):
            raise ValueError(
                f"truth must be (B, C={len(self.field_names)}, *spatial), got {tuple(truth.shape)}"
            )
        if last_input.shape != truth.shape:
            raise ValueError(
                f"last_input shape {tuple(last_input.shape)} != truth shape {tuple(truth.shape)}"
            )
        self.sum[0, :, step - 1] += self._values(pred, truth)
        self.sum[1, :, step - 1] += self._values(last_input, truth)
        self.count[step - 1] += truth.shape[0]

    def state(self) -> dict[str, Tensor]:
        """The tensors to merge or all-reduce: ``sum (2, 3, steps, C)``, ``count (steps,)``."""
        return {"sum": self.sum, "count": self.count}

    def merge(self, other: RolloutMetrics | Mapping[str, Tensor]) -> RolloutMetrics:
        """Add another accumulator (or its ``state()``) into this one, in place."""
        state = other.state() if isinstance(other, RolloutMetrics) else other
        if state["sum"].shape != self.sum.shape:
            raise ValueError(
                f"cannot merge metrics of shape {tuple(state['sum'].shape)} into {tuple(self.sum.shape)}"
            )
        self.sum += state["sum"].to(self.sum)
        self.count += state["count"].to(self.count)
        return self

    def all_reduce(self, group: Any = None) -> RolloutMetrics:
        """Sum the state over all processes of ``torch.distributed`` (no-op when not initialised)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(self.sum, group=group)
            torch.distributed.all_reduce(self.count, group=group)
        return self

    def per_step(self) -> Tensor:
        """Means ``(2, 3, S, C)`` over the S leading steps that have samples."""
        n = int((self.count > 0).sum())
        return (self.sum[:, :, :n] / self.count[:n, None]).cpu()

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary.

        Layout: ``{"fields", "steps", "count", "eps", "spectral_bins", "model": M,
        "persistence": M}`` with ``M[metric] = {"per_step": {field: [S]}, "windows": {field:
        {window: v}}, "mean_over_fields": {"per_step": [S], "windows": {window: v}}}``.
        """
        means = self.per_step()  # (2, 3, S, C)
        out: dict[str, Any] = {
            "fields": self.field_names,
            "steps": means.shape[2],
            "count": [int(c) for c in self.count[: means.shape[2]].tolist()],
            "eps": self.eps,
            "spectral_bins": self.n_bins if self.n_bins is not None else "auto",
        }
        for s, source in enumerate(SOURCES):
            out[source] = {}
            for m, metric in enumerate(METRICS):
                values = means[s, m]  # (S, C)
                field_mean = values.mean(dim=1)  # (S,)
                windows = window_means(values)
                out[source][metric] = {
                    "per_step": {f: values[:, c].tolist() for c, f in enumerate(self.field_names)},
                    "windows": {
                        f: {w: float(v[c]) for w, v in windows.items()}
                        for c, f in enumerate(self.field_names)
                    },
                    "mean_over_fields": {
                        "per_step": field_mean.tolist(),
                        "windows": {w: float(v) for w, v in window_means(field_mean).items()},
                    },
                }
        return out
