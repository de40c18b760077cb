"""Quality benchmark: our model against an FNO and persistence, at the same training budget.

For every built-in system (2D Navier-Stokes, Gray-Scott, shallow water, 3D advection-diffusion)
and every extra Well dataset given with ``--dataset``, at every budget and for every seed of
``--seeds``:

1. train OUR model (``experiment=quickstart`` plus ``--ours-override`` options; with
   ``--ours-candidates`` every candidate is trained, see below);
2. train the FNO baseline (:mod:`benchmarks.fno`) at every width of ``--fno-widths`` (2D;
   ``--fno-widths-3d`` in 3D) and every input-noise level of ``--fno-noise`` (default ``ours,0``:
   our run's ``module.input_noise``, in its units, and none);
3. choose on the VALIDATION split: the FNO width and noise, and our candidate, with the lower
   validation rollout VRMSE (mean over fields and seeds of the per-step VRMSE over steps 1-30);
4. report the chosen ones on the TEST split: one-step VRMSE over every test window, and from
   the start of every test trajectory to its end the windowed rollout VRMSE and fidelity
   measures (amplitude ratio, change correlation, power ratio), for ours without and with
   inference jitter (``ours``, ``ours+jitter``), the FNO and persistence; per window the mean,
   sample standard deviation, min and max over seeds.

Budgets (:mod:`benchmarks.harness`): ``--steps N`` and/or ``--cpu-seconds S`` of process CPU
time summed over threads. Timing: on a machine whose cores are busy with other work, OpenMP
threads spin and small ops slow down many times over; use ``--threads 1`` there.

Run from the repository root::

    python -m benchmarks.quality --cpu-seconds 150 --seeds 0,1,2 --dataset data/gray_scott_pypde
    python -m benchmarks.quality --systems gray_scott_2d --steps 20 --n-traj 4,1,1 \\
        --resolution 32 --frames 70 --data-root /tmp/quality_data      # smoke run

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
from benchmarks.common import print_table
from benchmarks.fno import FNO_MISSING, NOISE_UNITS, FNOOptions, fno_available, train_fno
from benchmarks.record import finish_record, portable_path, run_record, save_result, spread

FORMAT = "quality/2"
DEFAULT_N_TRAJ = (24, 8, 8)
FNO_WIDTHS = (64, 128)


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
    *,
    seeds: Sequence[int] = (0,),
    ours_candidates: Mapping[str, Sequence[str]] | None = None,
    ours_overrides: Sequence[str] = (),
    ours_weights: str = "last",
    jitter_seed: int = 0,
    ensemble: int = 1,
    fno: FNOOptions | None = None,
    fno_widths: Sequence[int] = FNO_WIDTHS,
    fno_noises: Sequence[float | None] = (None,),
    probe_steps: int = 10,
    eval_batch_size: int = 8,
    log: Any = print,
) -> dict[str, Any]:
    """Train every model per seed on ``ref`` at ``budget``, choose on valid, score on test.

    Args:
        ours_candidates: name -> Hydra overrides (after ``ours_overrides``); default one
            candidate, ``quickstart``, without extra overrides.
        fno: FNO recipe (``None``: no FNO); every width of ``fno_widths`` (the field it sets:
            ``hidden`` in 2D, ``hidden_3d`` in 3D) is tried with every input-noise level of
            ``fno_noises``, as candidates named ``fno<width>_noise<level>``.
        fno_noises: noise levels; ``None`` is our run's ``module.input_noise`` (the FNO then
            also takes our ``noise_units``; explicit levels use ``fno.noise_units``).

    Returns:
        One entry of the JSON's ``runs`` (see the module docstring).
    """
    candidates = dict(ours_candidates or {"quickstart": []})
    load_before = os.getloadavg()
    out = Path(work_dir) / budget.label.replace(" ", "_") / ref.name
    trained: dict[str, list[h.Trained]] = {}
    cfgs: dict[str, Any] = {}  # candidate -> its composed config (the same for every seed)
    valid: dict[str, list[float]] = {}
    vocab = None
    for seed in seeds:
        for name, extra in candidates.items():
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

    def score_valid(name: str, models: list[h.Trained], cfg: Any) -> None:
        for t in models:
            res = h.evaluate(
                ref,
                {name: t.forecaster},
                split="valid",
                vocab=vocab,
                batch_size=eval_batch_size,
                **data_kw(cfg),
            )
            valid.setdefault(name, []).append(h.selection_score(res["models"][name]))

    if len(candidates) > 1:
        for name, models in trained.items():
            score_valid(name, models, cfgs[name])
    chosen = (
        choose({n: valid[n] for n in candidates}) if len(candidates) > 1 else next(iter(candidates))
    )
    selection: dict[str, Any] = {
        "ours": {
            "candidates": {n: list(o) for n, o in candidates.items()},
            "valid_scores": {n: valid.get(n) for n in candidates},
            "chosen": chosen,
        }
    }

    cfg = cfgs[chosen]
    fno_models: list[h.Trained] = []
    if fno is not None:
        module_cfg = cfg.get("module", {})
        ours_noise = float(module_cfg.get("input_noise", 0.0))
        ours_units = str(module_cfg.get("noise_units", "delta_rms"))
        levels: dict[float, str] = {}  # noise level -> its units, each level once
        for level in fno_noises:
            if level is None:
                levels.setdefault(ours_noise, ours_units)
            else:
                levels.setdefault(float(level), fno.noise_units)
        width_key = "hidden_3d" if _is_3d(ref) else "hidden"
        fno_runs: dict[str, list[h.Trained]] = {}
        for width in fno_widths:
            for level, units in levels.items():
                opts = dataclasses.replace(
                    fno, **{width_key: width}, noise=level, noise_units=units
                )
                name = f"fno{width}_noise{level:g}"
                for seed in seeds:
                    log(f"[{budget.label}] {ref.name} seed {seed}: training the FNO ({name})")
                    t = train_fno(
                        ref,
                        budget,
                        batch_size=int(cfg.data.batch_size),
                        normalizer=trained[chosen][0].forecaster.normalizer,
                        options=opts,
                        probe_steps=probe_steps,
                        seed=seed,
                        **data_kw(cfg),
                    )
                    fno_runs.setdefault(name, []).append(t)
                    log(f"  {t.info['steps']} steps, {t.info['cpu_s']:.1f} cpu-s")
        for name, models in fno_runs.items():
            score_valid(name, models, cfg)
        best = choose({n: valid[n] for n in fno_runs})
        selection["fno"] = {"valid_scores": {n: valid[n] for n in fno_runs}, "chosen": best}
        fno_models = fno_runs[best]

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
        if fno_models:
            forecasters["fno"], infos["fno"] = fno_models[i].forecaster, fno_models[i].info
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


def _is_3d(ref: h.DatasetRef) -> bool:
    from walrus.data.well_dataset import WellDataset

    ds = WellDataset(ref.root, ref.name, "train", 1, 1)
    try:
        return ds.n_spatial == 3
    finally:
        ds.close()


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
    over seeds, and the ratios of means ``ours/fno`` and ``ours/persistence``."""
    rows: list[dict[str, Any]] = []
    for run in runs:
        models = run["models"]
        keys = ["one_step", *run["windows"]]

        head = {"budget": run["budget"]["label"], "system": run["system"]}
        for m, res in models.items():
            st = res["stats"]
            cells = [_cell(st["one_step"]), *(_cell(st["rollout"][w]) for w in run["windows"])]
            rows.append({**head, "model": m, **dict(zip(keys, cells))})
        for other in ("fno", "persistence"):
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


def _noise_levels(text: str) -> list[float | None]:
    """``"ours,0,0.05"`` -> ``[None, 0.0, 0.05]`` (``None``: our run's level)."""
    out: list[float | None] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            level = None if part == "ours" else float(part)
        except ValueError:
            level = -1.0
        if level is not None and not level >= 0:
            raise argparse.ArgumentTypeError(
                f"noise levels are 'ours' or numbers >= 0, got {part!r}"
            )
        out.append(level)
    if not out:
        raise argparse.ArgumentTypeError("give at least one noise level")
    return out


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


def check_overrides(name: str, overrides: Any) -> list[str]:
    """``overrides`` as a list of plain Hydra ``key=value`` strings, or a one-line error.

    Candidates may come from a file, so no interpolation (``${...}``) and no ``_target_`` key.
    """
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise h.BenchmarkError(f"candidate {name!r}: overrides must be a list of strings")
    for o in overrides:
        key, sep, _ = o.partition("=")
        if not sep or not key.strip("+~") or "${" in o or "_target_" in key:
            raise h.BenchmarkError(
                f"candidate {name!r}: {o!r} is not a plain key=value override "
                "(no ${...} interpolation, no _target_)"
            )
    return overrides


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
        description="Ours vs an FNO vs persistence: chosen on valid, scored on test, over seeds.",
    )
    add_run_args(p, "quality")
    p.add_argument(
        "--ours-candidates",
        type=parse_candidates,
        help="NAME=overrides;NAME2=overrides: trained each, chosen on valid",
    )
    p.add_argument("--ours-weights", choices=("last", "best"), default="last")
    p.add_argument("--ours-jitter-seed", type=int, default=0, help="seed of ours+jitter")
    p.add_argument("--ours-ensemble", type=int, default=1, help="ours+jitter: rollouts averaged")
    p.add_argument("--no-fno", action="store_true", help="skip the FNO baseline")
    p.add_argument("--fno-widths", type=_ints, default=list(FNO_WIDTHS), help="2D widths tried")
    p.add_argument("--fno-widths-3d", type=_ints, default=[FNOOptions.hidden_3d])
    p.add_argument("--fno-modes", type=int, default=FNOOptions.modes, help="per axis, 2D")
    p.add_argument("--fno-modes-3d", type=int, default=FNOOptions.modes_3d, help="per axis, 3D")
    p.add_argument("--fno-layers", type=int, default=FNOOptions.layers)
    p.add_argument("--fno-lr", type=float, default=FNOOptions.lr)
    p.add_argument("--fno-weight-decay", type=float, default=FNOOptions.weight_decay)
    p.add_argument("--fno-loss", choices=("mse", "mae"), default=FNOOptions.loss)
    p.add_argument(
        "--fno-noise",
        type=_noise_levels,
        default=[None, 0.0],
        help="FNO input-noise levels tried, comma-separated; 'ours' is our run's (default ours,0)",
    )
    units = "units of numeric --fno-noise levels ('ours' takes our units)"
    p.add_argument("--fno-noise-units", choices=NOISE_UNITS, default="input_rms", help=units)
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
    if not args.no_fno and not fno_available():
        raise h.BenchmarkError(FNO_MISSING)
    refs = dataset_refs(args)
    fno = None
    if not args.no_fno:
        fno = FNOOptions(
            modes=args.fno_modes,
            modes_3d=args.fno_modes_3d,
            layers=args.fno_layers,
            lr=args.fno_lr,
            weight_decay=args.fno_weight_decay,
            loss=args.fno_loss,
            noise_units=args.fno_noise_units,
        )
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
                seeds=args.seeds,
                ours_candidates=args.ours_candidates,
                ours_overrides=args.ours_override,
                ours_weights=args.ours_weights,
                jitter_seed=args.ours_jitter_seed,
                ensemble=args.ours_ensemble,
                fno=fno,
                fno_widths=args.fno_widths_3d if _is_3d(ref) else args.fno_widths,
                fno_noises=args.fno_noise,
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
