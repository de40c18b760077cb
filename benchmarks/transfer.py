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
pretraining's CPU seconds plus the fine-tuning's. :mod:`benchmarks.transfer_sample_efficiency`
runs it; :mod:`benchmarks.sample_efficiency` summarises (data-efficiency factor) and renders
``benchmarks/results/sample_efficiency.json``::

    python -m benchmarks.transfer --sample-efficiency --pretrain-time 1800 --seeds 0,1,2 \\
        --widen-grid --near data/gray_scott_pypde --page docs/results.md
    python -m benchmarks.transfer --sample-efficiency --render-only   # page and README

Training CPU time is measured (and capped, for the long-scratch row) by the quality benchmark's
:class:`benchmarks.budgets.CPUBudget`; the training and scoring runs of both modes are in
:mod:`benchmarks.transfer_runs`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks import sample_efficiency as se
from benchmarks import transfer_sample_efficiency as tse
from benchmarks.budgets import BenchmarkError, step_ceiling
from benchmarks.common import RESULTS_DIR, cpu_model, save_json
from benchmarks.pages import RESULTS_PAGE
from benchmarks.transfer_runs import (
    DataSet,
    builtin_set,
    check_pool,
    count_trajectories,
    evaluate,
    external_set,
    fit,
    held_overrides,
    pretrain,
    rel,
    score_zero_shot,
)
from benchmarks.transfer_table import render_page, render_table, summarize
from walrus.data.synthetic import SYSTEMS
from walrus.training.budget import parse_duration
from walrus.training.model_card import git_state

ZERO_SHOT = "pretrained, no fine-tuning"


def _portable(key: str, value: Any) -> Any:
    """An argument for the JSON: folders relative to the current one."""
    if key in ("data_root", "work_dir", "results_dir", "page") and value is not None:
        return rel(value)
    return [rel(v) for v in value] if key == "dataset" else value


def run_one(
    held: DataSet,
    pool: Sequence[DataSet],
    seed: int,
    args: argparse.Namespace,
    work: Path,
    log: Any = print,
) -> dict[str, Any]:
    """Pretrain without ``held``, then fine-tune / scratch / long scratch on it; scored on test."""
    check_pool(held, pool)
    on_held = [*held_overrides(held, seed), *args.override]
    scratch = [*on_held, "finetune.enabled=false"]
    out = work / held.name / f"seed_{seed}"
    record: dict[str, Any] = {
        "held_out": held.name,
        "dataset": rel(held.path),
        "seed": seed,
        "models": {},
    }
    log(
        f"[{held.name} seed {seed}] pretraining on {len(pool)} systems for {args.pretrain_time:g} s"
    )
    pre = pretrain(pool, seed, args, out / "pretrain")
    record["pretrain"] = {
        "systems": [p.name for p in pool],
        **{k: v for k, v in pre.items() if k not in ("checkpoint", "best")},
        "checkpoint": rel(pre["checkpoint"]),
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
        m["checkpoint"] = rel(m["checkpoint"])
        m["test"] = scored
        record["models"][label] = m
    record["models"]["persistence"] = {"test": {**scored, "model": scored["persistence"]}}
    return record


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
    se_add("--trajectories", type=tse.trajectory_grid, default=["1", "2", "4", "8", "all"])
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark as ``args`` describe; writes the JSON after every run."""
    results = Path(args.results_dir) if args.results_dir else RESULTS_DIR
    args.name = args.name or (se.NAME if args.sample_efficiency else "transfer")
    if args.sample_efficiency and args.render_only:
        return tse.render_only(results / f"{args.name}.json", args.page, args.readme)
    if args.render_only:
        path = results / f"{args.name}.json"
        if not path.is_file():
            raise BenchmarkError(f"{path}: no results to render; run the benchmark first")
        data = json.loads(path.read_text())
        render_page(args.page or RESULTS_PAGE, data, args.name)
        return data
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    argv = [rel(a) if os.path.isabs(a) else a for a in sys.argv[1:]]
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
            ",".join([s for s in SYSTEMS if s.endswith("_2d")] + tse.SE_OTHER)
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
        tse.check_sample_efficiency(args, [*held, *near])
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
        "work_dir": rel(work),
        "runs": [],
    }
    for ref in held:
        for seed in args.seeds:
            others = [builtin[s] for s in pool if s != ref.name]
            if args.sample_efficiency:
                group = tse.group_of(ref.name, ref in near)
                data["runs"].append(tse.run_curve(ref, group, others, seed, args, work))
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
    print(f"wrote {rel(path)}")
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
