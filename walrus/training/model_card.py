"""A training run's model card: ``MODEL_CARD.md`` and ``model_card.json`` beside its checkpoint.

The card says what the model was trained on (systems, dimensions, fields, boundary types,
trajectory counts, grids), what the training cost (time budget, steps, CPU seconds, threads,
machine load), which model it is (preset, parameters), how well it does on the validation split
of each system (one-step VRMSE, and windowed rollout VRMSE from the start of every validation
trajectory, both against persistence, computed in this process as ``infer.py evaluate`` / ``rollout``
compute them) with a verdict per system and window (beat, tie or lose: a tie when the model's
VRMSE is within ``--tie-tolerance`` of persistence's) and the commit it was built from::

    python -m walrus.training.model_card RUN_DIR [--data-dir DIR] [--max-windows N]
        [--steps N] [--max-trajectories N] [--tie-tolerance F]

``--max-windows``, ``--steps`` and ``--max-trajectories`` bound its time (``make pretrain``
passes small ones, so the card takes about a minute).

Everything comes from ``RUN_DIR/checkpoints/last.ckpt`` (validated field by field) and the data
it names; the training cost from the :class:`TrainingCost` callback (``experiment=pretrain``
adds it), else it is reported as unknown.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml

from walrus.atomic import write_text_atomic
from walrus.bcs import BoundaryType
from walrus.checkpoint import load_checkpoint_file, walrus_meta
from walrus.cli import LIGHTNING_LOGGERS, QUIET_WARNINGS
from walrus.data.datamodule import parse_dataset_specs
from walrus.data.well_dataset import WellDataset
from walrus.data.well_file import SPLITS
from walrus.model.config import WalrusConfig
from walrus.training.resume import read_record

REPO = Path(__file__).resolve().parents[2]
COST_KEY = "TrainingCost"
CARD_DIR = "model_card"  # the inference runs behind the metrics go here, inside the run folder
# a tie: the model's VRMSE within this fraction of persistence's (either side)
TIE_TOLERANCE = 0.05
VERDICTS = ("beat", "tie", "lose")
_COST_FIELDS = ("cpu_s", "wall_s")


class TrainingCost(pl.Callback):
    """Stores what fitting cost in every checkpoint: process CPU seconds and wall seconds since
    fitting started (carried over a resume), torch threads, and the load average at the start
    and at the save. The model card reads it back."""

    def __init__(self) -> None:
        self._offset = {k: 0.0 for k in _COST_FIELDS}
        self._start: dict[str, float] | None = None
        self._load_start: list[float] | None = None

    @property
    def state_key(self) -> str:
        return COST_KEY

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = {"cpu_s": time.process_time(), "wall_s": time.monotonic()}
        if self._load_start is None:
            self._load_start = list(os.getloadavg())

    def used(self) -> dict[str, float]:
        """CPU and wall seconds of fitting so far."""
        now = {"cpu_s": time.process_time(), "wall_s": time.monotonic()}
        return {
            k: self._offset[k] + (now[k] - self._start[k] if self._start else 0.0)
            for k in _COST_FIELDS
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.used(),
            "threads": torch.get_num_threads(),
            "loadavg_start": self._load_start or list(os.getloadavg()),
            "loadavg_end": list(os.getloadavg()),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        cost = check_cost(state_dict, "the checkpoint being resumed")
        self._offset = {k: cost[k] for k in _COST_FIELDS}
        self._load_start = cost["loadavg_start"]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_cost(state: Any, source: str) -> dict[str, Any]:
    """``state`` (read from a checkpoint) as a :class:`TrainingCost` state, or a one-line error."""
    ok = (
        isinstance(state, Mapping)
        and all(_number(state.get(k)) and state[k] >= 0 for k in _COST_FIELDS)
        and isinstance(state.get("threads"), int)
        and all(
            isinstance(state.get(k), list) and len(state[k]) == 3 and all(map(_number, state[k]))
            for k in ("loadavg_start", "loadavg_end")
        )
    )
    if not ok:
        raise ValueError(
            f"{source}: its {COST_KEY} entry is not CPU/wall seconds, threads and load averages"
        )
    return {
        **{k: float(state[k]) for k in _COST_FIELDS},
        "threads": int(state["threads"]),
        **{k: [float(v) for v in state[k]] for k in ("loadavg_start", "loadavg_end")},
    }


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the source tree."""

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=repo, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def model_preset(model_config: Mapping[str, Any], config_dir: Path = REPO / "configs") -> str:
    """The name of the ``configs/model`` preset whose architecture ``model_config`` has
    (``"custom"`` when none matches). The vocabulary size and run-time knobs are not compared."""
    skip = {"n_fields", "include_d", "_target_", *WalrusConfig.RUNTIME_OPTIONS}
    for path in sorted((config_dir / "model").glob("*.yaml")):
        preset = yaml.safe_load(path.read_text()) or {}
        keys = set(preset) - skip
        if keys and all(preset[k] == model_config.get(k) for k in keys):
            return path.stem
    return "custom"


def data_facts(root: str, names: Sequence[str], n_steps_input: int) -> dict[str, Any]:
    """Per dataset: spatial dims, grid, fields, boundary types per axis and trajectories per split."""
    facts = {}
    for name in names:
        counts = {}
        for split in SPLITS:
            ds = WellDataset(root, name, split, n_steps_input, 1)
            counts[split] = ds.n_trajectories
            if split == "train":
                first = ds
            else:
                ds.close()
        facts[name] = {
            "dims": first.n_spatial,
            "resolution": list(first.spatial_shape),
            "fields": list(first.field_names),
            "boundaries": [
                "/".join(BoundaryType(int(c)).name.lower() for c in axis) for axis in first.bcs
            ],
            "trajectories": counts,
        }
        first.close()
    return facts


def _mean_vrmse(metrics: Mapping[str, Any], source: str) -> dict[str, Any]:
    return metrics[source]["vrmse"]["mean_over_fields"]


def verdict(model: Any, persistence: Any, tolerance: float = TIE_TOLERANCE) -> str | None:
    """``"beat"``, ``"tie"`` or ``"lose"``: the model against persistence on one VRMSE. A tie
    when they differ by at most ``tolerance`` times persistence's VRMSE; ``None`` when either is
    missing or not finite (a diverged rollout)."""
    if not (_number(model) and _number(persistence)):
        return None
    if abs(model - persistence) <= tolerance * persistence:
        return "tie"
    return "beat" if model < persistence else "lose"


def verdicts(validation: Mapping[str, Any], tolerance: float = TIE_TOLERANCE) -> dict[str, Any]:
    """Per system, :func:`verdict` of the one-step VRMSE and of every rollout window."""
    out = {}
    for name, v in validation.items():
        one, roll = v["one_step_vrmse"], v["rollout_vrmse"]
        out[name] = {
            "one_step": verdict(one["model"], one["persistence"], tolerance),
            "rollout": {
                w: verdict(m, roll["persistence"].get(w), tolerance)
                for w, m in roll["model"].items()
            },
        }
    return out


def verdict_lines(card: Mapping[str, Any]) -> list[str]:
    """One line per system: how many of its cells (one-step, rollout windows) the model beats,
    ties and loses against persistence, and which cells it does not beat."""
    lines = []
    for name, v in card["verdicts"].items():
        cells = {"one-step": v["one_step"], **{f"rollout {w}": r for w, r in v["rollout"].items()}}
        counts = ", ".join(f"{sum(r == k for r in cells.values())} {k}" for k in VERDICTS)
        rest = [f"{cell} {r or 'n/a'}" for cell, r in cells.items() if r != "beat"]
        lines.append(
            f"{name}: {counts} of {len(cells)} against persistence"
            + (f" (not beaten: {', '.join(rest)})" if rest else "")
        )
    return lines


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hide what the inference runs print: their tables (stdout), Lightning's notes (its
    accelerator lines) and the third-party deprecation chatter the CLIs hide too."""
    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    levels = [lg.level for lg in loggers]
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        for pattern in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def validation_metrics(
    ckpt_path: Path,
    out: Path,
    *,
    data_dir: str | None = None,
    max_windows: int | None = 32,
    steps: int | None = 30,
    trajectories: int | None = None,
    batch_size: int = 4,
) -> dict[str, Any]:
    """Per dataset on the validation split: one-step VRMSE over evenly spaced windows
    (``max_windows``) and windowed rollout VRMSE over the first ``steps`` steps (``None``: to
    the end) from the start of the first ``trajectories`` trajectories (``None``: every one;
    each dataset must have that many), model and persistence, mean over fields. The inference
    runs print nothing but warnings."""
    from walrus.pretrained import infer

    common = [
        f"ckpt_path={ckpt_path}",
        "split=valid",
        f"batch_size={batch_size}",
        "overwrite=true",
        *([f"paths.data_dir={data_dir}"] if data_dir else []),
    ]
    windows = "null" if max_windows is None else str(max_windows)
    chosen = "all" if trajectories is None else f"[{','.join(map(str, range(trajectories)))}]"
    with _quiet():
        one = infer("evaluate", *common, f"out={out / 'evaluate'}", f"max_windows={windows}")
        roll = infer(
            "rollout",
            *common,
            f"out={out / 'rollout'}",
            f"steps={'null' if steps is None else steps}",
            f"trajectories={chosen}",
            "plots=false",
            "save_predictions=false",
            "progress=false",
        )
    result = {}
    for name, entry in one["metrics"]["datasets"].items():
        rolled = roll["metrics"]["datasets"][name]
        result[name] = {
            "one_step_windows": entry["windows"],
            "one_step_vrmse": {
                s: _mean_vrmse(entry["metrics"], s)["per_step"][0] for s in ("model", "persistence")
            },
            "rollout_trajectories": len(rolled["trajectories"]),
            "rollout_steps": rolled["steps"],
            "rollout_vrmse": {
                s: _mean_vrmse(rolled["metrics"], s)["windows"] for s in ("model", "persistence")
            },
        }
    return result


def build_card(
    run_dir: str | os.PathLike,
    *,
    data_dir: str | None = None,
    max_windows: int | None = 32,
    steps: int | None = 30,
    max_trajectories: int | None = None,
    tie_tolerance: float = TIE_TOLERANCE,
) -> dict[str, Any]:
    """The model card of the run in ``run_dir`` as plain data (see the module docstring).
    Rollouts start from the first ``max_trajectories`` validation trajectories of each system
    (``None``: all; fewer where a system has fewer)."""
    if not (_number(tie_tolerance) and tie_tolerance >= 0):
        raise ValueError(f"tie tolerance must be a number >= 0, got {tie_tolerance!r}")
    if max_trajectories is not None and max_trajectories < 1:
        raise ValueError(f"max trajectories must be >= 1, got {max_trajectories}")
    run = Path(run_dir)
    path = run / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint; the model card needs a finished run")
    ckpt = load_checkpoint_file(path)
    meta = walrus_meta(ckpt, path)
    config = read_record(ckpt, path).get("config") or {}
    data_cfg = meta.get("data_config") or {}
    root = data_dir or data_cfg.get("root")
    n_in = data_cfg.get("n_steps_input")
    if not isinstance(root, str) or not _number(n_in):
        raise ValueError(f"{path}: its data config names no data root or n_steps_input")
    names = [s.name for s in parse_dataset_specs(data_cfg.get("datasets") or [])]
    cost_state = (ckpt.get("callbacks") or {}).get(COST_KEY)
    cost = check_cost(cost_state, str(path)) if cost_state is not None else None
    trainer_cfg = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    max_time = trainer_cfg.get("max_time")
    step = ckpt.get("global_step")
    from walrus.inference.loading import load_inference_checkpoint

    model = load_inference_checkpoint(path).model
    facts = data_facts(root, names, int(n_in))
    fewest = min(d["trajectories"]["valid"] for d in facts.values())
    trajectories = None if max_trajectories is None else min(max_trajectories, fewest)
    validation = validation_metrics(
        path,
        run / CARD_DIR,
        data_dir=data_dir,
        max_windows=max_windows,
        steps=steps,
        trajectories=trajectories,
    )
    return {
        "checkpoint": os.path.relpath(path, run),
        "task_name": config.get("task_name") if isinstance(config.get("task_name"), str) else None,
        "data": {
            "root": str(root),
            "n_steps_input": int(n_in),
            "systems": facts,
            "fields": sorted({f for d in facts.values() for f in d["fields"]}),
        },
        "budget": {
            "max_time": max_time if isinstance(max_time, str | int | float) else None,
            "steps": step if isinstance(step, int) else None,
            **(cost or {k: None for k in (*_COST_FIELDS, "threads")}),
        },
        "model": {
            "preset": model_preset(meta["model_config"]),
            "params": sum(p.numel() for p in model.parameters()),
            "n_fields": meta["model_config"].get("n_fields"),
        },
        "validation": validation,
        "tie_tolerance": tie_tolerance,
        "verdicts": verdicts(validation, tie_tolerance),
        "source": git_state(),
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, list):
        return "/".join(_fmt(v) for v in value)
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def render_markdown(card: Mapping[str, Any]) -> str:
    """``MODEL_CARD.md``: the card's data as short sections and tables."""
    budget, model, src = card["budget"], card["model"], card["source"]
    lines = [
        f"# Model card: {card.get('task_name') or 'walrus run'}",
        "",
        f"Checkpoint `{card['checkpoint']}`; built from commit {_fmt(src['commit'])}"
        + (" (uncommitted changes)" if src["dirty"] else ""),
        "",
        "## Model",
        f"Preset `{model['preset']}`, {model['params']:,} parameters, {model['n_fields']} field slots.",
        "",
        "## Training budget",
        f"max_time {_fmt(budget['max_time'])}; {_fmt(budget['steps'])} steps; "
        f"{_fmt(budget['cpu_s'])} CPU s over {_fmt(budget['wall_s'])} wall s; "
        f"{_fmt(budget['threads'])} torch threads; load average (1/5/15 min) "
        f"{_fmt(budget.get('loadavg_start'))} at the start, {_fmt(budget.get('loadavg_end'))} at the end.",
        "",
        "## Data",
        f"Root `{card['data']['root']}`, {card['data']['n_steps_input']} context frames.",
        "",
        "| system | dims | grid | boundaries | fields | train/valid/test trajectories |",
        "|---|---|---|---|---|---|",
    ]
    for name, d in card["data"]["systems"].items():
        t = d["trajectories"]
        lines.append(
            f"| {name} | {d['dims']}D | {'x'.join(map(str, d['resolution']))} | "
            f"{', '.join(d['boundaries'])} | {', '.join(d['fields'])} | "
            f"{t['train']}/{t['valid']}/{t['test']} |"
        )
    windows = (
        list(next(iter(card["validation"].values()))["rollout_vrmse"]["model"])
        if card["validation"]
        else []
    )
    lines += [
        "",
        "## Validation (VRMSE, mean over fields; model / persistence, verdict)",
        "",
        "| system | one-step | " + " | ".join(f"rollout {w}" for w in windows) + " |",
        "|---|---|" + "---|" * len(windows),
    ]
    for name, v in card["validation"].items():
        one, roll, says = v["one_step_vrmse"], v["rollout_vrmse"], card["verdicts"][name]
        cells = [f"{_fmt(one['model'])} / {_fmt(one['persistence'])} {_fmt(says['one_step'])}"]
        cells += [
            f"{_fmt(roll['model'].get(w))} / {_fmt(roll['persistence'].get(w))} "
            f"{_fmt(says['rollout'].get(w))}"
            for w in windows
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "One-step: evenly spaced validation windows; rollout: from the first frames of the first "
        "`rollout_trajectories` validation trajectories (`rollout_steps` steps, see "
        "model_card.json), errors averaged over the steps of each window. Verdict against "
        f"persistence: a tie when the two VRMSEs differ by at most {card['tie_tolerance']:.0%} "
        "of persistence's, else beat or lose.",
        "",
        *verdict_lines(card),
        "",
    ]
    return "\n".join(lines)


def write_model_card(
    run_dir: str | os.PathLike,
    *,
    data_dir: str | None = None,
    max_windows: int | None = 32,
    steps: int | None = 30,
    max_trajectories: int | None = None,
    tie_tolerance: float = TIE_TOLERANCE,
) -> tuple[Path, Path]:
    """Build the card of ``run_dir`` and write ``MODEL_CARD.md`` and ``model_card.json`` into
    it (atomically). Returns their paths."""
    card = build_card(
        run_dir,
        data_dir=data_dir,
        max_windows=max_windows,
        steps=steps,
        max_trajectories=max_trajectories,
        tie_tolerance=tie_tolerance,
    )
    run = Path(run_dir)
    json_path = write_text_atomic(run / "model_card.json", json.dumps(card, indent=2) + "\n")
    md_path = write_text_atomic(run / "MODEL_CARD.md", render_markdown(card))
    return md_path, json_path


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m walrus.training.model_card RUN_DIR``: write the card, print where."""
    p = argparse.ArgumentParser(
        prog="python -m walrus.training.model_card",
        description="Write MODEL_CARD.md and model_card.json beside a run's checkpoint.",
    )
    p.add_argument("run_dir", help="the training run folder (holding checkpoints/last.ckpt)")
    p.add_argument("--data-dir", help="data root (default: the checkpoint's)")
    p.add_argument("--max-windows", type=int, default=32, help="one-step windows per system")
    p.add_argument("--steps", type=int, default=30, help="rollout steps (0: to the end)")
    p.add_argument(
        "--max-trajectories", type=int, help="rollouts per system (default: every trajectory)"
    )
    p.add_argument(
        "--tie-tolerance",
        type=float,
        default=TIE_TOLERANCE,
        help="a tie with persistence: VRMSEs within this fraction of persistence's (0.05)",
    )
    args = p.parse_args(argv)
    start = time.monotonic()
    try:
        md, js = write_model_card(
            args.run_dir,
            data_dir=args.data_dir,
            max_windows=args.max_windows,
            steps=args.steps or None,
            max_trajectories=args.max_trajectories,
            tie_tolerance=args.tie_tolerance,
        )
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for line in verdict_lines(json.loads(js.read_text())):
        print(line)
    print(f"wrote {md} and {js} in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
