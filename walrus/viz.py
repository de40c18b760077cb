"""Rollout plots and animations.

Figures are drawn with matplotlib's Agg canvas directly (no pyplot, no global backend change), and
matplotlib is imported inside the functions, so importing this module has no side effects. Every
file is written to a temporary name in the target folder and then renamed into place.

Field arrays are ``(S, C, *spatial)`` (steps, fields, 1-3 spatial axes) numpy arrays or tensors.
2D fields are shown as images, 3D fields as the middle slice of the last axis, 1D fields as lines.
"""

from __future__ import annotations

import math
import os
import shutil
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from walrus.atomic import atomic_path
from walrus.metrics import (
    ENSEMBLE,
    FIDELITY,
    METRIC_LABELS,
    NEGLIGIBLE_POWER,
    SOURCES,
    SPATIAL_MEAN,
    SPECTRAL_BINS,
    SPREAD,
)

MAX_FRAMES = 60
# characters of a 10-point title line per inch of figure width (titles are wrapped to fit)
TITLE_CHARS_PER_INCH = 11
# GIF frames are quantised to this many colours each, with a palette fitted to the frame
GIF_COLOURS = 256


def _new_figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _suptitle(fig: Any, lines: Sequence[str], width: float) -> None:
    """The figure's title, each line wrapped to the figure's ``width`` (inches)."""
    chars = max(20, int(width * TITLE_CHARS_PER_INCH))
    wrapped = [w for line in lines for w in textwrap.wrap(line, chars) or [""]]
    fig.suptitle("\n".join(wrapped), fontsize=10)


def _figure_legend(fig: Any, axes: Sequence[Any]) -> None:
    """One legend for the figure, below the panels (where it covers no curve or window label),
    with each label of ``axes`` once."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    if seen:
        fig.legend(
            list(seen.values()), list(seen), loc="outside lower center", ncols=min(len(seen), 4),
            fontsize=8,
        )  # fmt: skip


def _save_figure(fig: Any, path: str | os.PathLike[str], dpi: int, title: str | None) -> Path:
    """Save as png, atomically; ``title`` goes into the image's metadata too."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png", metadata={"Title": title} if title else None)
    return path


def _curve(values: Sequence[float | None]) -> np.ndarray:
    """Per-step JSON values as floats; ``None`` (undefined) becomes NaN, a gap in the line."""
    return np.array([math.nan if v is None else v for v in values], dtype=float)


def _mark_windows(ax: Any, windows: Mapping[str, Sequence[int]], label: bool) -> None:
    """Shade every other step window and, if ``label``, name each one at the top."""
    for k, (name, (first, last)) in enumerate(windows.items()):
        if k % 2:
            ax.axvspan(first - 0.5, last + 0.5, color="0.5", alpha=0.08, lw=0)
        if label:
            ax.text(
                (first + last) / 2,
                0.98,
                name,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="top",
                fontsize=7,
                color="0.35",
            )


def _as_array(x: Any, name: str) -> np.ndarray:
    """``(S, C, *spatial)`` float numpy array."""
    arr = x.detach().float().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x, dtype=float)
    if arr.ndim < 3 or arr.ndim > 5:
        raise ValueError(f"{name} must be (S, C, *spatial) with 1-3 spatial axes, got {arr.shape}")
    return arr


def _to_2d_or_1d(arr: np.ndarray) -> np.ndarray:
    """Drop to what is drawn: 3D -> middle slice of the last axis; 1D and 2D unchanged."""
    if arr.ndim == 5:
        return arr[..., arr.shape[-1] // 2]
    return arr


def _check_fields(truth: np.ndarray, pred: np.ndarray, field_names: Sequence[str]) -> None:
    if truth.shape != pred.shape:
        raise ValueError(f"truth shape {truth.shape} != prediction shape {pred.shape}")
    if len(field_names) != truth.shape[1]:
        raise ValueError(f"got {len(field_names)} field names for {truth.shape[1]} fields")


def plot_error_curves(
    metrics: Mapping[str, Any],
    path: str | os.PathLike[str],
    metric: str = "vrmse",
    *,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Plot error against rollout step, model vs persistence (and the spatial-mean reference
    where ``metrics`` holds it), log y axis.

    For an ensemble (``metrics`` holds ``"spread"``) the model's curve gets a band of +- the
    members' spread in the same metric's units. Undefined values (``null``: negligible true
    power) are gaps, and a panel with none defined says so. The step windows of ``metrics``
    are shaded and named; the legend sits below the panels and the title is wrapped to the
    figure's width.

    Args:
        metrics: ``RolloutMetrics.to_dict()`` output.
        path: output image (png).
        metric: a name of ``walrus.metrics.METRICS`` (``"vrmse"``, ``"nrmse"``,
            ``"spectral_low"``, ...): one panel per field; or ``"spectral"``: one row per field,
            one column per wavenumber bin of the binned spectral MSE.
        title: the figure's title (e.g. dataset, trajectories, steps, ensemble size).
        dpi: resolution.

    Returns:
        The written path.
    """
    return _save_figure(error_curves_figure(metrics, metric, title=title), path, dpi, title)


def error_curves_figure(
    metrics: Mapping[str, Any], metric: str = "vrmse", *, title: str | None = None
) -> Any:
    """The matplotlib ``Figure`` that ``plot_error_curves`` saves (same arguments)."""
    fields = list(metrics["fields"])
    if metric == "spectral":
        bins = list(metrics.get("spectral_bins", {}).get("names", SPECTRAL_BINS))
        panels = [(f"{f}, {b} k", f"spectral_{b}", f) for f in fields for b in bins]
        cols = len(bins)
    else:
        panels = [(f, metric, f) for f in fields]
        cols = min(len(fields), 4)
    missing = sorted({key for _, key, _ in panels} - set(metrics.get("model", {})))
    if missing:
        raise ValueError(
            f"metric {metric!r}: {missing} not in metrics; have {sorted(metrics.get('model', {}))}"
        )
    rows = -(-len(panels) // cols)
    width = max(3.2 * cols, 4.8)
    fig = _new_figure(width, 2.6 * rows + 0.9)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    constant = set(metrics.get("constant_fields", []))
    sources = [("model", "-"), ("persistence", "--")]
    if metric != "spectral" and metric in metrics.get(SPATIAL_MEAN, {}):
        sources.append((SPATIAL_MEAN, ":"))
    for k, (ax, (name, key, field)) in enumerate(zip(axes, panels)):
        _mark_windows(ax, metrics.get("windows", {}), label=k < cols)
        for source, style in sources:
            values = _curve(metrics[source][key]["per_step"][field])
            steps = np.arange(1, len(values) + 1)
            line = ax.plot(
                steps,
                values,
                style,
                label=source.replace("_", " "),
                marker="." if len(values) < 20 else None,
            )
            if source == "model" and SPREAD in metrics:
                band = _curve(metrics[SPREAD][key]["per_step"][field])
                n = min(len(band), len(values))
                lo = np.maximum(values[:n] - band[:n], values[:n] * 1e-3)  # keep > 0 (log axis)
                ax.fill_between(
                    steps[:n],
                    lo,
                    values[:n] + band[:n],
                    color=line[0].get_color(),
                    alpha=0.25,
                    label="ensemble spread",
                )
            if np.any(values > 0):
                ax.set_yscale("log")
        if np.isnan(_curve(metrics["model"][key]["per_step"][field])).all():
            ax.text(0.5, 0.5, "n/a: negligible true power", transform=ax.transAxes, ha="center")
            ax.set_yticks([])
        ax.set_title(f"{name} (constant)" if field in constant else name, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(METRIC_LABELS.get(key, key))
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    edges = metrics.get("spectral_bins", {}).get("edges")
    lines = [title] if title else []
    if metric == "spectral" and edges:
        lines.append(
            f"binned spectral MSE; bin edges |k| = {', '.join(f'{e:.3g}' for e in edges)}; gaps: "
            f"the truth's power in the bin is at most {NEGLIGIBLE_POWER:g} of its power about "
            "the mean"
        )
    if lines:
        _suptitle(fig, lines, width)
    _figure_legend(fig, axes[: len(panels)])
    return fig


def _spans_decades(values: np.ndarray) -> bool:
    """Whether positive ``values`` (NaN ignored) span more than a factor of 10 (log axis)."""
    shown = values[np.isfinite(values)]
    return bool(shown.size) and shown.min() > 0 and shown.max() > 10 * shown.min()


def plot_fidelity(
    metrics: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Physical fidelity against rollout step: amplitude ratio, change correlation and the
    power ratio of each wavenumber bin, model (solid) against persistence (dashed).

    One row per field and one for the mean over fields; 1 (dotted) is ideal everywhere.
    Undefined values (negligible true power, persistence's change) are gaps. The legend sits
    below the panels, clear of the window labels at their tops.

    Args:
        metrics: ``RolloutMetrics.to_dict()`` output (with the ``FIDELITY`` measures).
        path: output image (png).
        title: the figure's title.
        dpi: resolution.

    Returns:
        The written path.
    """
    return _save_figure(fidelity_figure(metrics, title=title), path, dpi, title)


def fidelity_figure(metrics: Mapping[str, Any], *, title: str | None = None) -> Any:
    """The matplotlib ``Figure`` that ``plot_fidelity`` saves (same arguments)."""
    if "amplitude_ratio" not in metrics.get("model", {}):
        raise ValueError("metrics hold no fidelity measures (amplitude_ratio, ...)")
    fields = list(metrics["fields"])
    constant = set(metrics.get("constant_fields", []))
    rows = [(f"{f} (constant)" if f in constant else f, f) for f in fields]
    rows.append(("mean over fields", None))
    bins = list(metrics.get("spectral_bins", {}).get("names", SPECTRAL_BINS))
    fig = _new_figure(10.5, 2.4 * len(rows) + 0.9)
    axes = fig.subplots(len(rows), 3, squeeze=False)
    panels = (
        ("amplitude ratio", ["amplitude_ratio"], True),
        ("change correlation", ["change_correlation"], False),
        ("power ratio per k bin", [f"power_ratio_{b}" for b in bins], True),
    )

    def series(source: str, key: str, field: str | None) -> np.ndarray:
        block = metrics[source][key]
        return _curve(
            block["mean_over_fields"]["per_step"] if field is None else block["per_step"][field]
        )

    for r, (row_name, field) in enumerate(rows):
        for j, (label, keys, log) in enumerate(panels):
            ax = axes[r, j]
            _mark_windows(ax, metrics.get("windows", {}), label=r == 0)
            ax.axhline(1.0, color="k", lw=0.8, ls=":")
            drawn: list[np.ndarray] = []
            for key, colour in zip(keys, ("C0", "C1", "C2")):
                prefix = f"{key.removeprefix('power_ratio_')} k " if len(keys) > 1 else ""
                for source, style in zip(SOURCES, ("-", "--")):
                    values = series(source, key, field)
                    if np.isnan(values).all():
                        continue
                    ax.plot(
                        np.arange(1, len(values) + 1),
                        values,
                        style,
                        color=colour,
                        label=f"{prefix}{source}",
                        marker="." if len(values) < 20 else None,
                    )
                    drawn.append(values)
            if not drawn:
                ax.text(0.5, 0.5, "n/a", transform=ax.transAxes, ha="center")
                ax.set_yticks([])
            elif log and _spans_decades(np.concatenate(drawn)):
                ax.set_yscale("log")
            ax.set_title(f"{row_name}: {label}", fontsize=9)
            ax.set_xlabel("step")
            ax.grid(True, which="both", alpha=0.3)
    _figure_legend(fig, axes[0])
    if title:
        _suptitle(fig, [title], 10.5)
    return fig


def plot_fidelity_fields(
    metrics: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Every field's physics at a glance: one panel per fidelity measure (amplitude ratio,
    change correlation, power ratio of each wavenumber bin), fields down, step windows across,
    the model's window mean written in each cell.

    Ratios are coloured by log2 of the ratio (white is 1, red too much, blue too little,
    saturating at 8x either way); the change correlation from -1 (red) through 0 (yellow) to 1
    (green).
    Undefined cells (negligible true power) are grey and read ``n/a``.

    Args:
        metrics: ``RolloutMetrics.to_dict()`` output (with the ``FIDELITY`` measures).
        path: output image (png).
        title: the figure's title.
        dpi: resolution.

    Returns:
        The written path.
    """
    from matplotlib import colormaps

    if "amplitude_ratio" not in metrics.get("model", {}):
        raise ValueError("metrics hold no fidelity measures (amplitude_ratio, ...)")
    fields = list(metrics["fields"])
    windows = list(metrics.get("windows", {}))
    if not windows:
        raise ValueError("metrics hold no steps to plot")
    constant = set(metrics.get("constant_fields", []))
    labels = [f"{f} (constant)" if f in constant else f for f in fields]
    width = max(4.0, 1.0 + 0.9 * len(windows)) * len(FIDELITY) / 2 + 1.0
    height = 0.45 * len(fields) + 2.2
    fig = _new_figure(width, height)
    axes = fig.subplots(1, len(FIDELITY), squeeze=False)[0]
    for ax, key in zip(axes, FIDELITY):
        block = metrics["model"][key]["windows"]
        values = np.array(
            [
                [math.nan if block[f].get(w) is None else block[f][w] for w in windows]
                for f in fields
            ],
            dtype=float,
        )  # (fields, windows)
        if key == "change_correlation":
            shown, cmap, lim = values, "RdYlGn", (-1.0, 1.0)
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                shown = np.log2(values)
            cmap, lim = "RdBu_r", (-3.0, 3.0)
        image = np.ma.masked_invalid(shown)
        colours = colormaps[cmap].with_extremes(bad="0.85")
        im = ax.imshow(image, cmap=colours, vmin=lim[0], vmax=lim[1], aspect="auto")
        for (r, c), v in np.ndenumerate(values):
            ax.text(c, r, "n/a" if math.isnan(v) else f"{v:.3g}", ha="center", va="center",
                    fontsize=7)  # fmt: skip
        ax.set_xticks(range(len(windows)), windows, rotation=45, fontsize=7)
        ax.set_yticks(range(len(fields)), labels if ax is axes[0] else [], fontsize=8)
        ax.set_xlabel("steps", fontsize=8)
        ax.set_title(METRIC_LABELS.get(key, key), fontsize=9)
        bar = fig.colorbar(im, ax=ax, shrink=0.8, location="bottom")
        bar.set_label("correlation" if key == "change_correlation" else "log2 ratio", fontsize=7)
    lines = [title] if title else []
    lines.append("model, mean over each step window; 1 is ideal for every measure")
    _suptitle(fig, lines, width)
    return _save_figure(fig, path, dpi, title)


def plot_rank_histogram(
    metrics: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Rank histograms of an ensemble: one row per field, one column per step window.

    Bar r is how often the truth had r members below it, over the flat level 1 / (K + 1), so a
    calibrated ensemble's bars sit at 1 (dashed); the dotted line at 2 marks a bin twice the
    flat level. U-shaped: the ensemble is too sure of itself; humped: too unsure.

    Args:
        metrics: ``RolloutMetrics.to_dict()`` output of an ensemble (with ``"ensemble"``).
        path: output image (png).
        title: the figure's title.
        dpi: resolution.

    Returns:
        The written path.
    """
    if ENSEMBLE not in metrics:
        raise ValueError("metrics hold no ensemble scores (roll out with ensemble=2 or more)")
    ens = metrics[ENSEMBLE]
    k = int(ens["members"])
    hist = ens["rank_histogram"]["windows"]
    fields = list(metrics["fields"])
    windows = list(next(iter(hist.values())))
    width = max(4.8, 2.4 * len(windows))
    fig = _new_figure(width, 1.9 * len(fields) + 1.0)
    axes = fig.subplots(len(fields), len(windows), squeeze=False, sharey=True)
    for r, field in enumerate(fields):
        for c, window in enumerate(windows):
            ax = axes[r, c]
            freq = np.array([math.nan if v is None else v for v in hist[field][window]], float)
            ax.bar(np.arange(k + 1), freq * (k + 1), width=0.85, color="C0")
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
            ax.axhline(2.0, color="0.4", lw=0.8, ls=":")
            ax.set_xticks(range(k + 1) if k < 12 else range(0, k + 1, max(1, k // 6)))
            ax.tick_params(labelsize=7)
            if r == 0:
                ax.set_title(f"steps {window}", fontsize=9)
            if r == len(fields) - 1:
                ax.set_xlabel("rank of the truth", fontsize=8)
            if c == 0:
                ax.set_ylabel(f"{field}\nfrequency / flat", fontsize=8)
    lines = [title] if title else []
    lines.append(f"rank histograms, {k} members; 1 (dashed) is flat, i.e. calibrated")
    _suptitle(fig, lines, width)
    return _save_figure(fig, path, dpi, title)


def _default_steps(n_steps: int, k: int = 4) -> list[int]:
    return sorted({int(round(s)) for s in np.linspace(1, n_steps, min(k, n_steps))})


def snapshot_limits(
    truth: np.ndarray, pred: np.ndarray, spread: np.ndarray | None
) -> dict[str, tuple[float, float]]:
    """Colour limits of one field's snapshot rows, from the frames shown ``(K, *spatial)``.

    Truth and prediction share the truth's range, the error is symmetric about 0, and the
    ensemble spread gets its own scale from 0 to its largest value (on the error's scale it
    would be nearly black: an ensemble's spread is often much smaller than the error).
    """
    limits = {
        "truth": (float(truth.min()), float(truth.max())),
        "error": (-1.0, 1.0),
    }
    err_max = float(np.abs(pred - truth).max())
    if err_max > 0:
        limits["error"] = (-err_max, err_max)
    limits["prediction"] = limits["truth"]
    if spread is not None:
        limits["spread"] = (0.0, float(spread.max()) or 1.0)
    return limits


def plot_snapshots(
    truth: Any,
    pred: Any,
    field_names: Sequence[str],
    steps: Sequence[int] | None,
    path: str | os.PathLike[str],
    *,
    spread: Any = None,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Truth, prediction and error (and an ensemble's spread) for each field at a few steps.

    Args:
        truth: ``(S, C, *spatial)``, ``truth[i]`` is step ``i + 1``.
        pred: same shape.
        field_names: the C names.
        steps: 1-based steps to show (columns); ``None`` picks up to 4 spread over the rollout.
        path: output image (png).
        spread: an ensemble's standard deviation, shaped like ``pred``: adds a row per field,
            on its own colour scale (``snapshot_limits``).
        title: the figure's title (e.g. dataset, trajectory, steps, ensemble size).
        dpi: resolution.

    Returns:
        The written path.
    """
    t, p = _as_array(truth, "truth"), _as_array(pred, "pred")
    _check_fields(t, p, field_names)
    steps = _default_steps(t.shape[0]) if steps is None else list(steps)
    bad = [s for s in steps if not 1 <= s <= t.shape[0]]
    if bad or not steps:
        raise ValueError(f"steps {bad or steps} outside 1..{t.shape[0]}")
    t, p = _to_2d_or_1d(t), _to_2d_or_1d(p)
    sd = None
    if spread is not None:
        sd = _as_array(spread, "spread")
        if sd.shape != _as_array(pred, "pred").shape:
            raise ValueError(f"spread shape {sd.shape} != prediction shape {pred.shape}")
        sd = _to_2d_or_1d(sd)
    per_field = 3 if sd is None else 4
    rows, cols = per_field * len(field_names), len(steps)
    fig = _new_figure(2.4 * cols + 0.6, 2.0 * rows + (0.4 if title else 0.0))
    axes = fig.subplots(rows, cols, squeeze=False)
    shown = [s - 1 for s in steps]
    for c, name in enumerate(field_names):
        limits = snapshot_limits(t[shown, c], p[shown, c], None if sd is None else sd[shown, c])
        for j, s in enumerate(steps):
            panels = [
                ("truth", t[s - 1, c], "viridis"),
                ("prediction", p[s - 1, c], "viridis"),
                ("error", p[s - 1, c] - t[s - 1, c], "RdBu_r"),
            ]
            if sd is not None:
                panels.append(("spread", sd[s - 1, c], "magma"))
            for r, (label, img, cmap) in enumerate(panels):
                ax = axes[per_field * c + r, j]
                vmin, vmax = limits[label]
                if img.ndim == 1:
                    ax.plot(img, lw=1.0)
                    if label == "prediction":
                        ax.plot(t[s - 1, c], "k--", lw=0.8)
                        vmin = min(vmin, float(p[shown, c].min()))
                        vmax = max(vmax, float(p[shown, c].max()))
                    pad = 0.05 * (vmax - vmin) + 1e-12
                    ax.set_ylim(vmin - pad, vmax + pad)
                else:
                    im = ax.imshow(img.T, origin="lower", cmap=cmap, vmin=vmin, vmax=vmax)
                    if j == cols - 1:
                        fig.colorbar(im, ax=ax, shrink=0.8)
                    ax.set_xticks([])
                    ax.set_yticks([])
                if r == 0:
                    ax.set_title(f"step {s}")
                if j == 0:
                    ax.set_ylabel(f"{name}\n{label}")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save_figure(fig, path, dpi, title)


class _Animation:
    """The animation's figure: truth, prediction and error per field, with colour bars.

    ``show(i)`` sets every panel to frame ``i`` (0-based step) and the title to its step.
    """

    def __init__(
        self, t: np.ndarray, p: np.ndarray, field_names: Sequence[str], title: str | None
    ) -> None:
        err = p - t
        self.n_steps = t.shape[0]
        self.title = title
        self.fig = _new_figure(8.4, 2.2 * len(field_names) + 0.4)
        axes = self.fig.subplots(len(field_names), 3, squeeze=False)
        self.artists: list[tuple[Any, np.ndarray, int]] = []
        for c, name in enumerate(field_names):
            lo, hi = float(t[:, c].min()), float(t[:, c].max())
            err_max = float(np.abs(err[:, c]).max()) or 1.0
            for j, (label, data, cmap, vmin, vmax) in enumerate(
                (
                    ("truth", t, "viridis", lo, hi),
                    ("prediction", p, "viridis", lo, hi),
                    ("error", err, "RdBu_r", -err_max, err_max),
                )
            ):
                ax = axes[c, j]
                if data.ndim == 3:
                    (art,) = ax.plot(data[0, c], lw=1.0)
                    pad = 0.05 * (vmax - vmin) + 1e-12
                    ax.set_ylim(vmin - pad, vmax + pad)
                else:
                    art = ax.imshow(data[0, c].T, origin="lower", cmap=cmap, vmin=vmin, vmax=vmax)
                    self.fig.colorbar(art, ax=ax, shrink=0.85)
                    ax.set_xticks([])
                    ax.set_yticks([])
                ax.set_title(f"{name} {label}", fontsize=9)
                self.artists.append((art, data, c))
        self.suptitle = self.fig.suptitle("", fontsize=10)
        self._image_axes = [art.axes for art, data, _ in self.artists if data.ndim != 3]
        self._background: Any = None
        self._background_dpi = 0

    def show(self, i: int) -> None:
        for art, data, c in self.artists:
            if data.ndim == 3:
                art.set_ydata(data[i, c])
            else:
                art.set_data(data[i, c].T)
        step = f"step {i + 1} of {self.n_steps}"
        self.suptitle.set_text(f"{self.title}: {step}" if self.title else step)

    def rgb(self, dpi: int) -> np.ndarray:
        """The current frame rendered at ``dpi``, ``(H, W, 3)`` uint8.

        The first call (per ``dpi``) draws the whole figure once to fix its layout and keeps
        the static part (axes, colour bars, labels) as a background; every call then redraws
        only the panels' data, their frames and the title over it (blitting: a full redraw
        costs ~20x more, most of it laying out tick labels).
        """
        canvas = self.fig.canvas
        moving = [art for art, _, _ in self.artists] + [self.suptitle]
        if self._background is None or self._background_dpi != dpi:
            self.fig.set_dpi(dpi)
            for art in moving:
                art.set_animated(False)
            self.fig.set_layout_engine("constrained")
            canvas.draw()  # the layout is computed with the current frame's title
            self.fig.set_layout_engine("none")  # and kept for every frame
            for art in moving:
                art.set_animated(True)
            canvas.draw()  # everything but the moving artists
            self._background = canvas.copy_from_bbox(self.fig.bbox)
            self._background_dpi = dpi
        canvas.restore_region(self._background)
        for art in moving:
            self.fig.draw_artist(art)
        for ax in self._image_axes:  # frames back on top of the images, as in a full draw
            for spine in ax.spines.values():
                self.fig.draw_artist(spine)
        return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _frame_indices(n_steps: int, max_frames: int) -> np.ndarray:
    """0-based steps shown: all, or ``max_frames`` evenly spaced ones."""
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    return np.unique(np.linspace(0, n_steps - 1, min(max_frames, n_steps)).round().astype(int))


def animation_frames(
    truth: Any,
    pred: Any,
    field_names: Sequence[str],
    *,
    title: str | None = None,
    max_frames: int = MAX_FRAMES,
    dpi: int = 72,
) -> list[np.ndarray]:
    """The animation's frames as images, ``(H, W, 3)`` uint8 each (what ``write_animation``
    encodes); arguments as for ``write_animation``."""
    t, p = _as_array(truth, "truth"), _as_array(pred, "pred")
    _check_fields(t, p, field_names)
    anim = _Animation(_to_2d_or_1d(t), _to_2d_or_1d(p), field_names, title)
    frames = []
    for i in _frame_indices(t.shape[0], max_frames):
        anim.show(int(i))
        frames.append(anim.rgb(dpi))
    return frames


def write_animation(
    truth: Any,
    pred: Any,
    field_names: Sequence[str],
    path_stem: str | os.PathLike[str],
    *,
    title: str | None = None,
    fps: int = 8,
    max_frames: int = MAX_FRAMES,
    dpi: int = 72,
) -> Path:
    """Animate truth, prediction and error side by side over the rollout, with colour bars.

    Writes ``<path_stem>.mp4`` when ``ffmpeg`` is on the PATH, else ``<path_stem>.gif``: each
    GIF frame gets its own palette of ``GIF_COLOURS`` colours fitted to it (no dithering), so
    colour maps keep their gradients. Long rollouts are subsampled to at most ``max_frames``
    frames.

    Args:
        truth: ``(S, C, *spatial)``.
        pred: same shape.
        field_names: the C names (rows).
        path_stem: output path without suffix.
        title: prefix of every frame's title (e.g. dataset, trajectory, ensemble size); the
            frame's step follows it.
        fps: frames per second.
        max_frames: frame cap.
        dpi: resolution.

    Returns:
        The written path.
    """
    t, p = _as_array(truth, "truth"), _as_array(pred, "pred")
    _check_fields(t, p, field_names)
    indices = _frame_indices(t.shape[0], max_frames)
    if shutil.which("ffmpeg") is not None:
        from matplotlib.animation import FFMpegWriter

        anim = _Animation(_to_2d_or_1d(t), _to_2d_or_1d(p), field_names, title)
        path = Path(f"{os.fspath(path_stem)}.mp4")
        writer = FFMpegWriter(fps=fps)
        with atomic_path(path) as tmp, writer.saving(anim.fig, str(tmp), dpi):
            for i in indices:
                anim.show(int(i))
                writer.grab_frame()
        return path
    from PIL import Image

    frames = [
        Image.fromarray(rgb).quantize(
            colors=GIF_COLOURS, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE
        )
        for rgb in animation_frames(t, p, field_names, title=title, max_frames=max_frames, dpi=dpi)
    ]
    path = Path(f"{os.fspath(path_stem)}.gif")
    with atomic_path(path) as tmp:
        frames[0].save(
            tmp,
            format="GIF",
            save_all=True,
            append_images=frames[1:],
            duration=round(1000 / fps),
            loop=0,
        )
    return path
