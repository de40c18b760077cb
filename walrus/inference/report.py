"""What inference leaves behind: metrics.json, predictions.hdf5, plots, and a printed table.

Every file is written to a temporary name in its folder and renamed into place, so an
interrupted run never leaves a half-written file under the final name.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from walrus.atomic import write_text_atomic
from walrus.bcs import BoundaryType
from walrus.data.well_dataset import WellDataset
from walrus.data.writer import write_well_file
from walrus.metrics import ENSEMBLE, NEGLIGIBLE_POWER, SPATIAL_MEAN, SPECTRAL_BINS

# The printed tables: point-wise errors, the binned spectral MSE (one column pair per bin), then
# the physical-fidelity measures (1 is ideal for all of them).
TABLES = (
    ("", {"vrmse": "VRMSE", "nrmse": "NRMSE"}),
    (
        "binned spectral MSE (residual power / true power, per wavenumber bin)",
        {f"spectral_{b}": f"{b} k" for b in SPECTRAL_BINS},
    ),
    (
        "physical fidelity, 1 is ideal (amplitude: RMS about the spatial mean, predicted / "
        "true;\nchange corr: correlation of the predicted and true frame-to-frame changes)",
        {"amplitude_ratio": "amplitude", "change_correlation": "change corr"},
    ),
    (
        "power spectrum ratio (predicted power / true power, per wavenumber bin; 1 is ideal)",
        {f"power_ratio_{b}": f"{b} k" for b in SPECTRAL_BINS},
    ),
)
NOTE_WIDTH = 100  # the lines under a table are wrapped to this width
SOURCE_LABELS = {"model": "model", "persistence": "persist.", SPATIAL_MEAN: "sp.mean"}
# the fidelity tables (1 is ideal): their rows name the field furthest from 1
FIDELITY_TABLES = frozenset({2, 3})
SPATIAL_MEAN_NOTE = (
    "sp.mean: predicting each true frame's own spatial mean everywhere (VRMSE just under 1); a "
    "model above it does worse than a flat field at the right level"
)
WORST_NOTE = (
    "worst field: the field whose measure is furthest from 1 in that window (ratios by their "
    "factor either way, the change correlation by 1 - corr)"
)


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented JSON, atomically."""
    return write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def write_predictions(
    path: str | os.PathLike,
    ds: WellDataset,
    predictions: Sequence[np.ndarray],
    trajectory: int,
    first_frame: int,
    stride: int,
    spreads: Sequence[np.ndarray] | None = None,
) -> Path:
    """Write predicted frames as a Well file in the input's own layout, one trajectory each.

    Scalar fields go to ``t0_fields``, vector fields to ``t1_fields`` and tensor fields to
    ``t2_fields`` as the input file stores them, so The Well's ``WellDataset`` reads the file as
    a dataset and our reader gives back the input's channel names. A field of which only some
    components were selected is stored one t0 field per component (``velocity_x``).

    Args:
        path: the ``.hdf5`` file.
        ds: the dataset rolled out (gives fields, coordinates, boundaries and times).
        predictions: per trajectory ``(S, C, *spatial)``; all with the same ``S >= 1``.
        trajectory: trajectory whose time axis labels the frames.
        first_frame: strided frame index of the first prediction in that trajectory.
        stride: time stride of the rollout.
        spreads: an ensemble's standard deviation, shaped like ``predictions``; stored next to
            each field, in its group, as ``<field>_spread``.

    Returns:
        The written path.
    """
    arr = np.stack([np.asarray(p, dtype=np.float32) for p in predictions])  # (N, S, C, *sp)
    groups = _field_groups(ds, arr, "")
    if spreads is not None:
        spread = np.stack([np.asarray(p, dtype=np.float32) for p in spreads])  # (N, S, C, *sp)
        if spread.shape != arr.shape:
            raise ValueError(f"spreads shape {spread.shape} != predictions shape {arr.shape}")
        for group, extra in zip(groups, _field_groups(ds, spread, "_spread")):
            group.update(extra)
    k, local = ds.locate_trajectory(trajectory)
    wf = ds.files[k]
    times = wf.time if wf.time.ndim == 1 else wf.time[local]
    n_steps = arr.shape[1]
    t_index = (first_frame + np.arange(n_steps)) * stride
    t_index = np.minimum(t_index, times.shape[0] - 1)
    bcs = {
        axis: (BoundaryType(int(lo)), BoundaryType(int(hi)))
        for axis, (lo, hi) in zip(wf.spatial_dims, ds.bcs.tolist())
    }
    return write_well_file(
        path,
        ds.dataset,
        coords={a: wf.coords[a] for a in wf.spatial_dims},
        time=np.asarray(times)[t_index],
        n_trajectories=arr.shape[0],
        fields=groups[0],
        vector_fields=groups[1],
        tensor_fields=groups[2],
        bcs=bcs,
    )


def _field_groups(
    ds: WellDataset, arr: np.ndarray, suffix: str
) -> tuple[dict[str, np.ndarray], ...]:
    """Channels ``arr (N, S, C, *sp)`` regrouped into the input's fields, by rank.

    Returns:
        ``(t0, t1, t2)``: name -> ``(N, S, *sp)``, ``(N, S, *sp, D)``, ``(N, S, *sp, D, D)``.
    """
    groups: tuple[dict[str, np.ndarray], ...] = ({}, {}, {})
    c = 0
    for fi, comps in ds.selections[0]:
        block = arr[:, :, c : c + len(comps)]  # (N, S, n, *sp)
        c += len(comps)
        if fi.rank == 0 or list(comps) != list(range(len(fi.components))):
            for j, comp in enumerate(comps):
                groups[0][fi.components[comp] + suffix] = block[:, :, j]
            continue
        value = np.moveaxis(block, 2, -1)  # (N, S, *sp, D or D*D)
        if fi.rank == 2:
            d = len(fi.dim_varying)
            value = value.reshape(*value.shape[:-1], d, d)  # (N, S, *sp, D, D)
        groups[fi.rank][fi.name + suffix] = value
    return groups


def _fmt(value: float | None) -> str:
    """A table cell: ``None`` (undefined) is ``n/a``."""
    if value is None:
        return "n/a"
    return "nan" if math.isnan(value) else f"{value:.4g}"


def table_notes(metrics: Mapping[str, Any]) -> list[str]:
    """Lines under a table: constant fields left out of the means, and what ``n/a`` means."""
    notes = []
    if metrics.get("constant_fields"):
        notes.append(
            "constant in space and time, left out of the means over fields: "
            + ", ".join(metrics["constant_fields"])
        )
    steps = metrics["steps"]
    empty = []
    for field, bins in metrics.get("negligible_true_power", {}).items():
        parts = [
            f"{b} k" + ("" if len(at) == steps else f" at {len(at)} of {steps} steps")
            for b, at in bins.items()
            if at
        ]
        if parts and field not in metrics.get("constant_fields", []):
            empty.append(f"{field}: {', '.join(parts)}")
    if empty:
        notes.append(
            f"negligible true power (at most {NEGLIGIBLE_POWER:g} of the field's power about its "
            f"mean), spectral MSE and power ratio n/a: {'; '.join(empty)}"
        )
    notes.append(
        "n/a: undefined (negligible true power or true change; persistence does not change)"
    )
    return [textwrap.fill(note, NOTE_WIDTH, subsequent_indent="  ") for note in notes]


def _sources(metrics: Mapping[str, Any], table: int) -> list[str]:
    """The columns' sources of table ``table``: model, persistence and, in the error table of
    metrics that hold it, the spatial-mean reference."""
    extra = [SPATIAL_MEAN] if table == 0 and SPATIAL_MEAN in metrics else []
    return ["model", "persistence", *extra]


def _deviation(metric: str, value: float | None) -> float:
    """How far a fidelity value is from the ideal 1: ``|ln ratio|``, or ``1 - corr``."""
    if value is None or math.isnan(value):
        return -math.inf
    if metric == "change_correlation":
        return 1.0 - value
    return math.inf if value <= 0 else abs(math.log(value))


def worst_field(metrics: Mapping[str, Any], measures: Sequence[str], window: str) -> str:
    """``"field (measure value)"``: the model's field and measure furthest from 1 in ``window``
    among ``measures`` (fidelity keys), over the fields in the mean; ``n/a`` if none is defined."""
    labels = {k: v for _, table in TABLES for k, v in table.items()}
    best = (-math.inf, "n/a")
    for field in metrics["fields_in_mean"]:
        for m in measures:
            value = metrics["model"][m]["windows"][field].get(window)
            dev = _deviation(m, value)
            if dev > best[0]:
                best = (dev, f"{field} ({labels.get(m, m)} {_fmt(value)})")
    return best[1]


def format_rollout_table(name: str, metrics: Mapping[str, Any]) -> str:
    """Windowed errors and fidelity measures, mean over fields, model against persistence and
    (errors) the spatial-mean reference; the fidelity tables name the worst field of each
    window; an ensemble adds its scores (``format_ensemble_table``).

    Args:
        name: dataset name (title line).
        metrics: ``RolloutMetrics.to_dict()``.
    """
    windows = list(metrics["windows"])
    blocks = [f"{name}: {metrics['steps']} steps, mean over fields {metrics['fields_in_mean']}"]
    several = len(metrics["fields_in_mean"]) > 1
    for t, (title, labels) in enumerate(TABLES):
        sources = _sources(metrics, t)
        worst = several and t in FIDELITY_TABLES
        head = ["steps"] + [f"{lab} {SOURCE_LABELS[s]}" for lab in labels.values() for s in sources]
        rows = [
            [w]
            + [
                _fmt(metrics[s][m]["mean_over_fields"]["windows"][w])
                for m in labels
                for s in sources
            ]
            + ([worst_field(metrics, list(labels), w)] if worst else [])
            for w in windows
        ]
        blocks.append(_table(title, head + (["worst field"] if worst else []), rows))
    notes = [SPATIAL_MEAN_NOTE] if SPATIAL_MEAN in metrics else []
    notes += [WORST_NOTE] if several else []
    if ENSEMBLE in metrics:
        blocks.append(format_ensemble_table(metrics))
    wrapped = [textwrap.fill(n, NOTE_WIDTH, subsequent_indent="  ") for n in notes]
    return "\n".join(blocks + wrapped + table_notes(metrics))


def format_ensemble_table(metrics: Mapping[str, Any]) -> str:
    """The ensemble's scores per step window, mean over fields, and the field whose
    spread-skill ratio is furthest from 1."""
    ens = metrics[ENSEMBLE]
    title = textwrap.fill(
        f"ensemble of {ens['members']} members (spread/skill: spread-skill ratio with the "
        "finite-ensemble correction sqrt((K+1)/K), 1 is calibrated, below 1 too sure; CRPS: fair "
        "CRPS over the truth's spatial std, 0 is exact; rank max/flat: largest rank-histogram "
        "bin over the flat level, 1 is flat)",
        NOTE_WIDTH,
    )
    keys = {"spread_skill": "spread/skill", "crps": "CRPS", "rank_max_over_flat": "rank max/flat"}
    head = ["steps", *keys.values(), "worst spread/skill"]
    rows = []
    for w in metrics["windows"]:
        row = [w] + [_fmt(ens[k]["mean_over_fields"]["windows"].get(w)) for k in keys]
        ratios = {f: ens["spread_skill"]["windows"][f].get(w) for f in metrics["fields_in_mean"]}
        devs = {f: _deviation("spread_skill", v) for f, v in ratios.items()}
        far = max(devs, key=devs.get, default=None)
        row.append(
            "n/a" if far is None or devs[far] == -math.inf else f"{far} ({_fmt(ratios[far])})"
        )
        rows.append(row)
    return _table(title, head, rows)


def format_evaluate_table(name: str, metrics: Mapping[str, Any], n_windows: int) -> str:
    """One-step errors and fidelity per field and their mean, model against persistence and
    (errors) the spatial-mean reference; an ensemble adds its scores."""
    blocks = [f"{name}: one-step errors over {n_windows} windows"]
    for t, (title, labels) in enumerate(TABLES):
        sources = _sources(metrics, t)
        head = ["field"] + [f"{lab} {SOURCE_LABELS[s]}" for lab in labels.values() for s in sources]
        rows = []
        for field in [*metrics["fields"], "mean"]:
            row = [field]
            for m in labels:
                for s in sources:
                    entry = metrics[s][m]
                    values = (
                        entry["mean_over_fields"]["per_step"]
                        if field == "mean"
                        else entry["per_step"][field]
                    )
                    row.append(_fmt(values[0]) if values else "n/a")
            rows.append(row)
        blocks.append(_table(title, head, rows))
    if ENSEMBLE in metrics:
        blocks.append(format_ensemble_table(metrics))
    notes = [SPATIAL_MEAN_NOTE] if SPATIAL_MEAN in metrics else []
    wrapped = [textwrap.fill(n, NOTE_WIDTH, subsequent_indent="  ") for n in notes]
    return "\n".join(blocks + wrapped + table_notes(metrics))


def _table(title: str, head: list[str], rows: list[list[str]]) -> str:
    """Right-aligned columns under a header and a rule; ``title`` (if any) on the line above."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join
    out = [title] if title else []
    out.append(line(h.rjust(w) for h, w in zip(head, widths)))
    out.append(line("-" * w for w in widths))
    out += [line(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)
