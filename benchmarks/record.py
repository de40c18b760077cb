"""Run records and portable result JSON, shared by the benchmark scripts.

:func:`run_record` reads the commit, the dirty flag (``git status --porcelain``, result files under
``benchmarks/results/`` left out), the start time, the CPU model and vector capability, argv,
versions, threads, nproc and the load average when a run starts; :func:`finish_record`
adds only what belongs to the end (load average, wall and CPU seconds). :func:`save_result`
writes JSON atomically with every absolute path made portable (:func:`portable_path`: relative
to the repository inside it, the last name outside it), so no machine's layout is stored.
"""

from __future__ import annotations

import importlib.metadata
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import cpu_model, save_json

REPO = Path(__file__).resolve().parents[1]
# Written by the runs themselves: a results file written so far does not make the tree dirty.
RESULTS_PATHSPEC = ":(exclude)benchmarks/results"
PACKAGES = ("torch", "lightning", "hydra-core", "numpy", "h5py", "neuraloperator", "py-pde")


def _git(*args: str) -> str | None:
    """Output of ``git args`` in the repository, ``None`` where git or the repository is missing."""
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def _now() -> datetime:
    return datetime.now(timezone.utc)


def versions() -> dict[str, str | None]:
    """Installed versions of the packages behind the figures (``None``: not installed)."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_record(argv: Sequence[str]) -> dict[str, Any]:
    """The facts of a run, read when it starts: call this first, before any training.

    Returns:
        ``{"commit", "dirty", "started", "cpu_model", "cpu_capability", "argv", "versions",
        "torch_threads", "nproc", "loadavg_before"}``; ``dirty`` is whether ``git status
        --porcelain`` listed anything outside ``benchmarks/results/`` (``None`` outside a git
        checkout). :func:`finish_record` completes it.
    """
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--", ".", RESULTS_PATHSPEC)
    return {
        "commit": commit.strip() if commit is not None else None,
        "dirty": bool(status.strip()) if status is not None else None,
        "started": _now().isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "argv": list(argv),
        "versions": versions(),
        "torch_threads": torch.get_num_threads(),
        "nproc": os.cpu_count(),
        "loadavg_before": list(os.getloadavg()),
        "_t0": (time.perf_counter(), time.process_time()),
    }


def finish_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the load average, wall and CPU seconds at the end (nothing re-read)."""
    out = {k: v for k, v in record.items() if k != "_t0"}
    wall0, cpu0 = record["_t0"]
    out.update(
        loadavg_after=list(os.getloadavg()),
        wall_s=time.perf_counter() - wall0,
        cpu_s=time.process_time() - cpu0,
    )
    return out


def portable_path(path: str | os.PathLike) -> str:
    """A path inside the repository relative to it; any other absolute path as its last name."""
    p = Path(path)
    if not p.is_absolute():
        return str(p)
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return p.name


def _portable_text(text: str) -> str:
    """``text`` with an absolute path, alone or after ``=`` (``--opt=/x``, ``k=/x``), made portable."""
    key, sep, value = text.rpartition("=")
    if sep and value.startswith(os.sep):
        return f"{key}={portable_path(value)}"
    return portable_path(text) if text.startswith(os.sep) else text


def portable(data: Any) -> Any:
    """A copy of JSON-able ``data`` in which every absolute path string is made portable."""
    if isinstance(data, Mapping):
        return {k: portable(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [portable(v) for v in data]
    return _portable_text(data) if isinstance(data, str) else data


def save_result(name: str, data: dict[str, Any], results_dir: str | Path | None = None) -> Path:
    """Write ``data`` (paths made portable) as ``<results_dir>/<name>.json``, atomically."""
    return save_json(name, portable(data), results_dir)


def spread(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """Mean, sample standard deviation (0 for one value), min and max of ``values``.

    ``None`` (a diverged or undefined value) makes every statistic ``None``.
    """
    if not values or any(v is None for v in values):
        return {"mean": None, "std": None, "min": None, "max": None, "n": len(values)}
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }
