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
from walrus.metrics import NEGLIGIBLE_POWER, SPECTRAL_BINS

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
SOURCE_LABELS = {"model": "model", "persistence": "persist."}


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


def format_rollout_table(name: str, metrics: Mapping[str, Any]) -> str:
    """Windowed errors and fidelity measures, mean over fields, model against persistence.

    Args:
        name: dataset name (title line).
        metrics: ``RolloutMetrics.to_dict()``.
    """
    windows = list(metrics["windows"])
    blocks = [f"{name}: {metrics['steps']} steps, mean over fields {metrics['fields_in_mean']}"]
    for title, labels in TABLES:
        head = ["steps"] + [
            f"{lab} {SOURCE_LABELS[s]}" for lab in labels.values() for s in SOURCE_LABELS
        ]
        rows = [
            [w]
            + [
                _fmt(metrics[s][m]["mean_over_fields"]["windows"][w])
                for m in labels
                for s in SOURCE_LABELS
            ]
            for w in windows
        ]
        blocks.append(_table(title, head, rows))
    return "\n".join(blocks + table_notes(metrics))


def format_evaluate_table(name: str, metrics: Mapping[str, Any], n_windows: int) -> str:
    """One-step errors and fidelity per field and their mean, model against persistence."""
    blocks = [f"{name}: one-step errors over {n_windows} windows"]
    for title, labels in TABLES:
        head = ["field"] + [
            f"{lab} {SOURCE_LABELS[s]}" for lab in labels.values() for s in SOURCE_LABELS
        ]
        rows = []
        for field in [*metrics["fields"], "mean"]:
            row = [field]
            for m in labels:
                for s in SOURCE_LABELS:
                    entry = metrics[s][m]
                    values = (
                        entry["mean_over_fields"]["per_step"]
                        if field == "mean"
                        else entry["per_step"][field]
                    )
                    row.append(_fmt(values[0]) if values else "n/a")
            rows.append(row)
        blocks.append(_table(title, head, rows))
    return "\n".join(blocks + table_notes(metrics))


def _table(title: str, head: list[str], rows: list[list[str]]) -> str:
    """Right-aligned columns under a header and a rule; ``title`` (if any) on the line above."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join
    out = [title] if title else []
    out.append(line(h.rjust(w) for h, w in zip(head, widths)))
    out.append(line("-" * w for w in widths))
    out += [line(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)
