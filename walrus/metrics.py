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

Step windows: ``window_means`` averages per-step values over the windows 1, 2-10, 11-30, 31-60 and
61+ (1-based steps), and ``RolloutMetrics`` accumulates sums and counts of every metric
(``METRICS``: VRMSE, NRMSE and the three spectral bins), so that results gathered across processes
equal a single-process run. For an ensemble it also accumulates the members' spread in the
units of each metric (``SPREAD``), the width of the uncertainty band drawn around the model's
curve.
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
METRIC_LABELS = {
    "vrmse": "VRMSE",
    "nrmse": "NRMSE",
    **{f"spectral_{b}": f"spectral MSE, {b} k" for b in SPECTRAL_BINS},
}
SOURCES = ("model", "persistence")
# An ensemble's spread, in each metric's units: the metric of (truth + spread) against truth,
# e.g. sqrt(<spread^2> / std(truth)^2) for VRMSE. Recorded only for ensembles.
SPREAD = "spread"
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
    fft_dtype = torch.float32 if truth.device.type == "mps" else torch.float64
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
    """Accumulates per-step VRMSE, NRMSE and binned spectral MSE of a model and of persistence.

    Values are averaged over samples at each step: sums and sample counts are kept in fixed-size
    float64 tensors, so merging or all-reducing the states of several processes gives the
    single-process result (up to float64 rounding). One accumulator serves one grid.

    Args:
        field_names: the C field names.
        steps: the largest 1-based step that will be recorded.
        eps: denominator epsilon of every metric.
        device: where the sums live (use the accelerator's device for NCCL all-reduce).
    """

    def __init__(
        self,
        field_names: Sequence[str],
        steps: int,
        *,
        eps: float = EPS,
        device: torch.device | str = "cpu",
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.field_names = [str(n) for n in field_names]
        if not self.field_names:
            raise ValueError("field_names must not be empty")
        self.steps = steps
        self.eps = eps
        self.grid: tuple[int, ...] | None = None
        c = len(self.field_names)
        # sources: model, persistence, spread; spread has its own sample count
        self.sum = torch.zeros(
            len(SOURCES) + 1, len(METRICS), steps, c, dtype=torch.float64, device=device
        )
        self.count = torch.zeros(2, steps, dtype=torch.float64, device=device)

    def _values(self, pred: Tensor, truth: Tensor) -> Tensor:
        """``(B, C, *sp)`` pair -> ``(len(METRICS), C)`` sums over the batch."""
        spectral = binned_spectral_mse(pred, truth, eps=self.eps)  # (B, C, 3)
        vals = torch.cat(
            [
                vrmse(pred, truth, eps=self.eps).unsqueeze(0),
                nrmse(pred, truth, eps=self.eps).unsqueeze(0),
                spectral.to(torch.float64).movedim(-1, 0),
            ]
        )  # (M, B, C)
        return vals.to(torch.float64).sum(dim=1).to(self.sum.device)

    @torch.no_grad()
    def update(
        self,
        step: int,
        pred: Tensor,
        truth: Tensor,
        last_input: Tensor,
        spread: Tensor | None = None,
    ) -> None:
        """Record one step for a batch of trajectories.

        Args:
            step: 1-based rollout step.
            pred: ``(B, C, *spatial)`` model prediction (an ensemble's mean).
            truth: ``(B, C, *spatial)`` ground truth.
            last_input: ``(B, C, *spatial)`` last input frame (the persistence prediction).
            spread: ``(B, C, *spatial)`` an ensemble's standard deviation, or ``None``.
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
        grid = tuple(truth.shape[2:])
        if self.grid is not None and grid != self.grid:
            raise ValueError(f"grid {grid} differs from the grid {self.grid} recorded before")
        self.grid = grid
        self.sum[0, :, step - 1] += self._values(pred, truth)
        self.sum[1, :, step - 1] += self._values(last_input, truth)
        self.count[0, step - 1] += truth.shape[0]
        if spread is not None:
            if spread.shape != truth.shape:
                raise ValueError(
                    f"spread shape {tuple(spread.shape)} != truth shape {tuple(truth.shape)}"
                )
            truth_f = truth.float() if truth.dtype != torch.float64 else truth
            self.sum[2, :, step - 1] += self._values(truth_f + spread.to(truth_f.dtype), truth_f)
            self.count[1, step - 1] += truth.shape[0]

    def state(self) -> dict[str, Tensor]:
        """The tensors to merge or all-reduce: ``sum (3, M, steps, C)``, ``count (2, steps)``.

        Source 2 of ``sum`` and row 1 of ``count`` hold the ensemble spread.
        """
        return {"sum": self.sum, "count": self.count}

    def merge(self, other: RolloutMetrics | Mapping[str, Tensor]) -> RolloutMetrics:
        """Add another accumulator (or its ``state()``) into this one, in place."""
        state = other.state() if isinstance(other, RolloutMetrics) else other
        if state["sum"].shape != self.sum.shape:
            raise ValueError(
                f"cannot merge metrics of shape {tuple(state['sum'].shape)} into {tuple(self.sum.shape)}"
            )
        if isinstance(other, RolloutMetrics) and self.grid is None:
            self.grid = other.grid
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
        """Means ``(2, M, S, C)`` (model, persistence) over the S leading steps with samples."""
        n = int((self.count[0] > 0).sum())
        return (self.sum[:2, :, :n] / self.count[0, :n, None]).cpu()

    def spread_per_step(self) -> Tensor | None:
        """Mean ensemble spread ``(M, S, C)`` in each metric's units, ``None`` if none recorded."""
        n = int((self.count[1] > 0).sum())
        if n == 0:
            return None
        return (self.sum[2, :, :n] / self.count[1, :n, None]).cpu()

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary.

        Layout: ``{"fields", "steps", "count", "eps", "spectral_bins", "model": M,
        "persistence": M[, "spread": M]}`` (``spread`` for ensembles) with ``M[metric] = {"per_step": {field: [S]}, "windows": {field:
        {window: v}}, "mean_over_fields": {"per_step": [S], "windows": {window: v}}}`` for every
        metric of ``METRICS``. ``spectral_bins`` gives the bin names and, once a step has been
        recorded here, the grid and the bin edges in radians per cell.
        """
        means = self.per_step()  # (2, M, S, C)
        out: dict[str, Any] = {
            "fields": self.field_names,
            "steps": means.shape[2],
            "count": [int(c) for c in self.count[0, : means.shape[2]].tolist()],
            "eps": self.eps,
            "spectral_bins": {
                "names": list(SPECTRAL_BINS),
                "grid": list(self.grid) if self.grid is not None else None,
                "edges": [round(e, 6) for e in spectral_bin_edges(self.grid).tolist()]
                if self.grid is not None
                else None,
            },
        }
        spread = self.spread_per_step()  # (M, S', C) or None
        blocks = [(source, means[i]) for i, source in enumerate(SOURCES)]
        if spread is not None:
            blocks.append((SPREAD, spread))
        for source, table in blocks:
            out[source] = {}
            for m, metric in enumerate(METRICS):
                values = table[m]  # (S, C)
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
