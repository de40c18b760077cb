"""Quality benchmark: our model against The Well's FNO and UNetConvNext and persistence, at the
same training budget and with the same number of tuning candidates.

For every built-in system (2D Navier-Stokes, Gray-Scott, shallow water, 3D advection-diffusion)
and every extra Well dataset given with ``--dataset``, at every budget and for every seed of
``--seeds``:

1. train every candidate of OUR model (``experiment=quickstart`` plus ``--ours-override``
   options plus the candidate's overrides);
2. choose ours on the VALIDATION split: the candidate with the lower validation rollout VRMSE
   (mean over fields and seeds of the per-step VRMSE over steps 1-30);
3. train every candidate of each baseline of ``--baselines`` (The Well's FNO and UNetConvNext,
   :mod:`benchmarks.baselines`) on the same data, windows, batch size and normaliser as the
   chosen ours, and choose each on the VALIDATION split the same way;
4. report the chosen ones on the TEST split: one-step VRMSE over every test window, and from
   the start of every test trajectory to its end the windowed rollout VRMSE and fidelity
   measures (amplitude ratio, change correlation, power ratio), for ours without and with
   inference jitter (``ours``, ``ours+jitter``), each baseline and persistence; per window the
   mean, sample standard deviation, min and max over seeds.

Candidates come from ``--candidates`` (default ``benchmarks/quality_candidates.yaml``): every
model gets the same number, at most 8, and the JSON's ``selection`` keeps every candidate's
validation score per seed for every model.

Budgets (:mod:`benchmarks.harness`): ``--steps N`` and/or ``--cpu-seconds S`` of process CPU
time summed over threads. Timing: on a machine whose cores are busy with other work, OpenMP
threads spin and small ops slow down many times over; use ``--threads 1`` there.

Run from the repository root::

    python -m benchmarks.quality --cpu-seconds 150 --seeds 0,1,2 --dataset data/gray_scott_pypde
    python -m benchmarks.quality --systems gray_scott_2d --steps 20 --n-traj 4,1,1 \\
        --resolution 32 --frames 70 --data-root /tmp/quality_data \\
        --candidates my_small_candidates.yaml                           # smoke run

Built-in data is generated under ``--data-root`` when missing (default counts 24/8/8; existing
data is reused as it is). Results: a printed table and ``benchmarks/results/<name>.json``
(``format: quality/2``), rendered for the README by ``python -m benchmarks.quality_table``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from benchmarks import harness as h
from benchmarks.baselines import BASELINE_MISSING, KINDS, baselines_available, train_baseline
from benchmarks.candidates import CANDIDATES, Candidates, check_overrides, load_candidates
from benchmarks.common import print_table
from benchmarks.record import finish_record, portable_path, run_record, save_result, spread

FORMAT = "quality/2"
DEFAULT_N_TRAJ = (24, 8, 8)


def choose(scores: Mapping[str, Sequence[float]]) -> str:
    """The candidate with the lowest mean score over seeds (first listed on a tie)."""
    if not scores:
        raise h.BenchmarkError("nothing to choose from")
    return min(scores, key=lambda name: statistics.fmean(scores[name]))


def aggregate(per_seed: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean, std, min and max over seeds of one model's one-step VRMSE and every window."""
    windows = list(per_seed[0]["rollout"]["mean"])
    fidelity = per_seed[0]["fidelity"]
    return {
        "one_step": spread([s["one_step"]["mean"] for s in per_seed]),
        "rollout": {w: spread([s["rollout"]["mean"].get(w) for s in per_seed]) for w in windows},
        "fidelity": {
            m: {w: spread([s["fidelity"][m].get(w) for s in per_seed]) for w in fidelity[m]}
            for m in fidelity
        },
    }


def run_system(
    ref: h.DatasetRef,
    budget: h.Budget,
    work_dir: str | os.PathLike,
    candidates: Candidates,
    *,
    seeds: Sequence[int] = (0,),
    ours_overrides: Sequence[str] = (),
    ours_weights: str = "last",
    jitter_seed: int = 0,
    ensemble: int = 1,
    probe_steps: int = 10,
    eval_batch_size: int = 8,
    log: Any = print,
) -> dict[str, Any]:
    """Train every candidate of every model per seed on ``ref`` at ``budget``, choose each
    model's on valid, score the chosen ones on test.

    Args:
        candidates: ours' (Hydra overrides after ``ours_overrides``) and each baseline's.

    Returns:
        One entry of the JSON's ``runs`` (see the module docstring).
    """
    load_before = os.getloadavg()
    out = Path(work_dir) / budget.label.replace(" ", "_") / ref.name
    trained: dict[str, list[h.Trained]] = {}
    cfgs: dict[str, Any] = {}  # candidate -> its composed config (the same for every seed)
    vocab = None
    for seed in seeds:
        for name, extra in candidates.ours.items():
            log(f"[{budget.label}] {ref.name} seed {seed}: training ours ({name})")
            t, cfgs[name], vocab = h.train_ours(
                ref,
                budget,
                out / f"seed{seed}" / name,
                [*ours_overrides, *extra],
                probe_steps,
                ours_weights,
                seed=seed,
            )
            trained.setdefault(name, []).append(t)
            log(f"  {t.info['steps']} steps, {t.info['cpu_s']:.1f} cpu-s")

    def data_kw(cfg: Any) -> dict[str, Any]:
        data = OmegaConf.to_container(cfg.data, resolve=True)
        return {"n_steps_input": int(data["n_steps_input"]), "time_stride": data["time_stride"]}

    def score_valid(runs: Mapping[str, list[h.Trained]], cfg_of: Any) -> dict[str, list[float]]:
        """Every candidate's validation score per seed."""
        scores: dict[str, list[float]] = {}
        for name, models in runs.items():
            for t in models:
                res = h.evaluate(
                    ref,
                    {name: t.forecaster},
                    split="valid",
                    vocab=vocab,
                    batch_size=eval_batch_size,
                    **data_kw(cfg_of(name)),
                )
                scores.setdefault(name, []).append(h.selection_score(res["models"][name]))
        return scores

    valid = score_valid(trained, cfgs.__getitem__)
    chosen = choose(valid)
    selection: dict[str, Any] = {
        "ours": {
            "candidates": {n: list(o) for n, o in candidates.ours.items()},
            "valid_scores": valid,
            "chosen": chosen,
        }
    }
    cfg = cfgs[chosen]
    chosen_runs = {"ours": trained[chosen]}
    for kind, options in candidates.baselines.items():
        runs: dict[str, list[h.Trained]] = {}
        for name, opts in options.items():
            for seed in seeds:
                log(f"[{budget.label}] {ref.name} seed {seed}: training {kind} ({name})")
                t = train_baseline(
                    ref,
                    budget,
                    batch_size=int(cfg.data.batch_size),
                    normalizer=trained[chosen][0].forecaster.normalizer,
                    options=opts,
                    probe_steps=probe_steps,
                    seed=seed,
                    **data_kw(cfg),
                )
                t.info["candidate"] = name
                runs.setdefault(name, []).append(t)
                log(f"  {t.info['steps']} steps, {t.info['cpu_s']:.1f} cpu-s")
        scores = score_valid(runs, lambda _: cfg)
        best = choose(scores)
        selection[kind] = {
            "candidates": {n: dataclasses.asdict(o) for n, o in options.items()},
            "valid_scores": scores,
            "chosen": best,
        }
        chosen_runs[kind] = runs[best]

    log(f"[{budget.label}] {ref.name}: evaluating on test")
    t0 = time.perf_counter()
    per_seed: dict[str, list[dict[str, Any]]] = {}
    result: dict[str, Any] = {}
    for i, seed in enumerate(seeds):
        ours = trained[chosen][i]
        forecasters = {
            "ours": ours.forecaster,
            "ours+jitter": dataclasses.replace(
                ours.forecaster, jitter_seed=jitter_seed, ensemble=ensemble
            ),
        }
        infos = {"ours": ours.info, "ours+jitter": ours.info}
        for kind in candidates.baselines:
            forecasters[kind], infos[kind] = (
                chosen_runs[kind][i].forecaster,
                chosen_runs[kind][i].info,
            )
        result = h.evaluate(
            ref, forecasters, split="test", vocab=vocab, batch_size=eval_batch_size, **data_kw(cfg)
        )
        for name, summary in result["models"].items():
            if name == "persistence" and i > 0:
                continue  # the same for every seed
            per_seed.setdefault(name, []).append(
                {"seed": seed, **summary, **({"train": infos[name]} if name in infos else {})}
            )
    models = {n: {"per_seed": s, "stats": aggregate(s)} for n, s in per_seed.items()}
    return {
        "system": ref.name,
        "dataset": portable_path(ref.path),
        "budget": {"kind": budget.kind, "value": budget.value, "label": budget.label},
        "seeds": list(seeds),
        "selection": selection,
        **{k: v for k, v in result.items() if k != "models"},
        "models": models,
        "eval_wall_s": time.perf_counter() - t0,
        "loadavg": {"before": list(load_before), "after": list(os.getloadavg())},
    }


def _cell(stats: Mapping[str, Any]) -> str:
    if stats["mean"] is None:
        return "-"
    return f"{stats['mean']:.3g}±{stats['std']:.2g}" if stats["n"] > 1 else f"{stats['mean']:.3g}"


def _means(run: Mapping[str, Any], model: str) -> list[float | None]:
    """One-step and per-window means over seeds of ``model`` in ``run``."""
    st = run["models"][model]["stats"]
    return [st["one_step"]["mean"], *(st["rollout"][w]["mean"] for w in run["windows"])]


def table_rows(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Printed rows (budget x system x model): one-step and windowed rollout VRMSE, mean±std
    over seeds, and the ratios of means ``ours/<baseline>`` and ``ours/persistence``."""
    rows: list[dict[str, Any]] = []
    for run in runs:
        models = run["models"]
        keys = ["one_step", *run["windows"]]

        head = {"budget": run["budget"]["label"], "system": run["system"]}
        for m, res in models.items():
            st = res["stats"]
            cells = [_cell(st["one_step"]), *(_cell(st["rollout"][w]) for w in run["windows"])]
            rows.append({**head, "model": m, **dict(zip(keys, cells))})
        for other in (*KINDS, "persistence"):
            if other in models:
                ratio = [
                    f"{a / b:.3g}" if a is not None and b else "-"
                    for a, b in zip(_means(run, "ours"), _means(run, other))
                ]
                rows.append({**head, "model": f"ours/{other}", **dict(zip(keys, ratio))})
    return rows


def _ints(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",") if p]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _n_traj(text: str) -> int | tuple[int, ...]:
    parts = _ints(text)
    if len(parts) not in (1, 3):
        raise argparse.ArgumentTypeError("--n-traj takes N (train) or TRAIN,VALID,TEST")
    return parts[0] if len(parts) == 1 else tuple(parts)


def parse_candidates(text: str) -> dict[str, list[str]]:
    """``"A=k=v k2=v2;B=k=v"`` -> ``{"A": ["k=v", "k2=v2"], "B": ["k=v"]}``."""
    out: dict[str, list[str]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, overrides = part.partition("=")
        if not sep or not name.strip() or name.strip() in out:
            raise argparse.ArgumentTypeError(f"{part!r} is not NAME=overrides with a new NAME")
        try:
            out[name.strip()] = check_overrides(name.strip(), overrides.split())
        except h.BenchmarkError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return out


def add_run_args(p: argparse.ArgumentParser, name: str) -> None:
    """Options shared by the training benchmarks: budget, seeds, data, ours, threads, output."""
    p.add_argument("--steps", type=int, help="budget: optimiser steps")
    p.add_argument("--cpu-seconds", type=float, help="budget: CPU seconds of training")
    p.add_argument("--seeds", type=_ints, default=[0], help="training seeds, e.g. 0,1,2")
    add_data_args(p)
    p.add_argument("--ours-override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--probe-steps", type=int, default=10, help="CPU-budget probe steps")
    p.add_argument("--eval-batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--work-dir", help=f"training runs (default: outputs/{name}/<start time>)")
    p.add_argument("--results-dir", help="default: benchmarks/results")
    p.add_argument("--name", default=name, help="results file stem")


def add_data_args(p: argparse.ArgumentParser) -> None:
    """The dataset options shared by the training benchmarks (read by :func:`dataset_refs`)."""
    p.add_argument("--systems", default=",".join(h.SYSTEMS), help="built-in systems, or 'none'")
    p.add_argument("--dataset", action="append", default=[], help="extra Well dataset dir")
    p.add_argument(
        "--data-root",
        default=os.environ.get("WALRUS_DATA_DIR", "data"),
        help="where built-in systems live or are generated ($WALRUS_DATA_DIR or data)",
    )
    p.add_argument(
        "--n-traj", type=_n_traj, default=DEFAULT_N_TRAJ, help="new built-in data: TRAIN,VALID,TEST"
    )
    p.add_argument("--resolution", type=int, help="new built-in data: grid points per axis")
    p.add_argument("--frames", type=int, help="new built-in data: frames per trajectory")
    p.add_argument("--data-seed", type=int, default=0, help="built-in data generation seed")


def dataset_refs(args: argparse.Namespace) -> list[h.DatasetRef]:
    """The datasets :func:`add_data_args`' options name (built-in ones generated if missing)."""
    systems = [] if args.systems == "none" else [s for s in args.systems.split(",") if s]
    refs = [
        h.builtin_dataset(
            s, args.data_root, args.n_traj, args.resolution, args.frames, args.data_seed
        )
        for s in systems
    ]
    refs += [h.external_dataset(p) for p in args.dataset]
    if not refs:
        raise h.BenchmarkError("nothing to run: no --systems and no --dataset")
    labels = [r.name for r in refs]
    if len(set(labels)) != len(labels):
        raise h.BenchmarkError(f"two datasets share a name: {labels}")
    return refs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.quality",
        description=(
            "Ours vs The Well's FNO and UNetConvNext vs persistence: every model's candidates "
            "chosen on valid, scored on test, over seeds."
        ),
    )
    add_run_args(p, "quality")
    p.add_argument(
        "--candidates",
        default=CANDIDATES,
        help="every model's candidates, chosen on valid (default benchmarks/quality_candidates.yaml)",
    )
    p.add_argument(
        "--baselines",
        default=",".join(KINDS),
        help=f"baselines to train, comma-separated from {','.join(KINDS)}, or 'none'",
    )
    p.add_argument("--ours-weights", choices=("last", "best"), default="last")
    p.add_argument("--ours-jitter-seed", type=int, default=0, help="seed of ours+jitter")
    p.add_argument("--ours-ensemble", type=int, default=1, help="ours+jitter: rollouts averaged")
    return p


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Run the benchmark as the parsed CLI ``args`` describe; prints tables, writes the JSON."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    record = run_record(argv)
    budgets = []
    if args.steps is not None:
        budgets.append(h.Budget("steps", args.steps))
    if args.cpu_seconds is not None:
        budgets.append(h.Budget("cpu_seconds", args.cpu_seconds))
    if not budgets:
        raise h.BenchmarkError("give a budget: --steps N and/or --cpu-seconds S")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        raise h.BenchmarkError(f"--seeds must list distinct seeds, got {args.seeds}")
    if args.ours_ensemble < 1:
        raise h.BenchmarkError(f"--ours-ensemble must be >= 1, got {args.ours_ensemble}")
    kinds = [] if args.baselines == "none" else [k for k in args.baselines.split(",") if k]
    bad = sorted(set(kinds) - set(KINDS))
    if bad or len(set(kinds)) != len(kinds):
        raise h.BenchmarkError(
            f"--baselines takes distinct names from {KINDS} or 'none', got {args.baselines!r}"
        )
    if kinds and not baselines_available():
        raise h.BenchmarkError(BASELINE_MISSING)
    candidates = load_candidates(args.candidates, kinds)
    refs = dataset_refs(args)
    if args.work_dir is None:
        stamp = record["started"].replace(":", "-")
        args.work_dir = str(Path("outputs") / "quality" / stamp)
    runs = []
    for budget in budgets:
        for ref in refs:
            run_ = run_system(
                ref,
                budget,
                args.work_dir,
                candidates,
                seeds=args.seeds,
                ours_overrides=args.ours_override,
                ours_weights=args.ours_weights,
                jitter_seed=args.ours_jitter_seed,
                ensemble=args.ours_ensemble,
                probe_steps=args.probe_steps,
                eval_batch_size=args.eval_batch_size,
            )
            if run_["trajectories"] < 8:
                print(f"note: {ref.name} has {run_['trajectories']} test trajectories (< 8)")
            runs.append(run_)
    data = {
        "format": FORMAT,
        "record": finish_record(record),
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
        "budgets": [{"kind": b.kind, "value": b.value, "label": b.label} for b in budgets],
        "runs": runs,
    }
    print_table(table_rows(runs))
    path = save_result(args.name, data, args.results_dir)
    print(f"wrote {path}")
    return data


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """CLI entry point; bad input exits 2 with a one-line ``benchmarks.quality: ...`` message."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        return run(args, argv)
    except h.BenchmarkError as e:
        print(f"benchmarks.quality: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
