"""The sample-efficiency mode of the transfer benchmark (``python -m benchmarks.transfer
--sample-efficiency``): per held-out set and seed, the leave-one-out pretraining, then fine-tuned
and scratch runs on the first N train trajectories for every N, each side at its
validation-chosen rate (the grid widened while a choice sits at an edge) and its best-validation
checkpoint; a compute-matched scratch row; the checks before any training and ``--render-only``.
:mod:`benchmarks.sample_efficiency` summarises and renders the results.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import sample_efficiency as se
from benchmarks.budgets import BenchmarkError, step_ceiling
from benchmarks.pages import README, RESULTS_PAGE
from benchmarks.transfer_runs import (
    DataSet,
    check_pool,
    count_trajectories,
    evaluate,
    fit,
    held_overrides,
    pretrain,
    rel,
)

# held out with --sample-efficiency besides every 2D system: one 1D and one 3D system
SE_OTHER = ["burgers_1d", "advection_diffusion_3d"]


def group_of(name: str, near: bool = False) -> str:
    """The table group of held-out set ``name``: ``near`` (an outside set that resembles the
    pretraining pool), ``1D`` / ``2D`` / ``3D`` for a built-in system, else ``external``."""
    if near:
        return "near"
    return {"_1d": "1D", "_2d": "2D", "_3d": "3D"}.get(name[-3:], "external")


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
    check_pool(held, pool)
    out = work / held.name / f"seed_{seed}"
    all_count = count_trajectories(held, "train")
    log(
        f"[{held.name} seed {seed}] pretraining on {len(pool)} systems for {args.pretrain_time:g} s"
    )
    pre = pretrain(pool, seed, args, out / "pretrain")
    record: dict[str, Any] = {
        "held_out": held.name,
        "group": group,
        "dataset": rel(held.path),
        "seed": seed,
        "train_trajectories_all": all_count,
        "pretrain": {
            "systems": [p.name for p in pool],
            **{k: v for k, v in pre.items() if k not in ("checkpoint", "best")},
            "checkpoint": rel(pre["checkpoint"]),
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
            m["checkpoint"] = rel(m["checkpoint"])
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
        matched["checkpoint"] = rel(matched["checkpoint"])
        record["compute_matched"] = {
            **matched,
            "lr": ref["scratch"]["lr"],
            "cpu_budget_s": cpu,
            "trajectories": args.reference_n,
        }
    if scored is not None:
        record["persistence"] = {"test": {**scored, "model": scored["persistence"]}}
    return record


def trajectory_grid(text: str) -> list[str]:
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


def render_only(path: Path, page: Path | None, readme: Path | None) -> dict[str, Any]:
    """``--sample-efficiency --render-only``: the table and headline of results file ``path``
    onto ``page`` (default docs/results.md) and ``readme`` (default README.md); a missing file
    renders as not run yet. Returns the results (``{}`` when missing)."""
    data = json.loads(path.read_text()) if path.is_file() else None
    se.render_pages(data, page or RESULTS_PAGE, readme or README)
    return data or {}
