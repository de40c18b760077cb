"""Transfer benchmark, leave one system out: does pretraining make a new system cheap to learn?

For each held-out set (built-in systems of ``--held-out``; Well dataset folders of ``--dataset``,
e.g. the py-pde Gray-Scott set) and each seed of ``--seeds``:

1. pretrain (``experiment=pretrain``) on the other built-in systems of ``--systems`` for
   ``--pretrain-time`` of wall clock; one pretraining serves every F;
2. for each F of ``--finetune-steps``: fine-tune it F steps (``experiment=finetune init_from=``)
   at each rate of ``--finetune-lrs``, and train the same recipe from scratch F steps
   (``finetune.enabled=false``) at each rate of ``--scratch-lrs``; each side keeps the rate with
   the lower final ``val/rollout_vrmse`` (validation split);
3. train from scratch for the pretraining's CPU seconds plus those of the largest-F scratch run
   (its rate): where pretraining stops paying (``--no-long-scratch`` skips it);
4. score each model, the pretrained checkpoint as it is (zero-shot: only where it knows every
   field of the held-out set) and persistence on the test split with ``infer.py rollout`` from the first
   frames of every test trajectory to its end: windowed VRMSE, amplitude ratio and change
   correlation, mean over fields; mean and spread over seeds.

Built-in data is generated under ``--data-root`` when missing (``--n-traj`` 24/4/8; at least
``--min-test-trajectories`` test trajectories are required). ``benchmarks/results/transfer.json``
is written after every run (``--name`` sets its stem); ``--page docs/results.md`` renders the table
between ``<!-- transfer-table:start -->`` and ``<!-- transfer-table:end -->`` (for another
``--name N``: ``<!-- transfer-table:start:N -->`` and ``<!-- transfer-table:end:N -->``)::

    python -m benchmarks.transfer --pretrain-time 600 --finetune-steps 300 --seeds 0,1,2 \\
        --dataset data/gray_scott_pypde --page docs/results.md
    python -m benchmarks.transfer --render-only

``--sample-efficiency`` measures the whole data curve instead (held out by default: every 2D
system, ``burgers_1d`` and ``advection_diffusion_3d``; ``--near PATH`` adds a set reported as
near the pool). Per held-out set and seed, after the same pretraining, for every N of
``--trajectories`` (``data.train_trajectories=N``; validation and test fixed): fine-tune and
train from scratch at every rate of ``--lrs`` (``--widen-grid``: widen it while either choice
sits at an edge), each run validated every ``--val-every`` steps up to the step cap (the one
value of ``--finetune-steps``) and kept at its best-validation checkpoint; each side takes the
rate with the best validation score; a compute-matched scratch run at ``--reference-n`` gets the
pretraining's CPU seconds plus the fine-tuning's. :mod:`benchmarks.sample_efficiency` summarises
(data-efficiency factor) and renders ``benchmarks/results/sample_efficiency.json``::

    python -m benchmarks.transfer --sample-efficiency --pretrain-time 1800 --seeds 0,1,2 \\
        --widen-grid --near data/gray_scott_pypde --page docs/results.md
    python -m benchmarks.transfer --sample-efficiency --render-only   # page and README

Training CPU time is measured (and capped, for the long-scratch row) by the quality benchmark's
:class:`benchmarks.budgets.CPUBudget`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks import sample_efficiency as se
from benchmarks.budgets import BenchmarkError, CPUBudget, step_ceiling
from benchmarks.common import RESULTS_DIR, cpu_model, save_json
from benchmarks.pages import README, RESULTS_PAGE
from benchmarks.transfer_table import MEASURES, render_page, render_table, summarize
from walrus.data.synthetic import SYSTEMS, generate
from walrus.data.well_dataset import WellDataset
from walrus.pretrained import infer
from walrus.training.budget import parse_duration
from walrus.training.model_card import git_state

REPO = Path(__file__).resolve().parents[1]
ZERO_SHOT = "pretrained, no fine-tuning"
# held out with --sample-efficiency besides every 2D system: one 1D and one 3D system
SE_OTHER = ["burgers_1d", "advection_diffusion_3d"]


@dataclass(frozen=True)
class DataSet:
    """A Well dataset ``root/name``."""

    root: Path
    name: str

    @property
    def path(self) -> Path:
        return self.root / self.name


def _rel(path: str | os.PathLike) -> str:
    """``path`` relative to the current folder (no machine's layout in the JSON)."""
    return os.path.relpath(Path(path).resolve())


def count_trajectories(ref: DataSet, split: str = "test") -> int:
    """Trajectories in ``split`` of ``ref``."""
    ds = WellDataset(ref.root, ref.name, split, 1, 1)
    n = ds.n_trajectories
    ds.close()
    return n


def builtin_set(
    system: str, root: str | os.PathLike, n_traj: Sequence[int], seed: int = 0
) -> DataSet:
    """Built-in ``system`` under ``root``, generated there (``n_traj`` per split) when missing."""
    if system not in SYSTEMS:
        raise BenchmarkError(f"unknown system {system!r}; built-in systems: {', '.join(SYSTEMS)}")
    ref = DataSet(Path(root).resolve(), system)
    if not (ref.path / "data").is_dir():
        generate(system, ref.root, n_traj=tuple(n_traj), seed=seed, progress=False)
    return ref


def external_set(path: str | os.PathLike) -> DataSet:
    """A Well dataset folder (``data/{train,valid,test}``) given with ``--dataset``."""
    path = Path(path).resolve()
    missing = [s for s in ("train", "valid", "test") if not (path / "data" / s).is_dir()]
    if missing:
        raise BenchmarkError(f"--dataset {path}: not a Well dataset folder (no data/{missing[0]})")
    return DataSet(path.parent, path.name)


def fit(overrides: Sequence[str], out: Path, cpu_seconds: float | None = None) -> dict[str, Any]:
    """``train.py`` with ``overrides`` into ``out`` (in this process); steps, CPU and wall
    seconds, final validation metrics, the last checkpoint and ``best``: the best-validation
    checkpoint by the run's checkpoint monitor, with its score and step (``None`` when no
    validation gave a finite score)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from walrus.training.train import train

    extra = [
        f"paths.output_dir={out.resolve()}",
        "callbacks.progress_bar=null",
        f"+callbacks.cpu_time._target_={CPUBudget.__module__}.{CPUBudget.__qualname__}",
        f"+callbacks.cpu_time.seconds={'null' if cpu_seconds is None else cpu_seconds}",
    ]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            cfg = compose(config_name="train", overrides=[*overrides, *extra])
    except (HydraException, OmegaConfBaseException) as e:
        raise BenchmarkError(f"overrides {list(overrides)}: {str(e).splitlines()[0]}") from None
    finally:
        GlobalHydra.instance().clear()
    t0 = time.perf_counter()
    metrics, objects = train(cfg)
    cpu = next(c for c in objects["trainer"].callbacks if isinstance(c, CPUBudget))
    watcher = objects["trainer"].checkpoint_callback
    best = None
    if watcher is not None and watcher.best_model_path:
        step = re.search(r"step(\d+)", Path(watcher.best_model_path).name)
        best = {
            "checkpoint": _rel(watcher.best_model_path),
            "val": float(watcher.best_model_score),
            "step": int(step.group(1)) if step else None,
            "monitor": watcher.monitor,
        }
    return {
        "best": best,
        "checkpoint": out / "checkpoints" / "last.ckpt",
        "steps": objects["trainer"].global_step,
        "cpu_s": cpu.used,
        "wall_s": time.perf_counter() - t0,
        "val": {k: v for k, v in metrics.items() if k in ("val/vrmse", "val/rollout_vrmse")},
    }


def evaluate(ckpt: Path, ref: DataSet, out: Path, batch_size: int = 4) -> dict[str, Any]:
    """``infer.py rollout`` of ``ckpt`` on the test split of ``ref``: per source (model,
    persistence) and measure, the mean over fields in each rollout window."""
    result = infer(
        "rollout",
        f"ckpt_path={ckpt}",
        "split=test",
        f"paths.data_dir={ref.root}",
        f"data.datasets=[{ref.name}]",
        f"out={out}",
        f"batch_size={batch_size}",
        "overwrite=true",
        "plots=false",
        "save_predictions=false",
        "progress=false",
    )["metrics"]["datasets"][ref.name]
    m = result["metrics"]
    return {
        "trajectories": len(result["trajectories"]),
        "steps": result["steps"],
        **{
            s: {k: dict(m[s][k]["mean_over_fields"]["windows"]) for k in MEASURES}
            for s in ("model", "persistence")
        },
    }


def _portable(key: str, value: Any) -> Any:
    """An argument for the JSON: folders relative to the current one."""
    if key in ("data_root", "work_dir", "results_dir", "page") and value is not None:
        return _rel(value)
    return [_rel(v) for v in value] if key == "dataset" else value


def _datasets_override(names: Sequence[str]) -> str:
    return "data.datasets=[" + ",".join(f"{{name:{n},weight:1.0}}" for n in names) + "]"


def held_overrides(held: DataSet, seed: int) -> list[str]:
    """``experiment=finetune`` on ``held`` alone with ``seed`` (add ``init_from=`` to fine-tune,
    ``finetune.enabled=false`` to train from scratch)."""
    return [
        "experiment=finetune",
        f"paths.data_dir={held.root}",
        f"data.datasets=[{held.name}]",
        f"seed={seed}",
        "data.generate_if_missing=false",
    ]


def run_one(
    held: DataSet,
    pool: Sequence[DataSet],
    seed: int,
    args: argparse.Namespace,
    work: Path,
    log: Any = print,
) -> dict[str, Any]:
    """Pretrain without ``held``, then fine-tune / scratch / long scratch on it; scored on test."""
    if not pool:
        raise BenchmarkError(f"nothing to pretrain on without {held.name}: widen --systems")
    if len({p.root for p in pool}) != 1:
        raise BenchmarkError("the pretraining systems must share one --data-root")
    on_held = [*held_overrides(held, seed), *args.override]
    scratch = [*on_held, "finetune.enabled=false"]
    out = work / held.name / f"seed_{seed}"
    record: dict[str, Any] = {
        "held_out": held.name,
        "dataset": _rel(held.path),
        "seed": seed,
        "models": {},
    }
    log(
        f"[{held.name} seed {seed}] pretraining on {len(pool)} systems for {args.pretrain_time:g} s"
    )
    pre = _pretrain(pool, seed, args, out / "pretrain")
    record["pretrain"] = {
        "systems": [p.name for p in pool],
        **{k: v for k, v in pre.items() if k not in ("checkpoint", "best")},
        "checkpoint": _rel(pre["checkpoint"]),
    }
    zero_shot = score_zero_shot(pre["checkpoint"], held, out / "eval" / "zero_shot", log)
    if "skipped" in zero_shot:
        record["zero_shot_skipped"] = zero_shot["skipped"]
    models: dict[str, dict[str, Any]] = {}
    scratch_best: dict[str, Any] = {}
    for f in args.finetune_steps:
        log(
            f"[{held.name} seed {seed}] {f} steps: fine-tuning at {args.finetune_lrs}, "
            f"scratch at {args.scratch_lrs}"
        )
        recipes = {
            "finetune": ([*on_held, f"init_from={pre['checkpoint']}"], args.finetune_lrs),
            "scratch": (scratch, args.scratch_lrs),
        }
        for kind, (overrides, rates) in recipes.items():
            models[f"{kind} {f}"] = _best_rate(
                {
                    lr: fit(
                        [*overrides, f"optimizer.lr={lr}", f"trainer.max_steps={f}"],
                        out / f"{kind}_{f}_lr{lr:g}",
                    )
                    for lr in rates
                }
            )
        scratch_best = {"steps": f, "lr": models[f"scratch {f}"]["lr"]}
        scratch_best["run"] = models[f"scratch {f}"]
    if not args.no_long_scratch:
        cpu = pre["cpu_s"] + scratch_best["run"]["cpu_s"]
        per_step = scratch_best["run"]["cpu_s"] / max(scratch_best["run"]["steps"], 1)
        planned = max(1, math.ceil(cpu / max(per_step, 1e-9)))
        label = f"scratch pretrain-cpu+{scratch_best['steps']}"
        log(f"[{held.name} seed {seed}] {label}: {cpu:.0f} CPU s (~{planned} steps)")
        long = fit(
            [
                *scratch,
                f"optimizer.lr={scratch_best['lr']}",
                f"trainer.max_steps={step_ceiling(planned)}",
            ],
            out / "scratch_long",
            cpu_seconds=cpu,
        )
        models[label] = {**long, "lr": scratch_best["lr"], "cpu_budget_s": cpu}
    if "test" in zero_shot:
        record["models"][ZERO_SHOT] = zero_shot
    for label, m in models.items():
        log(f"[{held.name} seed {seed}] scoring {label} on the test split")
        scored = evaluate(m["checkpoint"], held, out / "eval" / label.replace(" ", "_"))
        m["checkpoint"] = _rel(m["checkpoint"])
        m["test"] = scored
        record["models"][label] = m
    record["models"]["persistence"] = {"test": {**scored, "model": scored["persistence"]}}
    return record


def group_of(name: str, near: bool = False) -> str:
    """The table group of held-out set ``name``: ``near`` (an outside set that resembles the
    pretraining pool), ``1D`` / ``2D`` / ``3D`` for a built-in system, else ``external``."""
    if near:
        return "near"
    return {"_1d": "1D", "_2d": "2D", "_3d": "3D"}.get(name[-3:], "external")


def _pretrain(pool: Sequence[DataSet], seed: int, args: argparse.Namespace, out: Path) -> dict:
    """``experiment=pretrain`` on ``pool`` for ``--pretrain-time`` (see :func:`fit`)."""
    return fit(
        [
            "experiment=pretrain",
            f"paths.data_dir={pool[0].root}",
            _datasets_override([p.name for p in pool]),
            f"trainer.max_time={args.pretrain_time}",
            f"seed={seed}",
            "data.generate_if_missing=false",
            *args.override,
        ],
        out,
    )


def curve_overrides(held: DataSet, seed: int, n: str, args: argparse.Namespace) -> list[str]:
    """One sample-efficiency training run on ``held``: ``data.train_trajectories`` (``n`` is a
    count or ``all``), a validation every ``--val-every`` steps whatever N is, the checkpoint
    kept by validation rollout VRMSE, and the step cap."""
    return [
        *held_overrides(held, seed),
        f"data.datasets=[{{name:{held.name},weight:1.0}}]",
        f"data.batches_per_epoch={args.val_every}",
        f"data.train_trajectories={'null' if n == 'all' else n}",
        "callbacks.model_checkpoint.monitor=val/rollout_vrmse",
        f"trainer.max_steps={args.finetune_steps[0]}",
        *args.override,
    ]


def choose_rates(
    train: Any, grid: Sequence[float], widen_grid: bool, max_widen: int
) -> dict[str, Any]:
    """Both sides' rates from one grid, chosen by best validation score.

    Args:
        train: ``train(side, lr)`` -> a :func:`fit` result (``side``: finetune or scratch).
        grid: the rates tried by both sides.
        widen_grid: while either side's choice is at the grid's edge, widen the grid by one
            rate each side (:func:`benchmarks.sample_efficiency.widen`) and train the new rates,
            at most ``max_widen`` times.

    Returns:
        ``{"grid", "widened", "finetune", "scratch"}``; each side: its chosen run, ``lr``,
        ``val_by_lr`` (best validation score per rate) and ``at_edge`` (``low``, ``high`` or
        ``None``).
    """
    grid, widened = sorted(grid), 0
    tries: dict[str, dict[float, dict[str, Any]]] = {"finetune": {}, "scratch": {}}
    while True:
        for side, runs in tries.items():
            for lr in grid:
                if lr not in runs:
                    runs[lr] = train(side, lr)
        chosen = {
            side: min(grid, key=lambda lr: _best_score(runs[lr])) for side, runs in tries.items()
        }
        edges = {side: se.edge(lr, grid) for side, lr in chosen.items()}
        if not (widen_grid and any(edges.values()) and widened < max_widen):
            break
        grid, widened = se.widen(grid), widened + 1
    out: dict[str, Any] = {"grid": grid, "widened": widened}
    for side, runs in tries.items():
        out[side] = {
            **runs[chosen[side]],
            "lr": chosen[side],
            "at_edge": edges[side],
            "val_by_lr": {f"{lr:g}": _best_score(runs[lr]) for lr in grid},
        }
    return out


def _best_score(run: Mapping[str, Any]) -> float:
    best = run.get("best")
    return best["val"] if best and math.isfinite(best["val"]) else math.inf


def run_curve(
    held: DataSet,
    group: str,
    pool: Sequence[DataSet],
    seed: int,
    args: argparse.Namespace,
    work: Path,
    log: Any = print,
) -> dict[str, Any]:
    """Sample efficiency on ``held`` for one seed: pretrain without it, then for every N of
    ``--trajectories`` fine-tune and train from scratch on its first N train trajectories (rates
    chosen on validation, best-validation checkpoints within the step cap); a compute-matched
    scratch run at the reference N; every chosen checkpoint scored on the whole test split."""
    if not pool:
        raise BenchmarkError(f"nothing to pretrain on without {held.name}: widen --systems")
    if len({p.root for p in pool}) != 1:
        raise BenchmarkError("the pretraining systems must share one --data-root")
    out = work / held.name / f"seed_{seed}"
    all_count = count_trajectories(held, "train")
    log(
        f"[{held.name} seed {seed}] pretraining on {len(pool)} systems for {args.pretrain_time:g} s"
    )
    pre = _pretrain(pool, seed, args, out / "pretrain")
    record: dict[str, Any] = {
        "held_out": held.name,
        "group": group,
        "dataset": _rel(held.path),
        "seed": seed,
        "train_trajectories_all": all_count,
        "pretrain": {
            "systems": [p.name for p in pool],
            **{k: v for k, v in pre.items() if k not in ("checkpoint", "best")},
            "checkpoint": _rel(pre["checkpoint"]),
        },
        "curve": {},
    }
    scored = None
    for n in args.trajectories:
        on_held = curve_overrides(held, seed, n, args)
        recipes = {
            "finetune": [*on_held, f"init_from={pre['checkpoint']}"],
            "scratch": [*on_held, "finetune.enabled=false"],
        }
        log(f"[{held.name} seed {seed}] N={n}: both sides at {args.lrs}")

        def train(side: str, lr: float, n: str = n, recipes: dict = recipes) -> dict[str, Any]:
            return fit([*recipes[side], f"optimizer.lr={lr}"], out / f"n{n}" / f"{side}_lr{lr:g}")

        point = choose_rates(train, args.lrs, args.widen_grid, args.max_widen)
        for side in ("finetune", "scratch"):
            m = point[side]
            if m["best"] is None:
                raise BenchmarkError(f"{held.name} N={n} {side}: no finite validation score")
            log(f"[{held.name} seed {seed}] N={n}: scoring {side} (lr {m['lr']:g}) on test")
            scored = evaluate(Path(m["best"]["checkpoint"]), held, out / "eval" / f"n{n}_{side}")
            m["checkpoint"] = _rel(m["checkpoint"])
            m["test"] = scored
        record["curve"][n] = point
    ref = record["curve"].get(str(args.reference_n))
    if ref is not None and not args.no_long_scratch:
        cpu = pre["cpu_s"] + ref["finetune"]["cpu_s"]
        per_step = ref["scratch"]["cpu_s"] / max(ref["scratch"]["steps"], 1)
        planned = max(1, math.ceil(cpu / max(per_step, 1e-9)))
        log(
            f"[{held.name} seed {seed}] compute-matched scratch: {cpu:.0f} CPU s (~{planned} steps)"
        )
        matched = fit(
            [
                *curve_overrides(held, seed, str(args.reference_n), args),
                "finetune.enabled=false",
                f"optimizer.lr={ref['scratch']['lr']}",
                f"trainer.max_steps={step_ceiling(planned)}",
            ],
            out / "compute_matched",
            cpu_seconds=cpu,
        )
        if matched["best"] is None:
            raise BenchmarkError(f"{held.name}: compute-matched scratch had no finite validation")
        matched["test"] = evaluate(Path(matched["best"]["checkpoint"]), held, out / "eval" / "cm")
        matched["checkpoint"] = _rel(matched["checkpoint"])
        record["compute_matched"] = {
            **matched,
            "lr": ref["scratch"]["lr"],
            "cpu_budget_s": cpu,
            "trajectories": args.reference_n,
        }
    if scored is not None:
        record["persistence"] = {"test": {**scored, "model": scored["persistence"]}}
    return record


def score_zero_shot(ckpt: Path, held: DataSet, out: Path, log: Any = print) -> dict[str, Any]:
    """The pretrained checkpoint rolled out on ``held``'s test split with no fine-tuning:
    ``{"test": ...}`` as :func:`evaluate` scores it, or ``{"skipped": reason}`` when the
    held-out set has fields the checkpoint was never trained on."""
    try:
        return {"test": evaluate(ckpt, held, out)}
    except ValueError as e:
        if "never trained on" not in str(e):
            raise
        log(f"[{held.name}] no zero-shot score: {e}")
        return {"skipped": "the held-out set has fields the pretrained checkpoint never saw"}


def _best_rate(tries: Mapping[float, dict[str, Any]]) -> dict[str, Any]:
    """The run with the lowest validation score among ``tries`` (rate -> run), with its rate and
    every rate's final validation metrics."""
    best = min(tries, key=lambda lr: _val_score(tries[lr]))
    return {
        **tries[best],
        "lr": best,
        "val_by_lr": {f"{lr:g}": t["val"] for lr, t in tries.items()},
    }


def _val_score(run: Mapping[str, Any]) -> float:
    val = run["val"].get("val/rollout_vrmse", run["val"].get("val/vrmse"))
    return val if val is not None and math.isfinite(val) else math.inf


def _numbers(text: str, whole: bool = False) -> list[Any]:
    """Comma-separated numbers (``whole``: non-negative whole numbers)."""
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or (whole and any(v != int(v) or v < 0 for v in values)):
        kind = "whole numbers" if whole else "numbers"
        raise argparse.ArgumentTypeError(f"expected comma-separated {kind}, got {text!r}")
    return [int(v) for v in values] if whole else values


def _trajectory_grid(text: str) -> list[str]:
    """``1,2,4,8,all``: increasing whole numbers >= 1, optionally ending in ``all``."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    counts = items[:-1] if items and items[-1] == "all" else items
    if not items or not all(x.isdigit() and int(x) >= 1 for x in counts):
        raise argparse.ArgumentTypeError(
            f"expected whole numbers >= 1 separated by commas, optionally ending in all, got {text!r}"
        )
    values = [int(x) for x in counts]
    if values != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"the trajectory counts must increase, got {text!r}")
    return [str(v) for v in values] + (["all"] if items[-1] == "all" else [])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.transfer",
        description="Leave one system out: pretrain on the others, fine-tune vs scratch.",
    )
    ints = lambda t: _numbers(t, whole=True)  # noqa: E731
    every, add = ",".join(SYSTEMS), p.add_argument
    add("--systems", default=every, help="built-in systems to pretrain on (default: all nine)")
    add(
        "--held-out",
        help="built-in systems to hold out, or 'none' (default: all nine; with "
        "--sample-efficiency every 2D system, burgers_1d and advection_diffusion_3d)",
    )
    add("--dataset", action="append", default=[], help="Well dataset folder to hold out")
    add(
        "--near",
        action="append",
        default=[],
        help="Well dataset folder to hold out, reported apart as near the pretraining pool "
        "(e.g. data/gray_scott_pypde, whose built-in twin is pretrained on)",
    )
    add("--data-root", default=os.environ.get("WALRUS_DATA_DIR", "data"))
    add("--n-traj", type=ints, default=[24, 4, 8], help="new built-in data: TRAIN,VALID,TEST")
    add("--min-test-trajectories", type=int, default=8)
    add("--pretrain-time", default="600", help="seconds or DD:HH:MM:SS of pretraining")
    add("--finetune-steps", type=ints, default=[300], help="F values, comma-separated")
    # both sides chose 1e-2 over 3e-3 and 1e-3 on validation for all four 2D held-out sets
    # at F = 300 (benchmarks/results/s13_probe_lr_*.json)
    add("--finetune-lrs", type=_numbers, default=[3e-3, 1e-2], help="fine-tuning rates tried")
    add("--scratch-lrs", type=_numbers, default=[3e-3, 1e-2], help="scratch rates tried")
    add("--seeds", type=ints, default=[0, 1, 2])
    add("--no-long-scratch", action="store_true", help="skip scratch at pretraining CPU + F")
    add("--override", action="append", default=[], help="KEY=VALUE for every training run")
    add("--threads", type=int, help="torch threads (default: torch's choice)")
    add("--work-dir", help="training runs (default: outputs/transfer/<UTC time>)")
    add("--results-dir", default=None, help="default: benchmarks/results")
    add("--name", help="results file stem (default: transfer, or sample_efficiency)")
    add("--page", type=Path, help="render the table onto this Markdown page")
    se_opts = p.add_argument_group(
        "sample efficiency",
        "--sample-efficiency: per held-out set, fine-tuned and scratch on the first N train "
        "trajectories for every N, each at its validation-chosen rate of --lrs and its "
        "best-validation checkpoint within the step cap (the one value of --finetune-steps)",
    )
    se_add = se_opts.add_argument
    se_add("--sample-efficiency", action="store_true", help="run the sample-efficiency mode")
    se_add("--trajectories", type=_trajectory_grid, default=["1", "2", "4", "8", "all"])
    se_add("--lrs", type=_numbers, default=[1e-3, 3e-3, 1e-2], help="rate grid of both sides")
    se_add("--widen-grid", action="store_true", help="widen the grid while a choice is at an edge")
    se_add("--max-widen", type=int, default=3, help="most widenings per point")
    se_add("--val-every", type=int, default=25, help="steps between validations")
    se_add("--reference-n", type=int, default=2, help="N the data-efficiency factor matches")
    se_add(
        "--readme",
        type=Path,
        help="render the headline row into this README (with --render-only: README.md)",
    )
    add(
        "--render-only",
        action="store_true",
        help="only render the saved JSON onto --page (default docs/results.md)",
    )
    return p


def check_sample_efficiency(args: argparse.Namespace, held: Sequence[DataSet]) -> None:
    """Refuse, before any training, a sample-efficiency setup that cannot run: a step cap that
    is not one whole number of validation intervals, a reference N off the grid, a trajectory
    count above what a held-out train split holds."""
    if len(args.finetune_steps) != 1:
        raise BenchmarkError("--sample-efficiency takes one --finetune-steps value: the step cap")
    cap = args.finetune_steps[0]
    if args.val_every < 1 or cap % args.val_every:
        raise BenchmarkError(
            f"--val-every {args.val_every} must divide the step cap --finetune-steps {cap}, so "
            "that the last step is validated"
        )
    if str(args.reference_n) not in args.trajectories:
        raise BenchmarkError(
            f"--reference-n {args.reference_n} is not in --trajectories {','.join(args.trajectories)}"
        )
    for rate in args.lrs:
        if rate <= 0:
            raise BenchmarkError("--lrs needs rates > 0")
    counts = [int(n) for n in args.trajectories if n != "all"]
    for ref in held:
        have = count_trajectories(ref, "train")
        if counts and counts[-1] > have:
            raise BenchmarkError(
                f"{ref.path}: --trajectories asks for {counts[-1]} train trajectories; the train "
                f"split holds {have}"
            )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark as ``args`` describe; writes the JSON after every run."""
    results = Path(args.results_dir) if args.results_dir else RESULTS_DIR
    args.name = args.name or (se.NAME if args.sample_efficiency else "transfer")
    if args.sample_efficiency and args.render_only:
        path = results / f"{args.name}.json"
        data = json.loads(path.read_text()) if path.is_file() else None
        se.render_pages(data, args.page or RESULTS_PAGE, args.readme or README)
        return data or {}
    if args.render_only:
        path = results / f"{args.name}.json"
        if not path.is_file():
            raise BenchmarkError(f"{path}: no results to render; run the benchmark first")
        data = json.loads(path.read_text())
        render_page(args.page or RESULTS_PAGE, data, args.name)
        return data
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    argv = [_rel(a) if os.path.isabs(a) else a for a in sys.argv[1:]]
    record = {"started": started, **git_state(), "cpu_model": cpu_model(), "argv": argv}
    text = str(args.pretrain_time)
    try:
        args.pretrain_time = parse_duration(float(text) if text.isdigit() else text)
    except ValueError:
        raise BenchmarkError(f"--pretrain-time: seconds or DD:HH:MM:SS, got {text!r}") from None
    if len(args.n_traj) != 3:
        raise BenchmarkError("--n-traj takes TRAIN,VALID,TEST")
    if not args.finetune_steps or min(args.finetune_steps) < 1:
        raise BenchmarkError("--finetune-steps needs F >= 1")
    for name, rates in (("--finetune-lrs", args.finetune_lrs), ("--scratch-lrs", args.scratch_lrs)):
        if not rates or min(rates) <= 0:
            raise BenchmarkError(f"{name} needs at least one rate, each > 0")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pool = [s for s in args.systems.split(",") if s]
    if args.held_out is None:
        args.held_out = (
            ",".join([s for s in SYSTEMS if s.endswith("_2d")] + SE_OTHER)
            if args.sample_efficiency
            else ",".join(SYSTEMS)
        )
    held_names = [] if args.held_out == "none" else [s for s in args.held_out.split(",") if s]
    builtin = {
        s: builtin_set(s, args.data_root, args.n_traj) for s in dict.fromkeys([*pool, *held_names])
    }
    held = [builtin[s] for s in held_names] + [external_set(p) for p in args.dataset]
    near = [external_set(p) for p in args.near]
    if args.sample_efficiency:
        check_sample_efficiency(args, [*held, *near])
    elif near:
        raise BenchmarkError("--near is for --sample-efficiency; hold the set out with --dataset")
    held += near
    if not held:
        raise BenchmarkError("nothing to hold out: no --held-out systems and no --dataset")
    for ref in held:
        n = count_trajectories(ref)
        if n < args.min_test_trajectories:
            raise BenchmarkError(
                f"{ref.path}: {n} test trajectories, fewer than --min-test-trajectories "
                f"{args.min_test_trajectories} (generate into a fresh --data-root, --n-traj 24,4,8)"
            )
    work = Path(args.work_dir or Path("outputs") / "transfer" / started.replace(":", "-"))
    data: dict[str, Any] = {
        "record": record,
        "args": {k: _portable(k, v) for k, v in vars(args).items()},
        "threads": torch.get_num_threads(),
        "loadavg_start": list(os.getloadavg()),
        "work_dir": _rel(work),
        "runs": [],
    }
    for ref in held:
        for seed in args.seeds:
            others = [builtin[s] for s in pool if s != ref.name]
            if args.sample_efficiency:
                group = group_of(ref.name, ref in near)
                data["runs"].append(run_curve(ref, group, others, seed, args, work))
                data["summary"] = se.summarize(data["runs"], args.reference_n)
            else:
                data["runs"].append(run_one(ref, others, seed, args, work))
                data["summary"] = summarize(data["runs"])
            data["loadavg_end"] = list(os.getloadavg())
            path = save_json(args.name, data, results)
            if args.sample_efficiency:
                se.render_pages(data, args.page, args.readme)
            elif args.page is not None:
                render_page(args.page, data, args.name)
    print(se.render_table(data) if args.sample_efficiency else render_table(data))
    print(f"wrote {_rel(path)}")
    return data


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """CLI entry: bad input is one line on stderr and exit status 2."""
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except (BenchmarkError, ValueError, FileNotFoundError) as e:
        print(f"benchmarks.transfer: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
