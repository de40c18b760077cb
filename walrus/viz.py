"""Rollout plots and animations.

Figures are drawn with matplotlib's Agg canvas directly (no pyplot, no global backend change), and
matplotlib is imported inside the functions, so importing this module has no side effects. Every
file is written to a temporary name in the target folder and then renamed into place.

Field arrays are ``(S, C, *spatial)`` (steps, fields, 1-3 spatial axes) numpy arrays or tensors.
2D fields are shown as images, 3D fields as the middle slice of the last axis, 1D fields as lines.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from walrus.atomic import atomic_path
from walrus.metrics import METRIC_LABELS, SPECTRAL_BINS, SPREAD

MAX_FRAMES = 60


def _new_figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save_figure(fig: Any, path: str | os.PathLike[str], dpi: int) -> Path:
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi)
    return path


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
    dpi: int = 100,
) -> Path:
    """Plot error against rollout step, model vs persistence, log y axis.

    For an ensemble (``metrics`` holds ``"spread"``) the model's curve gets a band of +- the
    members' spread in the same metric's units.

    Args:
        metrics: ``RolloutMetrics.to_dict()`` output.
        path: output image (png).
        metric: a name of ``walrus.metrics.METRICS`` (``"vrmse"``, ``"nrmse"``,
            ``"spectral_low"``, ...): one panel per field; or ``"spectral"``: one row per field,
            one column per wavenumber bin of the binned spectral MSE.
        dpi: resolution.

    Returns:
        The written path.
    """
    fields = list(metrics["fields"])
    if metric == "spectral":
        bins = list(metrics.get("spectral_bins", {}).get("names", SPECTRAL_BINS))
        panels = [(f, f"spectral_{b}", f) for f in fields for b in bins]
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
    fig = _new_figure(3.2 * cols, 2.6 * rows)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (title, key, field) in zip(axes, panels):
        for source, style in (("model", "-"), ("persistence", "--")):
            values = np.asarray(metrics[source][key]["per_step"][field], dtype=float)
            steps = np.arange(1, len(values) + 1)
            line = ax.plot(
                steps, values, style, label=source, marker="." if len(values) < 20 else None
            )
            if source == "model" and SPREAD in metrics:
                width = np.asarray(metrics[SPREAD][key]["per_step"][field], dtype=float)
                n = min(len(width), len(values))
                lo = np.maximum(values[:n] - width[:n], values[:n] * 1e-3)  # keep > 0 (log axis)
                ax.fill_between(
                    steps[:n],
                    lo,
                    values[:n] + width[:n],
                    color=line[0].get_color(),
                    alpha=0.25,
                    label="ensemble spread",
                )
            if np.any(values > 0):
                ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(METRIC_LABELS.get(key, key))
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    edges = metrics.get("spectral_bins", {}).get("edges")
    if metric == "spectral" and edges:
        fig.suptitle(f"binned spectral MSE; bin edges |k| = {', '.join(f'{e:.3g}' for e in edges)}")
    axes[0].legend()
    return _save_figure(fig, path, dpi)


def _default_steps(n_steps: int, k: int = 4) -> list[int]:
    return sorted({int(round(s)) for s in np.linspace(1, n_steps, min(k, n_steps))})


def plot_snapshots(
    truth: Any,
    pred: Any,
    field_names: Sequence[str],
    steps: Sequence[int] | None,
    path: str | os.PathLike[str],
    *,
    spread: Any = None,
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
            on the error row's colour scale.
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
    fig = _new_figure(2.4 * cols + 0.6, 2.0 * rows)
    axes = fig.subplots(rows, cols, squeeze=False)
    for c, name in enumerate(field_names):
        shown_t, shown_p = t[[s - 1 for s in steps], c], p[[s - 1 for s in steps], c]
        lo, hi = float(shown_t.min()), float(shown_t.max())
        err_max = float(np.abs(shown_p - shown_t).max()) or 1.0
        for j, s in enumerate(steps):
            panels = (
                ("truth", t[s - 1, c], "viridis", lo, hi),
                ("prediction", p[s - 1, c], "viridis", lo, hi),
                ("error", p[s - 1, c] - t[s - 1, c], "RdBu_r", -err_max, err_max),
            )
            if sd is not None:
                panels += (("spread", sd[s - 1, c], "magma", 0.0, err_max),)
            for r, (label, img, cmap, vmin, vmax) in enumerate(panels):
                ax = axes[per_field * c + r, j]
                if img.ndim == 1:
                    ax.plot(img, lw=1.0)
                    if label == "prediction":
                        ax.plot(t[s - 1, c], "k--", lw=0.8)
                    if label in ("error", "spread"):
                        ax.set_ylim(-1.05 * err_max, 1.05 * err_max)
                    else:
                        lo1, hi1 = min(lo, float(shown_p.min())), max(hi, float(shown_p.max()))
                        ax.set_ylim(lo1 - 0.05 * (hi1 - lo1), hi1 + 0.05 * (hi1 - lo1) + 1e-12)
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
    return _save_figure(fig, path, dpi)


def write_animation(
    truth: Any,
    pred: Any,
    field_names: Sequence[str],
    path_stem: str | os.PathLike[str],
    *,
    fps: int = 8,
    max_frames: int = MAX_FRAMES,
    dpi: int = 72,
) -> Path:
    """Animate truth, prediction and error side by side over the rollout.

    Writes ``<path_stem>.mp4`` when ``ffmpeg`` is on the PATH, else ``<path_stem>.gif`` (Pillow).
    Long rollouts are subsampled to at most ``max_frames`` frames.

    Args:
        truth: ``(S, C, *spatial)``.
        pred: same shape.
        field_names: the C names (rows).
        path_stem: output path without suffix.
        fps: frames per second.
        max_frames: frame cap.
        dpi: resolution.

    Returns:
        The written path.
    """
    from matplotlib.animation import FFMpegWriter, PillowWriter

    t, p = _as_array(truth, "truth"), _as_array(pred, "pred")
    _check_fields(t, p, field_names)
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    t, p = _to_2d_or_1d(t), _to_2d_or_1d(p)
    n_steps = t.shape[0]
    frames = np.unique(np.linspace(0, n_steps - 1, min(max_frames, n_steps)).round().astype(int))
    err = p - t
    fig = _new_figure(7.5, 2.2 * len(field_names))
    axes = fig.subplots(len(field_names), 3, squeeze=False)
    artists = []
    for c, name in enumerate(field_names):
        lo, hi = float(t[:, c].min()), float(t[:, c].max())
        err_max = float(np.abs(err[:, c]).max()) or 1.0
        row = []
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
                ax.set_ylim(
                    vmin - 0.05 * (vmax - vmin) - 1e-12, vmax + 0.05 * (vmax - vmin) + 1e-12
                )
            else:
                art = ax.imshow(data[0, c].T, origin="lower", cmap=cmap, vmin=vmin, vmax=vmax)
                ax.set_xticks([])
                ax.set_yticks([])
            ax.set_title(f"{name} {label}", fontsize=9)
            row.append((art, data))
        artists.append(row)
    title = fig.suptitle("")
    use_mp4 = shutil.which("ffmpeg") is not None
    path = Path(f"{os.fspath(path_stem)}.{'mp4' if use_mp4 else 'gif'}")
    writer = FFMpegWriter(fps=fps) if use_mp4 else PillowWriter(fps=fps)
    with atomic_path(path) as tmp, writer.saving(fig, str(tmp), dpi):
        for i in frames:
            for c, row in enumerate(artists):
                for art, data in row:
                    if data.ndim == 3:
                        art.set_ydata(data[i, c])
                    else:
                        art.set_data(data[i, c].T)
            title.set_text(f"step {i + 1}")
            writer.grab_frame()
    return path
