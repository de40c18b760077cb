"""The quality protocol (docs/quality_protocol.md): every cell, one at a time, as one version.

``python -m benchmarks.quality_protocol [--data-root DATA] [--dry-run] [--allow-dirty]``
(``make benchmark-quality``; hours on 2 cores)

A cell is one dataset at one CPU budget: ``benchmarks.quality`` with seeds 0, 1, 2, one thread,
its default candidates (chosen on validation) and the test split read once. The eight cells
(``DATASETS`` x ``BUDGETS``) of one run are a *version*: ``benchmarks/results/quality_v<N>/``,
one ``<dataset>_cpu<budget>.json`` per cell and ``manifest.json`` (the version, its run record:
commit, dirty flag, start time and CPU, and the planned cells). Cells run in sequence, never
two at a time. A new version starts at a commit that has none; a stopped run resumes at the same
commit, running only the cells it has no file for (a cell's test split is never read twice).
A version that holds every cell refuses a rerun at its commit: rerunning needs a code change,
and then every cell is rerun as the next version.

:func:`verdict` applies the pass rule to one cell; ``benchmarks.quality_table`` renders the
newest version onto docs/results.md and its headline into README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.budgets import BenchmarkError
from benchmarks.common import RESULTS_DIR
from benchmarks.external_data import NAME as EXTERNAL
from benchmarks.record import portable, run_record
from walrus.atomic import write_text_atomic

FORMAT = "quality-protocol/1"
BUILTIN = ("navier_stokes_2d", "gray_scott_2d", "shallow_water_2d")
DATASETS = (*BUILTIN, EXTERNAL)
BUDGETS = (150, 600)  # CPU seconds of training per model and seed
SEEDS = (0, 1, 2)
WINDOWS = ("1", "2-10", "11-30", "31-60", "61+")
# The pass rule compares infer.py's default rollout (with inference jitter) with the better
# of the tuned baselines in each window.
RULE_MODEL = "ours+jitter"
NOT_BASELINES = ("ours", "ours+jitter", "persistence")
MEAN_MAX = 0.90  # ratio of the 3-seed means, every window
SEED_MAX = 0.95  # every seed's ratio, every window
MANIFEST = "manifest.json"
PREFIX = "quality_v"


def cell_name(dataset: str, budget: int) -> str:
    """The file stem of one cell, e.g. ``navier_stokes_2d_cpu150``."""
    return f"{dataset}_cpu{budget}"


def cells() -> list[tuple[str, int]]:
    """Every cell ``(dataset, budget)`` in the order they run: the shorter budget first."""
    return [(d, b) for b in BUDGETS for d in DATASETS]


def versions(results_dir: Path = RESULTS_DIR) -> list[tuple[int, Path]]:
    """Every version folder ``quality_v<N>`` under ``results_dir``, oldest first."""
    found = []
    for path in Path(results_dir).glob(f"{PREFIX}*"):
        m = re.fullmatch(rf"{PREFIX}(\d+)", path.name)
        if m and path.is_dir():
            found.append((int(m.group(1)), path))
    return sorted(found)


def manifest(version_dir: Path) -> dict[str, Any]:
    """The manifest of a version folder (``{}`` when it has none)."""
    path = Path(version_dir) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def done_cells(version_dir: Path) -> list[str]:
    """The cells of a version that have their result file, in run order."""
    return [n for n in (cell_name(*c) for c in cells()) if (version_dir / f"{n}.json").is_file()]


def plan(commit: str | None, results_dir: Path = RESULTS_DIR) -> tuple[int, Path, bool]:
    """``(N, folder, resume)``: the version a run at ``commit`` writes.

    The newest version is resumed when it was started at ``commit`` and lacks a cell; one that
    is complete at ``commit`` is an error (a rerun needs a code change); otherwise version N + 1.
    """
    found = versions(results_dir)
    if found:
        n, path = found[-1]
        if commit is not None and manifest(path).get("record", {}).get("commit") == commit:
            if len(done_cells(path)) == len(cells()):
                raise BenchmarkError(
                    f"{path.name} already holds every cell at commit {commit[:7]}: a test cell is "
                    "read once; rerun only after a code change (a new commit)"
                )
            return n, path, True
        return n + 1, Path(results_dir) / f"{PREFIX}{n + 1}", False
    return 1, Path(results_dir) / f"{PREFIX}1", False


def cell_argv(dataset: str, budget: int, data_root: Path, version_dir: Path) -> list[str]:
    """The ``benchmarks.quality`` arguments of one cell."""
    name = cell_name(dataset, budget)
    data = ["--systems", dataset] if dataset in BUILTIN else ["--systems", "none"]
    if dataset == EXTERNAL:
        data += ["--dataset", str(data_root / EXTERNAL)]
    return [
        *data,
        "--data-root",
        str(data_root),
        "--cpu-seconds",
        str(budget),
        "--seeds",
        ",".join(map(str, SEEDS)),
        "--threads",
        "1",
        "--results-dir",
        str(version_dir),
        "--name",
        name,
        "--work-dir",
        str(Path("outputs") / "quality_protocol" / version_dir.name / name),
    ]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _by_seed(model: Mapping[str, Any], window: str) -> dict[int, float | None]:
    return {s["seed"]: s["rollout"]["mean"].get(window) for s in model["per_seed"]}


def verdict(run: Mapping[str, Any]) -> dict[str, Any]:
    """The pass rule on one cell (a ``runs`` entry of a ``benchmarks.quality`` file).

    Per window, the better baseline is the one with the lower 3-seed mean test VRMSE; the
    window passes when ``RULE_MODEL``'s mean over it is at most ``MEAN_MAX`` and every seed's
    ratio (same seed on both sides) at most ``SEED_MAX``. A window where ``RULE_MODEL``
    diverged fails; one where every baseline diverged passes. Windows the cell's rollout does
    not reach are left out.

    Returns:
        ``{"windows": {w: {"baseline", "ratio", "seed_ratios", "pass"}}, "pass": bool}``.
    """
    models = run["models"]
    ours = models[RULE_MODEL]
    baselines = {n: m for n, m in models.items() if n not in NOT_BASELINES}
    if not baselines:
        raise BenchmarkError(f"{run.get('system', 'a run')}: no baseline to compare with")
    out: dict[str, Any] = {}
    for w in (w for w in WINDOWS if w in run.get("windows", WINDOWS)):  # a short set has fewer
        mine = ours["stats"]["rollout"].get(w, {}).get("mean")
        means = {n: m["stats"]["rollout"].get(w, {}).get("mean") for n, m in baselines.items()}
        defined = {n: v for n, v in means.items() if v is not None}
        if not defined:
            out[w] = {"baseline": None, "ratio": None, "seed_ratios": [], "pass": mine is not None}
            continue
        best = min(defined, key=defined.get)
        theirs = _by_seed(baselines[best], w)
        seeds = [_ratio(v, theirs.get(s)) for s, v in _by_seed(ours, w).items()]
        ratio = _ratio(mine, defined[best])
        ok = ratio is not None and ratio <= MEAN_MAX and None not in seeds and seeds != []
        ok = ok and max(seeds) <= SEED_MAX
        out[w] = {"baseline": best, "ratio": ratio, "seed_ratios": seeds, "pass": ok}
    return {"windows": out, "pass": all(v["pass"] for v in out.values())}


def _run(cmd: Sequence[str], what: str) -> None:
    print("+ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise BenchmarkError(f"{what} failed; rerun the same command at this commit to resume")


def run(args: argparse.Namespace, argv: Sequence[str]) -> Path:
    """Run every missing cell of the version this commit writes; returns its folder."""
    record = run_record(["benchmarks.quality_protocol", *argv])
    if record["dirty"] and not args.allow_dirty:
        raise BenchmarkError(
            "the working tree differs from its commit (git status, outside benchmarks/results): "
            "commit first, so that the version names the code it ran (or pass --allow-dirty)"
        )
    results = Path(args.results_dir)
    n, version_dir, resume = plan(record["commit"], results)
    todo = [c for c in cells() if cell_name(*c) not in done_cells(version_dir)]
    data_root = Path(args.data_root)
    print(
        f"{'resuming' if resume else 'starting'} {version_dir.name}: "
        f"{len(todo)} of {len(cells())} cells to run, one at a time"
    )
    commands = []
    if not (data_root / EXTERNAL / "data").is_dir():
        external = ["-m", "benchmarks.external_data", "--out", str(data_root)]
        commands.append(([sys.executable, *external], f"writing {EXTERNAL}"))
    for dataset, budget in todo:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.quality",
            *cell_argv(dataset, budget, data_root, version_dir),
        ]
        commands.append((cmd, f"cell {cell_name(dataset, budget)}"))
    if args.dry_run:
        for cmd, _ in commands:
            print(" ".join(cmd))
        return version_dir
    if not resume:
        version_dir.mkdir(parents=True, exist_ok=False)
        body = {
            "format": FORMAT,
            "version": n,
            "record": {k: v for k, v in record.items() if k != "_t0"},
            "cells": [cell_name(*c) for c in cells()],
            "seeds": list(SEEDS),
            "rule": {"model": RULE_MODEL, "mean_max": MEAN_MAX, "seed_max": SEED_MAX},
        }
        write_text_atomic(version_dir / MANIFEST, json.dumps(portable(body), indent=2) + "\n")
    for cmd, what in commands:
        _run(cmd, what)
    print(f"{version_dir.name} complete; render it with python -m benchmarks.quality_table --write")
    return version_dir


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point; bad input or a failed cell exits 2 with one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.quality_protocol", description=__doc__.splitlines()[0]
    )
    p.add_argument("--data-root", default=os.environ.get("WALRUS_DATA_DIR", "data"))
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--allow-dirty", action="store_true", help="run on an uncommitted tree")
    args = p.parse_args(argv)
    try:
        run(args, argv)
    except BenchmarkError as e:
        print(f"benchmarks.quality_protocol: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
