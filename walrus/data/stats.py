"""Per-field statistics of a Well dataset, ``stats.yaml``.

``python -m walrus.data.stats ROOT/DATASET`` streams over the train split (a few frames at a
time, never a whole file) and writes ``ROOT/DATASET/stats.yaml`` atomically with, per field
component: ``mean``, ``std``, ``rms`` of the values and ``mean_delta``, ``std_delta``,
``rms_delta`` of consecutive-frame differences.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from walrus.atomic import write_text_atomic
from walrus.data.storage import as_location, check_regular_file, is_url, name, parent
from walrus.data.well_file import WellFile, list_split_files, open_h5
from walrus.safe_yaml import load_yaml

STAT_KEYS = ("mean", "std", "rms", "mean_delta", "std_delta", "rms_delta")


class _Moments:
    """Running count, sum and sum of squares per channel, in float64."""

    def __init__(self, n_channels: int) -> None:
        self.count = 0
        self.sum = np.zeros(n_channels)
        self.sumsq = np.zeros(n_channels)

    def add(self, x: np.ndarray) -> None:
        """``x`` ``(T, C, *spatial)``."""
        axes = (0, *range(2, x.ndim))
        x = x.astype(np.float64)
        self.count += x.size // x.shape[1]
        self.sum += x.sum(axis=axes)
        self.sumsq += np.square(x).sum(axis=axes)

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = max(self.count, 1)
        mean = self.sum / n
        ms = self.sumsq / n
        return mean, np.sqrt(np.maximum(ms - mean**2, 0.0)), np.sqrt(ms)


def compute_stats(
    dataset_dir: str | os.PathLike, split: str = "train", max_bytes: int = 64 << 20
) -> dict[str, dict[str, float]]:
    """Statistics of every field component over one split.

    Args:
        dataset_dir: ``ROOT/DATASET``, a local folder or an fsspec URL.
        split: split to stream over.
        max_bytes: upper bound on the frames read at once.

    Returns:
        ``{stat: {component name: value}}`` for ``stat`` in ``STAT_KEYS``.
    """
    loc = as_location(dataset_dir)
    files = [WellFile(p) for p in list_split_files(parent(loc), name(loc), split)]
    names = files[0].field_names
    values, deltas = _Moments(len(names)), _Moments(len(names))
    for wf in files:
        if wf.field_names != names:
            raise ValueError(
                f"{wf.path}: fields {wf.field_names} differ from {files[0].path} ({names})"
            )
        sel = wf.select(None)
        frame_bytes = 4 * len(names) * math.prod(wf.spatial_shape)
        chunk = max(2, min(wf.n_time, max_bytes // max(frame_bytes, 1)))
        with open_h5(wf.path) as h:
            for traj in range(wf.n_trajectories):
                prev = None
                for start in range(0, wf.n_time, chunk):
                    n = min(chunk, wf.n_time - start)
                    x = wf.read(h, sel, traj, start, n)  # (n, C, *spatial)
                    values.add(x)
                    if prev is not None:
                        x = np.concatenate([prev, x])
                    if x.shape[0] > 1:
                        deltas.add(x[1:] - x[:-1])
                    prev = x[-1:]
    mean, std, rms = values.finish()
    mean_d, std_d, rms_d = deltas.finish()
    out: dict[str, dict[str, float]] = {}
    for key, arr in zip(STAT_KEYS, (mean, std, rms, mean_d, std_d, rms_d)):
        out[key] = {n: float(v) for n, v in zip(names, arr)}
    return out


def write_stats(dataset_dir: str | os.PathLike, split: str = "train") -> Path:
    """Compute and atomically write ``dataset_dir/stats.yaml`` (a local folder); returns its path."""
    if is_url(dataset_dir):
        raise ValueError(
            f"{dataset_dir}/stats.yaml is missing and walrus does not write under a URL; use "
            "data.normalization=rms, or compute it on a local copy (python -m walrus.data.stats "
            "DIR) and put it there"
        )
    dataset_dir = Path(dataset_dir)
    stats = compute_stats(dataset_dir, split)
    path = dataset_dir / "stats.yaml"
    return write_text_atomic(path, yaml.safe_dump(stats, sort_keys=False))


def load_stats(
    path: str | os.PathLike, spatial_dims: Sequence[str] = ("x", "y", "z")
) -> dict[str, dict[str, float]]:
    """Read a ``stats.yaml`` (local path or fsspec URL), flattening per-field lists.

    Real Well files store a vector field's statistic as a list (``velocity: [a, b]``) and a
    tensor's as a nested list; these become ``velocity_x, velocity_y`` and ``stress_xx, ...``.
    The file is read with ``walrus.safe_yaml`` (no aliases, no tags, at most 1 MiB); every
    value must be a finite number (or a list of them). Sections that are not mappings are
    skipped.

    Returns:
        ``{stat: {component name: float}}``.

    Raises:
        FileNotFoundError: no such file. ValueError: anything else wrong, naming file and key.
    """
    loc = as_location(path)
    try:
        check_regular_file(loc)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{loc}: no such stats file (run python -m walrus.data.stats {parent(loc)})"
        ) from None
    raw = load_yaml(loc)
    if not isinstance(raw, Mapping):
        raise ValueError(f"{loc}: expected a mapping of statistics, got {type(raw).__name__}")
    out: dict[str, dict[str, float]] = {}
    for key, table in raw.items():
        if not isinstance(table, Mapping):
            continue
        flat: dict[str, float] = {}
        for field, value in table.items():
            _flatten(flat, str(field), value, spatial_dims, f"{loc}: {key}.{field}")
        out[str(key)] = flat
    return out


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number, got {type(value).__name__} {value!r:.40}")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise ValueError(f"{where}: expected a finite number, got {value!r:.40}")
    return x


def _flatten(out: dict[str, float], name: str, value: Any, dims: Sequence[str], where: str) -> None:
    """Add statistic ``value`` of field ``name`` (a number, a list, or a list of lists)."""
    if not isinstance(value, list):
        out[name] = _number(value, where)
        return
    if len(value) > len(dims):
        raise ValueError(f"{where}: {len(value)} entries, but at most {len(dims)} axes")
    if len({isinstance(v, list) for v in value}) > 1:
        raise ValueError(f"{where}: mixes numbers and lists")
    for i, (a, v) in enumerate(zip(dims, value)):
        if not isinstance(v, list):
            out[f"{name}_{a}"] = _number(v, f"{where}[{i}]")
            continue
        if len(v) > len(dims):
            raise ValueError(f"{where}[{i}]: {len(v)} entries, but at most {len(dims)} axes")
        for j, (b, x) in enumerate(zip(dims, v)):
            out[f"{name}_{a}{b}"] = _number(x, f"{where}[{i}][{j}]")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m walrus.data.stats DIR``; bad or missing data is one ``error:`` line, exit 2."""
    from walrus.cli import run_cli

    parser = argparse.ArgumentParser(
        prog="python -m walrus.data.stats", description="Compute stats.yaml of a Well dataset."
    )
    parser.add_argument("dataset_dir", help="ROOT/DATASET, holding data/train/*.hdf5")
    parser.add_argument("--split", default="train")
    args = parser.parse_args(argv)
    path = run_cli(lambda: write_stats(args.dataset_dir, args.split))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
