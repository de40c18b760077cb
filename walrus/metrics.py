"""Rollout error metrics with The Well's definitions, and their accumulation.

Every metric takes ``pred`` and ``truth`` shaped ``(..., C, *spatial)``, reduces over the
spatial axes only, and returns one value per field ``(..., C)`` (the binned spectral MSE adds a
trailing bin axis). ``n_spatial`` is the number of trailing spatial axes; when omitted it is
inferred as ``ndim - 2``, i.e. the tensors must then be ``(B, C, *spatial)`` with exactly one
leading axis. Values are computed in float64 for float64 inputs, else in float32.

Definitions, matching The Well's benchmark package (``the_well.benchmark.metrics``, tested
against it to 1e-6). Mean over the N grid points written <.>, eps = 1e-7:

- ``mse``    = <(pred - truth)^2>
- ``vrmse``  = sqrt(mse / (std(truth)^2 + eps)), std the unbiased (N - 1) standard deviation
  over space, as ``torch.std``. 1.0 is about as good as predicting the spatial mean; 0 is exact.
- ``nrmse``  = sqrt(mse / (<truth^2> + eps)).
- ``binned_spectral_mse`` = per wavenumber bin b, the residual power over the true power,
  ``sum_{k in b} |F(pred - truth)_k|^2 / (sum_{k in b} |F(truth)_k|^2 + eps * N^2)``
  (F the unnormalised DFT; with Parseval, numerator and denominator are the bin's share of the
  mse and of <truth^2>, and the eps is on that scale). The bins split the isotropic angular
  wavenumber |k| = sqrt(sum_i (2 pi f_i)^2) (f_i in cycles per grid cell, so |k| runs from 0
  to pi sqrt(d) in d dimensions) at edges 0 < e1 < e2 < e3, with e1, e2 log-spaced between
  2 pi / max(grid) and e3 = pi sqrt(d) + 1e-6: "low" is [0, e1) (it holds the mean),
  "mid" [e1, e2), "high" [e2, e3). 0 is exact, 1 is as bad as predicting zero in that band.
  Bin membership is decided in float32 on the CPU, as The Well decides it, so that modes lying
  on an edge (on 32^2 or 256^2 grids, for instance) land in the same bin.

Physical fidelity (``FIDELITY``; 1 is ideal for all three, none is an error):

- ``amplitude_ratio`` = RMS of pred about its spatial mean over that of truth (the ratio of
  the population standard deviations over space): above 1 the prediction is too energetic.
- ``change_correlation`` = Pearson correlation over space of the predicted and the true change
  from the previous frame, pred[t] - pred[t-1] against truth[t] - truth[t-1] (at step 1 both use
  the last input frame as t-1): whether the prediction moves the way the truth moves.
- ``binned_power_ratio`` = per wavenumber bin (the bins above), predicted power over true power
  (not residual power): below 1 the prediction is too smooth in that band, above 1 too noisy.

Negligible true power (``NEGLIGIBLE_POWER``): a ratio over a power the truth barely has says
nothing (on band-limited data an empty band's spectral MSE read 1520). So a per-sample value is
undefined (NaN here, ``null`` in ``RolloutMetrics.to_dict``) when its truth power is at most
``NEGLIGIBLE_POWER`` times the truth's fluctuation power at that step (its total power less the
mean mode's, i.e. its population variance over space; the mean is left out so that an offset
such as a background pressure cannot hide a band). This applies to both spectral measures per
bin (the bin's true power, which for "low" includes the mean mode), to the change correlation
(the true change's variance; it is also undefined when the predicted change is exactly zero, as
persistence's is). The amplitude ratio is undefined only where the truth is flat in space to
the precision of its dtype (standard deviation at most one machine epsilon of its RMS), so that
small fluctuations on a large offset keep their amplitude ratio.

Step windows: ``step_windows`` gives the windows 1, 2-10, 11-30, 31-60 and 61+ (1-based steps)
of a rollout, labelled by the steps that ran ("11-16" for 16 steps; windows past the end are
left out), and ``RolloutMetrics`` accumulates sums and counts of every metric (``METRICS``: VRMSE,
NRMSE and the three spectral bins; ``FIDELITY``), so that results gathered across processes
equal a single-process run. For an ensemble it also accumulates the members' spread in the
units of each error metric (``SPREAD``), the width of the uncertainty band drawn around the
model's curve. Fields whose truth is constant in space and time over the rollout are named in
``constant_fields`` and left out of every mean over fields.

Spatial-mean reference (``SPATIAL_MEAN``): the error metrics of predicting each true frame's own
spatial mean everywhere. Its VRMSE is sqrt((N - 1) / N), just under 1, on every frame; a model
above it does worse than a flat field at the right level. Its NRMSE and spectral MSE vary.

Ensemble scores (``members=K >= 2`` and ``update(..., members=...)``), per field and step, over
the K members ``x_1..x_K`` at every grid point (``ensemble_scores`` for one batch):

- ``spread_skill`` = sqrt((K + 1) / K) * sqrt(<var>) / sqrt(<(mean - truth)^2>), var the
  unbiased (K - 1) variance over members and <.> the mean over grid points and samples (per
  window: of the window's steps). The factor corrects for the finite ensemble: a K-member
  ensemble drawn from the same distribution as the truth scores 1 in expectation; below 1 the
  ensemble is too sure of itself, above 1 too unsure.
- ``crps`` = the fair CRPS of the members at each grid point (``scoringrules.crps_ensemble``,
  ``CRPS_ESTIMATOR``, whose expectation does not depend on K), averaged over the grid and divided
  by the truth's spatial standard deviation sqrt(std(truth)^2 + eps), as VRMSE is, so fields
  can be averaged. 0 is exact; a single deterministic forecast's CRPS is its mean absolute error.
- ``rank_histogram`` = how often the truth falls at rank r = 0..K among the members (r members
  below it), as fractions of the grid points; a tie spreads its point evenly over the ranks it
  could take. Flat (each 1 / (K + 1)) is calibrated, U-shaped too sure, a hump too unsure;
  ``rank_max_over_flat`` is the largest bin over the flat level.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

EPS = 1e-7
SPECTRAL_BINS = ("low", "mid", "high")
METRICS = ("vrmse", "nrmse", *(f"spectral_{b}" for b in SPECTRAL_BINS))
FIDELITY = (
    "amplitude_ratio",
    "change_correlation",
    *(f"power_ratio_{b}" for b in SPECTRAL_BINS),
)
ALL_METRICS = METRICS + FIDELITY
METRIC_LABELS = {
    "vrmse": "VRMSE",
    "nrmse": "NRMSE",
    **{f"spectral_{b}": f"spectral MSE, {b} k" for b in SPECTRAL_BINS},
    "amplitude_ratio": "amplitude ratio",
    "change_correlation": "change correlation",
    **{f"power_ratio_{b}": f"power ratio, {b} k" for b in SPECTRAL_BINS},
}
# A truth power at most this fraction of the truth's fluctuation power is negligible: the
# ratios over it are reported as undefined (see the module docstring). One threshold for the
# spectral MSE and the fidelity measures.
NEGLIGIBLE_POWER = 1e-6
SOURCES = ("model", "persistence")
# An ensemble's spread, in each metric's units: the metric of (truth + spread) against truth,
# e.g. sqrt(<spread^2> / std(truth)^2) for VRMSE. Recorded only for ensembles.
SPREAD = "spread"
# The reference of predicting each true frame's spatial mean (error metrics only).
SPATIAL_MEAN = "spatial_mean"
# The key of the ensemble scores in RolloutMetrics.to_dict() (ensembles of 2 or more members).
ENSEMBLE = "ensemble"
# scoringrules' CRPS estimator: the probability-weighted-moment form of the fair CRPS (equal to
# the "fair" estimator, in O(K log K) instead of O(K^2) memory).
CRPS_ESTIMATOR = "pwm"
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


def _work_dtype(*xs: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def mse(pred: Tensor, truth: Tensor, *, n_spatial: int | None = None) -> Tensor:
    """Mean squared error over space: ``(..., C, *spatial) -> (..., C)``."""
    axes = _spatial_axes(pred, truth, n_spatial)
    dtype = _work_dtype(pred, truth)
    return (pred.to(dtype) - truth.to(dtype)).square().mean(dim=axes)


def vrmse(pred: Tensor, truth: Tensor, *, n_spatial: int | None = None, eps: float = EPS) -> Tensor:
    """Variance-scaled RMSE, ``sqrt(mse / (var(truth) + eps))`` with the unbiased variance.

    ``(..., C, *spatial) -> (..., C)``. Needs at least 2 grid points.
    """
    axes = _spatial_axes(pred, truth, n_spatial)
    if math.prod(truth.shape[axes[0] :]) < 2:
        raise ValueError(f"vrmse needs at least 2 grid points, got shape {tuple(truth.shape)}")
    var = truth.to(_work_dtype(pred, truth)).var(dim=axes, correction=1)  # (..., C)
    return (mse(pred, truth, n_spatial=len(axes)) / (var + eps)).sqrt()


def nrmse(pred: Tensor, truth: Tensor, *, n_spatial: int | None = None, eps: float = EPS) -> Tensor:
    """Norm-scaled RMSE: ``sqrt(mse / (mean(truth^2) + eps))``, ``(..., C, *sp) -> (..., C)``."""
    axes = _spatial_axes(pred, truth, n_spatial)
    norm = truth.to(_work_dtype(pred, truth)).square().mean(dim=axes)  # (..., C)
    return (mse(pred, truth, n_spatial=len(axes)) / (norm + eps)).sqrt()


def spectral_bin_edges(spatial: Sequence[int]) -> Tensor:
    """Edges ``(0, e1, e2, e3)`` of the three wavenumber bins of a grid, in radians per cell.

    ``(4,)`` float32; see the module docstring.
    """
    spatial = tuple(int(n) for n in spatial)
    if not 1 <= len(spatial) <= 3 or min(spatial) < 1:
        raise ValueError(f"need a grid of 1-3 axes of positive sizes, got {spatial}")
    lowest = math.log10(2 * math.pi / max(spatial))
    top = math.log10(math.pi * math.sqrt(len(spatial)) + 1e-6)
    edges = torch.logspace(lowest, top, len(SPECTRAL_BINS) + 1, dtype=torch.float32)
    edges[0] = 0.0
    return edges


@functools.lru_cache(maxsize=32)
def _bin_index(spatial: tuple[int, ...]) -> Tensor:
    """Bin of every Fourier mode of the grid, flattened ``(prod(spatial),)`` long in 0..3.

    Bin 3 (at or beyond the top edge) is discarded by the caller. Computed in float32 on the CPU.
    """
    sq = torch.zeros(spatial, dtype=torch.float32)  # (*spatial,) squared |k|, summed axis by axis
    for i, n in enumerate(spatial):
        # (n,) angular wavenumber in radians per cell
        k = 2 * math.pi * torch.fft.fftfreq(n, dtype=torch.float32)
        sq = sq + k.reshape([n if j == i else 1 for j in range(len(spatial))]).square()
    edges = spectral_bin_edges(spatial)
    return torch.bucketize(sq.sqrt().flatten(), edges, right=True) - 1


def binned_spectral_mse(
    pred: Tensor, truth: Tensor, *, n_spatial: int | None = None, eps: float = EPS
) -> Tensor:
    """Residual power over true power in the low, mid and high wavenumber bins.

    See the module docstring for the definition and the bin edges. The FFTs run in float64
    (float32 on MPS, which has no float64).

    Args:
        pred: ``(..., C, *spatial)``.
        truth: same shape.
        n_spatial: number of spatial axes; inferred as ``ndim - 2`` when omitted.
        eps: added to the true power of each bin, in units of ``mean(truth^2)``.

    Returns:
        ``(..., C, 3)``, bins in ``SPECTRAL_BINS`` order; float64 for float64 inputs, else float32.
    """
    axes = _spatial_axes(pred, truth, n_spatial)
    fft_dtype = _precise_dtype(truth)
    truth64 = truth.to(fft_dtype)
    residual = _binned_power(pred.to(fft_dtype) - truth64, axes)  # (..., C, 3)
    out = residual / (_binned_power(truth64, axes) + eps)
    return out.to(_work_dtype(pred, truth))


def _binned_power(x: Tensor, axes: tuple[int, ...]) -> Tensor:
    """Fourier power of ``x (..., C, *spatial)`` summed per bin, ``(..., C, 3)``.

    Normalised so that the sum over all modes is ``mean(x^2)`` (Parseval).
    """
    spatial = tuple(x.shape[axes[0] :])
    coeffs = torch.fft.fftn(x, dim=axes)  # (..., C, *spatial) complex
    power = coeffs.abs().square().flatten(start_dim=axes[0]) / math.prod(spatial) ** 2
    # power: (..., C, N)
    index = _bin_index(spatial).to(x.device)  # (N,)
    binned = power.new_zeros(*power.shape[:-1], len(SPECTRAL_BINS) + 1)  # (..., C, 4)
    binned.index_add_(-1, index, power)  # the last bin, beyond the top edge, is dropped
    return binned[..., :-1]


def _precise_dtype(x: Tensor) -> torch.dtype:
    """float64 for FFTs and ratios, float32 on MPS (which has no float64)."""
    return torch.float32 if x.device.type == "mps" else torch.float64


def _fluctuation_power(x: Tensor, axes: tuple[int, ...]) -> Tensor:
    """Population variance over space, ``(..., C, *sp) -> (..., C)``: total power less the mean's."""
    return x.var(dim=axes, correction=0)


def negligible_bins(truth: Tensor, *, n_spatial: int | None = None) -> Tensor:
    """Which wavenumber bins hold negligible true power (see ``NEGLIGIBLE_POWER``).

    ``truth (..., C, *spatial) -> (..., C, 3)`` bool, bins in ``SPECTRAL_BINS`` order.
    """
    axes = _spatial_axes(truth, truth, n_spatial)
    t = truth.to(_precise_dtype(truth))
    floor = NEGLIGIBLE_POWER * _fluctuation_power(t, axes)  # (..., C)
    return _binned_power(t, axes) <= floor.unsqueeze(-1)


def binned_power_ratio(pred: Tensor, truth: Tensor, *, n_spatial: int | None = None) -> Tensor:
    """Predicted over true Fourier power in each wavenumber bin (not the residual's power).

    ``(..., C, *spatial) -> (..., C, 3)``, bins in ``SPECTRAL_BINS`` order; NaN where the truth's
    power in the bin is negligible (``negligible_bins``). float64, or float32 on MPS.
    """
    axes = _spatial_axes(pred, truth, n_spatial)
    dtype = _precise_dtype(truth)
    t = truth.to(dtype)
    true_power = _binned_power(t, axes)  # (..., C, 3)
    ratio = _binned_power(pred.to(dtype), axes) / true_power
    floor = NEGLIGIBLE_POWER * _fluctuation_power(t, axes)  # (..., C)
    return ratio.masked_fill(true_power <= floor.unsqueeze(-1), math.nan)


def amplitude_ratio(pred: Tensor, truth: Tensor, *, n_spatial: int | None = None) -> Tensor:
    """RMS about the spatial mean, prediction over truth: ``(..., C, *sp) -> (..., C)``.

    NaN where the truth is flat in space to the precision of its dtype (standard deviation at
    most one machine epsilon of its RMS).
    """
    axes = _spatial_axes(pred, truth, n_spatial)
    t = truth.to(_precise_dtype(truth))
    var_t = _fluctuation_power(t, axes)  # (..., C)
    ratio = (_fluctuation_power(pred.to(t.dtype), axes) / var_t).sqrt()
    flat = var_t <= torch.finfo(truth.dtype).eps ** 2 * t.square().mean(dim=axes)
    return ratio.masked_fill(flat, math.nan)


def change_correlation(
    pred: Tensor,
    truth: Tensor,
    prev_pred: Tensor,
    prev_truth: Tensor,
    *,
    n_spatial: int | None = None,
) -> Tensor:
    """Correlation over space of the predicted and the true change from the previous frame.

    Pearson correlation of ``pred - prev_pred`` and ``truth - prev_truth`` over the spatial
    axes, all four ``(..., C, *spatial)``; returns ``(..., C)`` (float64 off MPS). NaN where the predicted
    change is exactly zero (persistence) or the true change's variance is at most
    ``NEGLIGIBLE_POWER`` times the truth's.
    """
    axes = _spatial_axes(pred, truth, n_spatial)
    for name, x in (("prev_pred", prev_pred), ("prev_truth", prev_truth)):
        if x.shape != truth.shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} != truth shape {tuple(truth.shape)}")
    dtype = _precise_dtype(truth)
    dp = pred.to(dtype) - prev_pred.to(dtype)  # (..., C, *sp)
    dt = truth.to(dtype) - prev_truth.to(dtype)
    dp = dp - dp.mean(dim=axes, keepdim=True)
    dt = dt - dt.mean(dim=axes, keepdim=True)
    var_p, var_t = dp.square().mean(dim=axes), dt.square().mean(dim=axes)  # (..., C)
    corr = (dp * dt).mean(dim=axes) / (var_p * var_t).sqrt()
    still = var_p == 0  # no predicted change at all
    quiet = var_t <= NEGLIGIBLE_POWER * _fluctuation_power(truth.to(dtype), axes)
    return corr.masked_fill(still | quiet, math.nan)


def _check_members(members: Tensor, truth: Tensor, n_spatial: int | None) -> tuple[int, ...]:
    """Validate ``members (K, ..., C, *sp)`` against ``truth (..., C, *sp)``; the spatial axes of
    ``truth``."""
    axes = _spatial_axes(truth, truth, n_spatial)
    if members.ndim != truth.ndim + 1 or members.shape[1:] != truth.shape:
        raise ValueError(
            f"members must be (K, *truth.shape) = (K, {', '.join(map(str, truth.shape))}), got "
            f"{tuple(members.shape)}"
        )
    if members.shape[0] < 2:
        raise ValueError(f"ensemble scores need at least 2 members, got {members.shape[0]}")
    return axes


def spread_skill_ratio(variance: Tensor, mse_of_mean: Tensor, members: int) -> Tensor:
    """The corrected spread-skill ratio ``sqrt((K + 1) / K) * sqrt(variance / mse_of_mean)``.

    Args:
        variance: the members' unbiased variance, averaged over whatever is pooled (grid
            points, samples, steps); any shape.
        mse_of_mean: the ensemble mean's squared error, averaged over the same; same shape.
        members: K (>= 2).

    Returns:
        Same shape; NaN where the mean is exact (``mse_of_mean == 0``).
    """
    if members < 2:
        raise ValueError(f"the spread-skill ratio needs at least 2 members, got {members}")
    ratio = (variance / mse_of_mean.masked_fill(mse_of_mean == 0, math.nan)).sqrt()
    return math.sqrt((members + 1) / members) * ratio


def ensemble_scores(
    members: Tensor, truth: Tensor, *, n_spatial: int | None = None, eps: float = EPS
) -> dict[str, Tensor]:
    """Ensemble scores of one frame per sample (see the module docstring), float64.

    Args:
        members: ``(K, ..., C, *spatial)``, K >= 2 ensemble members.
        truth: ``(..., C, *spatial)``.
        n_spatial: number of spatial axes; inferred as ``truth.ndim - 2`` when omitted.
        eps: added to the truth's spatial variance in the CRPS's scale, as for ``vrmse``.

    Returns:
        ``"variance"`` ``(..., C)``: the members' unbiased variance, mean over the grid;
        ``"mse"`` ``(..., C)``: the ensemble mean's squared error, mean over the grid;
        ``"spread_skill"`` ``(..., C)``: ``spread_skill_ratio`` of those two (one frame);
        ``"crps"`` ``(..., C)``: the fair CRPS over the grid, over the truth's standard deviation;
        ``"rank_counts"`` ``(..., C, K + 1)``: grid points with the truth at rank 0..K (ties
        spread evenly over the ranks they could take, so counts can be fractional).
    """
    import scoringrules  # on first use: importing it takes about half a second

    axes = _check_members(members, truth, n_spatial)
    k = members.shape[0]
    m = members.to(torch.float64)
    t = truth.to(torch.float64)
    variance = m.var(dim=0, correction=1).mean(dim=axes)  # (..., C)
    err = mse(m.mean(dim=0), t, n_spatial=len(axes))  # (..., C)
    # scoringrules' torch backend builds CPU tensors inside: score on the CPU
    crps = scoringrules.crps_ensemble(
        t.cpu(), m.cpu(), m_axis=0, estimator=CRPS_ESTIMATOR, backend="torch"
    )  # (..., C, *spatial)
    scale = (t.var(dim=axes, correction=1) + eps).sqrt().cpu()  # (..., C)
    below = (m < t).sum(dim=0).flatten(start_dim=axes[0])  # (..., C, N) members under the truth
    ties = (m == t).sum(dim=0).flatten(start_dim=axes[0])  # (..., C, N) members equal to it
    return {
        "variance": variance,
        "mse": err,
        "spread_skill": spread_skill_ratio(variance, err, k),
        "crps": (crps.mean(dim=axes) / scale).to(t.device),
        "rank_counts": _rank_counts(below, ties, k),
    }


def _rank_counts(below: Tensor, ties: Tensor, members: int) -> Tensor:
    """Grid points per rank from ``below``/``ties`` ``(..., C, N)`` (members under / equal to
    the truth at each point): ``(..., C, K + 1)``, a tie's point split evenly over ranks
    ``below .. below + ties``."""
    weight = 1.0 / (ties.to(torch.float64) + 1)  # (..., C, N)
    diff = weight.new_zeros(*below.shape[:-1], members + 2)  # (..., C, K + 2)
    diff.scatter_add_(-1, below, weight)
    diff.scatter_add_(-1, below + ties + 1, -weight)
    return diff.cumsum(dim=-1)[..., : members + 1]


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


def _clipped_windows(
    n_steps: int, windows: Sequence[tuple[int, int | None]]
) -> list[tuple[int, int | None, int]]:
    """``(first, nominal last, last step that ran)`` of each window holding one of ``n_steps``."""
    out = []
    for start, stop in windows:
        if start < 1 or (stop is not None and stop < start):
            raise ValueError(f"bad step window ({start}, {stop}); need 1 <= first <= last")
        if start <= n_steps:
            out.append((start, stop, n_steps if stop is None else min(stop, n_steps)))
    return out


def step_windows(
    n_steps: int, windows: Sequence[tuple[int, int | None]] = WINDOWS
) -> dict[str, tuple[int, int]]:
    """The windows that hold at least one of ``n_steps`` steps, labelled by the steps that ran.

    Returns:
        label -> inclusive 1-based ``(first, last)``: for 16 steps ``{"1": (1, 1), "2-10":
        (2, 10), "11-16": (11, 16)}``.
    """
    return {
        (str(a) if a == end else f"{a}-{end}"): (a, end)
        for a, _, end in _clipped_windows(n_steps, windows)
    }


def window_means(
    per_step: Tensor, windows: Sequence[tuple[int, int | None]] = WINDOWS
) -> dict[str, Tensor]:
    """Average per-step values over windows of 1-based steps, under the windows' nominal labels.

    The labels name the nominal windows (``"11-30"`` even if the steps end at 16), so that tables
    of rollouts of different lengths line up; ``step_windows`` labels the steps that ran.

    Args:
        per_step: ``(steps, ...)``, row ``i`` holds step ``i + 1``.
        windows: inclusive ``(first, last)`` step pairs; ``last=None`` means to the end.

    Returns:
        ``{"1": (...), "2-10": (...), ...}``, only for windows that contain at least one step;
        a window cut short by the end averages the steps it has.
    """
    return {
        (f"{a}+" if stop is None else str(a) if a == stop else f"{a}-{stop}"): per_step[
            a - 1 : end
        ].mean(dim=0)
        for a, stop, end in _clipped_windows(per_step.shape[0], windows)
    }


def _num(x: float) -> float | None:
    """A JSON value: NaN (undefined) becomes ``None``."""
    x = float(x)
    return None if math.isnan(x) else x


class RolloutMetrics:
    """Accumulates per-step errors (``METRICS``) and fidelity measures (``FIDELITY``) of a model
    and of persistence, the errors of the spatial-mean reference (``SPATIAL_MEAN``) and, for an
    ensemble, its spread and scores (``ensemble_scores``).

    Values are averaged at each step over the samples in which they are defined (see
    ``NEGLIGIBLE_POWER``): sums and counts are kept in fixed-size float64 tensors, so merging or
    all-reducing the states of several processes gives the single-process result (up to
    float64 rounding). One accumulator serves one grid.

    Args:
        field_names: the C field names.
        steps: the largest 1-based step that will be recorded.
        eps: denominator epsilon of the error metrics.
        device: where the sums live (use the accelerator's device for NCCL all-reduce).
        members: the ensemble size K; from 2 on, ``update`` takes the members and the
            ensemble scores are accumulated.
    """

    def __init__(
        self,
        field_names: Sequence[str],
        steps: int,
        *,
        eps: float = EPS,
        device: torch.device | str = "cpu",
        members: int = 1,
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if isinstance(members, bool) or not isinstance(members, int) or members < 1:
            raise ValueError(f"members must be an int >= 1, got {members!r}")
        self.members = members
        self.field_names = [str(n) for n in field_names]
        if not self.field_names:
            raise ValueError("field_names must not be empty")
        self.steps = steps
        self.eps = eps
        self.grid: tuple[int, ...] | None = None
        c = len(self.field_names)
        # sources: model, persistence, spread, spatial mean (the last two: error metrics only)
        shape = (len(SOURCES) + 2, len(ALL_METRICS), steps, c)
        self.sum = torch.zeros(shape, dtype=torch.float64, device=device)
        self.defined = torch.zeros(shape, dtype=torch.float64, device=device)  # samples per value
        # samples recorded per step: model and persistence, spread, ensemble scores
        self.count = torch.zeros(3, steps, dtype=torch.float64, device=device)
        # ensemble sums per step and field: members' variance, mean's MSE, scaled CRPS
        self.ensemble = torch.zeros(3, steps, c, dtype=torch.float64, device=device)
        # grid points per step, field and rank 0..K of the truth among the members
        self.ranks = torch.zeros(steps, c, members + 1, dtype=torch.float64, device=device)
        # (step, pred, truth) of the last update: the default previous frames of the next step
        self._previous: tuple[int, Tensor | None, Tensor | None] = (0, None, None)
        # per field, summed over samples and steps: the truth's range over space plus its
        # largest change from the last input frame (0 for a field constant in space and time)
        self.variation = torch.zeros(c, dtype=torch.float64, device=device)

    def _values(
        self, pred: Tensor, truth: Tensor, prev_pred: Tensor | None, prev_truth: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``(B, C, *sp)`` frames -> ``(sum, defined)``, each ``(len(ALL_METRICS), C)``.

        ``prev_pred=None`` computes the error metrics only (the others stay undefined).
        """
        spectral = binned_spectral_mse(pred, truth, eps=self.eps).to(torch.float64)  # (B, C, 3)
        spectral = spectral.masked_fill(negligible_bins(truth).to(spectral.device), math.nan)
        rows = [
            vrmse(pred, truth, eps=self.eps).to(torch.float64).unsqueeze(0),
            nrmse(pred, truth, eps=self.eps).to(torch.float64).unsqueeze(0),
            spectral.movedim(-1, 0),
        ]  # (M, B, C) pieces
        if prev_pred is None:
            rows.append(spectral.new_full((len(FIDELITY), *spectral.shape[:2]), math.nan))
        else:
            rows += [
                amplitude_ratio(pred, truth).to(torch.float64).unsqueeze(0),
                change_correlation(pred, truth, prev_pred, prev_truth)
                .to(torch.float64)
                .unsqueeze(0),
                binned_power_ratio(pred, truth).to(torch.float64).movedim(-1, 0),
            ]
        vals = torch.cat(rows).to(self.sum.device)  # (M_all, B, C), NaN where undefined
        ok = ~vals.isnan()
        return torch.where(ok, vals, 0.0).sum(dim=1), ok.sum(dim=1).to(torch.float64)

    @torch.no_grad()
    def update(
        self,
        step: int,
        pred: Tensor,
        truth: Tensor,
        last_input: Tensor,
        spread: Tensor | None = None,
        *,
        members: Tensor | None = None,
        prev_pred: Tensor | None = None,
        prev_truth: Tensor | None = None,
    ) -> None:
        """Record one step for a batch of trajectories.

        Args:
            step: 1-based rollout step.
            pred: ``(B, C, *spatial)`` model prediction (an ensemble's mean).
            truth: ``(B, C, *spatial)`` ground truth.
            last_input: ``(B, C, *spatial)`` last input frame (the persistence prediction).
            spread: ``(B, C, *spatial)`` an ensemble's standard deviation, or ``None``; with
                ``members`` it defaults to their population standard deviation.
            members: ``(K, B, C, *spatial)`` the ensemble's members (K as constructed, >= 2),
                for the ensemble scores; ``pred`` should be their mean.
            prev_pred: the model's prediction of the step before (for the change correlation);
                ``last_input`` at step 1. From step 2 on it defaults to the ``pred`` of the
                previous call when that call recorded step - 1 of the same batch shape.
            prev_truth: the truth of the step before, with the same default as ``prev_pred``.
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
        if step > 1 and (prev_pred is None or prev_truth is None):
            last_step, last_pred, last_truth = self._previous
            if last_step != step - 1 or last_truth.shape != truth.shape:
                raise ValueError(
                    f"step {step}: pass prev_pred and prev_truth (the frames of step {step - 1}); "
                    "the previous update did not record that step"
                )
            prev_pred = last_pred if prev_pred is None else prev_pred
            prev_truth = last_truth if prev_truth is None else prev_truth
        self._previous = (step, pred, truth)
        prev_pred = last_input if prev_pred is None else prev_pred
        prev_truth = last_input if prev_truth is None else prev_truth
        grid = tuple(truth.shape[2:])
        if self.grid is not None and grid != self.grid:
            raise ValueError(f"grid {grid} differs from the grid {self.grid} recorded before")
        self.grid = grid
        if members is not None:
            if self.members < 2 or members.shape[0] != self.members:
                raise ValueError(
                    f"got {members.shape[0]} members; this accumulator was built for "
                    f"members={self.members} (ensemble scores need 2 or more)"
                )
            scores = ensemble_scores(members, truth, eps=self.eps)
            dev = self.ensemble.device
            for row, key in enumerate(("variance", "mse", "crps")):
                self.ensemble[row, step - 1] += scores[key].sum(dim=0).to(dev)
            self.ranks[step - 1] += scores["rank_counts"].sum(dim=0).to(dev)
            self.count[2, step - 1] += truth.shape[0]
            if spread is None:
                spread = members.std(dim=0, correction=0)  # (B, C, *sp)
        axes = tuple(range(2, truth.ndim))
        flat = truth.mean(dim=axes, keepdim=True).expand_as(truth)  # (B, C, *sp) spatial means
        total, ok = self._values(flat, truth, None, truth)
        self.sum[3, :, step - 1] += total
        self.defined[3, :, step - 1] += ok
        for source, (p, p_prev) in enumerate(((pred, prev_pred), (last_input, last_input))):
            total, ok = self._values(p, truth, p_prev, prev_truth)
            self.sum[source, :, step - 1] += total
            self.defined[source, :, step - 1] += ok
        self.count[0, step - 1] += truth.shape[0]
        t64 = truth.to(torch.float64)
        variation = (t64.amax(dim=axes) - t64.amin(dim=axes)) + (
            t64 - last_input.to(torch.float64)
        ).abs().amax(dim=axes)  # (B, C)
        self.variation += variation.sum(dim=0).to(self.variation.device)
        if spread is not None:
            if spread.shape != truth.shape:
                raise ValueError(
                    f"spread shape {tuple(spread.shape)} != truth shape {tuple(truth.shape)}"
                )
            truth_f = truth.float() if truth.dtype != torch.float64 else truth
            total, ok = self._values(truth_f + spread.to(truth_f.dtype), truth_f, None, truth_f)
            self.sum[2, :, step - 1] += total
            self.defined[2, :, step - 1] += ok
            self.count[1, step - 1] += truth.shape[0]

    def state(self) -> dict[str, Tensor]:
        """The tensors to merge or all-reduce: ``sum`` and ``defined (4, M_all, steps, C)``,
        ``count (3, steps)``, ``variation (C,)``, ``ensemble (3, steps, C)``, ``ranks (steps, C,
        K + 1)``.

        Sources 2 and 3 of ``sum``/``defined`` hold the ensemble spread and the spatial-mean
        reference; rows 1 and 2 of ``count`` the samples with a spread and with members.
        """
        return {
            "sum": self.sum,
            "defined": self.defined,
            "count": self.count,
            "variation": self.variation,
            "ensemble": self.ensemble,
            "ranks": self.ranks,
        }

    def merge(self, other: RolloutMetrics | Mapping[str, Tensor]) -> RolloutMetrics:
        """Add another accumulator (or its ``state()``) into this one, in place."""
        state = other.state() if isinstance(other, RolloutMetrics) else other
        for key in ("sum", "ranks"):
            if state[key].shape != getattr(self, key).shape:
                raise ValueError(
                    f"cannot merge metrics of {key} shape {tuple(state[key].shape)} into "
                    f"{tuple(getattr(self, key).shape)} (other fields, steps or ensemble size)"
                )
        if isinstance(other, RolloutMetrics) and self.grid is None:
            self.grid = other.grid
        for key, mine in self.state().items():
            mine += state[key].to(mine)
        return self

    def all_reduce(self, group: Any = None) -> RolloutMetrics:
        """Sum the state over all processes of ``torch.distributed`` (no-op when not initialised)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            for tensor in self.state().values():
                torch.distributed.all_reduce(tensor, group=group)
        return self

    def _n_steps(self, row: int) -> int:
        return int((self.count[row] > 0).sum())

    def per_step(self) -> Tensor:
        """Means ``(2, M_all, S, C)`` (model, persistence) over the S leading steps with samples.

        Metrics in ``ALL_METRICS`` order; NaN where no sample defined the value.
        """
        n = self._n_steps(0)
        return (self.sum[:2, :, :n] / self.defined[:2, :, :n]).cpu()  # 0 / 0 -> NaN

    def spread_per_step(self) -> Tensor | None:
        """Mean ensemble spread ``(len(METRICS), S, C)`` in each error metric's units, ``None``
        if none recorded."""
        n = self._n_steps(1)
        if n == 0:
            return None
        m = len(METRICS)
        return (self.sum[2, :m, :n] / self.defined[2, :m, :n]).cpu()

    def spatial_mean_per_step(self) -> Tensor:
        """Errors ``(len(METRICS), S, C)`` of the spatial-mean reference over the S leading steps."""
        n = self._n_steps(0)
        m = len(METRICS)
        return (self.sum[3, :m, :n] / self.defined[3, :m, :n]).cpu()

    def ensemble_dict(self) -> dict[str, Any] | None:
        """The ensemble scores as JSON (``to_dict()["ensemble"]``), ``None`` without members.

        Layout: ``{"members": K, "crps_estimator", "spread_skill": B, "crps": B,
        "rank_histogram": {"per_step": {field: [S][K + 1]}, "windows": {field: {window: [K +
        1]}}, "mean_over_fields": {"windows": {window: [K + 1]}}}, "rank_max_over_flat": B}`` with
        ``B`` laid out as a metric's block of ``to_dict`` (``per_step``, ``windows``,
        ``mean_over_fields``; no ``samples``). The spread-skill ratio of a window pools the
        window's steps (the mean variance over the mean squared error); the rank histogram's
        fractions pool the grid points of its steps; the means over fields leave out
        ``constant_fields`` and, for the histograms, pool the fields' points.
        """
        n = self._n_steps(2)
        if n == 0:
            return None
        k = self.members
        count = self.count[2, :n].cpu().reshape(n, 1)  # (S, 1)
        ens = self.ensemble[:, :n].cpu() / count  # (3, S, C) per-step means over samples
        ranks = self.ranks[:n].cpu()  # (S, C, K + 1)
        windows = step_windows(n)
        constant = self.constant_fields()
        in_mean = [c for c, f in enumerate(self.field_names) if f not in constant]

        def fractions(x: Tensor) -> list[float | None]:  # (K + 1,) counts -> fractions
            return [_num(v) for v in (x / x.sum()).tolist()]

        def pooled(lo: int, hi: int) -> tuple[Tensor, Tensor]:  # steps lo..hi (1-based)
            return ens[0, lo - 1 : hi].mean(dim=0), ens[1, lo - 1 : hi].mean(dim=0)  # (C,) each

        ssr_steps = spread_skill_ratio(ens[0], ens[1], k)  # (S, C)
        ssr_windows = {w: spread_skill_ratio(*pooled(a, b), k) for w, (a, b) in windows.items()}
        flat = 1.0 / (k + 1)
        rank_steps = ranks / ranks.sum(dim=-1, keepdim=True)  # (S, C, K + 1)
        rank_windows = {w: ranks[a - 1 : b].sum(dim=0) for w, (a, b) in windows.items()}

        def block(steps: Tensor, by_window: Mapping[str, Tensor]) -> dict[str, Any]:
            # steps (S, C), by_window: window -> (C,)
            def mean(x: Tensor) -> float | None:
                return _num(x[in_mean].nanmean()) if in_mean else None

            return {
                "per_step": {
                    f: [_num(v) for v in steps[:, c].tolist()]
                    for c, f in enumerate(self.field_names)
                },
                "windows": {
                    f: {w: _num(v[c]) for w, v in by_window.items()}
                    for c, f in enumerate(self.field_names)
                },
                "mean_over_fields": {
                    "per_step": [mean(row) for row in steps],
                    "windows": {w: mean(v) for w, v in by_window.items()},
                },
            }

        crps_windows = {w: ens[2, a - 1 : b].mean(dim=0) for w, (a, b) in windows.items()}
        max_windows = {
            w: (v / v.sum(dim=-1, keepdim=True)).amax(dim=-1) / flat
            for w, v in rank_windows.items()
        }
        pooled_fields = {w: v[in_mean].sum(dim=0) for w, v in rank_windows.items()}
        return {
            "members": k,
            "crps_estimator": f"scoringrules.crps_ensemble, estimator={CRPS_ESTIMATOR!r} (fair)",
            "spread_skill": block(ssr_steps, ssr_windows),
            "crps": block(ens[2], crps_windows),
            "rank_histogram": {
                "per_step": {
                    f: [fractions(ranks[s, c]) for s in range(n)]
                    for c, f in enumerate(self.field_names)
                },
                "windows": {
                    f: {w: fractions(v[c]) for w, v in rank_windows.items()}
                    for c, f in enumerate(self.field_names)
                },
                "mean_over_fields": {
                    "windows": {
                        w: fractions(v) if in_mean else None for w, v in pooled_fields.items()
                    }
                },
            },
            "rank_max_over_flat": block(rank_steps.amax(dim=-1) / flat, max_windows),
        }

    def constant_fields(self) -> list[str]:
        """Fields whose truth was constant in space and time in every recorded sample."""
        if self._n_steps(0) == 0:
            return []
        return [f for f, v in zip(self.field_names, self.variation.tolist()) if v == 0]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary.

        Layout: ``{"fields", "steps", "count", "eps", "negligible_power", "spectral_bins",
        "windows", "constant_fields", "fields_in_mean", "negligible_true_power", "model": M,
        "persistence": M, "spatial_mean": M[, "spread": M, "ensemble": E]}`` (``spatial_mean``
        and ``spread`` hold the error metrics only; ``spread`` comes with a spread or members,
        ``ensemble``, see ``ensemble_dict``, with members) with
        ``M[metric] = {"per_step": {field: [S]}, "samples": {field: [S]}, "windows": {field:
        {window: v}}, "mean_over_fields": {"per_step": [S], "windows": {window: v}}}`` for every
        metric of ``ALL_METRICS``. ``null`` marks an undefined value (see ``NEGLIGIBLE_POWER``);
        ``samples`` counts the samples each per-step value averages. ``windows`` maps each
        window label to its first and last step. The means over fields leave out
        ``constant_fields``. ``negligible_true_power`` lists, per field and bin, the steps at
        which the truth's power in the bin was negligible in every sample (the spectral MSE
        and the power ratio are ``null`` there). ``spectral_bins`` gives the bin names and, once
        a step has been recorded, the grid and the bin edges in radians per cell.
        """
        means = self.per_step()  # (2, M_all, S, C)
        n = means.shape[2]
        windows = step_windows(n) if n else {}
        constant = self.constant_fields()
        in_mean = [c for c, f in enumerate(self.field_names) if f not in constant]
        defined = self.defined.cpu()
        out: dict[str, Any] = {
            "fields": self.field_names,
            "steps": n,
            "count": [int(c) for c in self.count[0, :n].tolist()],
            "eps": self.eps,
            "negligible_power": NEGLIGIBLE_POWER,
            "spectral_bins": {
                "names": list(SPECTRAL_BINS),
                "grid": list(self.grid) if self.grid is not None else None,
                "edges": [round(e, 6) for e in spectral_bin_edges(self.grid).tolist()]
                if self.grid is not None
                else None,
            },
            "windows": {w: list(span) for w, span in windows.items()},
            "constant_fields": constant,
            "fields_in_mean": [self.field_names[c] for c in in_mean],
            "negligible_true_power": {
                f: {
                    b: [
                        s + 1
                        for s in range(n)
                        if defined[0, METRICS.index(f"spectral_{b}"), s, c] == 0
                    ]
                    for b in SPECTRAL_BINS
                }
                for c, f in enumerate(self.field_names)
            },
        }
        spread = self.spread_per_step()  # (len(METRICS), S', C) or None
        blocks = [(source, ALL_METRICS, means[i], defined[i]) for i, source in enumerate(SOURCES)]
        if spread is not None:
            blocks.append((SPREAD, METRICS, spread, defined[2]))
        blocks.append((SPATIAL_MEAN, METRICS, self.spatial_mean_per_step(), defined[3]))
        for source, names, table, samples in blocks:
            out[source] = {
                metric: self._block(table[m], samples[m, : table.shape[1]], in_mean)
                for m, metric in enumerate(names)
            }
        scores = self.ensemble_dict()
        if scores is not None:
            out[ENSEMBLE] = scores
        return out

    def _block(self, values: Tensor, samples: Tensor, in_mean: list[int]) -> dict[str, Any]:
        """JSON block of one metric from ``values (S, C)`` (NaN: undefined) and ``samples (S, C)``."""
        windows = step_windows(values.shape[0]) if values.shape[0] else {}
        field_mean = (
            values[:, in_mean].nanmean(dim=1)
            if in_mean
            else values.new_full(values.shape[:1], math.nan)
        )  # (S,)

        def over(x: Tensor) -> dict[str, float | None]:  # (S,) -> window -> mean of the defined
            return {w: _num(x[a - 1 : b].nanmean()) for w, (a, b) in windows.items()}

        return {
            "per_step": {
                f: [_num(v) for v in values[:, c].tolist()] for c, f in enumerate(self.field_names)
            },
            "samples": {
                f: [int(k) for k in samples[:, c].tolist()] for c, f in enumerate(self.field_names)
            },
            "windows": {f: over(values[:, c]) for c, f in enumerate(self.field_names)},
            "mean_over_fields": {
                "per_step": [_num(v) for v in field_mean.tolist()],
                "windows": over(field_mean),
            },
        }
