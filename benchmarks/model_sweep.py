"""Compute-optimal model sweep: named candidates trained at one CPU budget, judged on validation.

Each candidate is a list of Hydra overrides for our model (applied after ``experiment=quickstart``
and ``--ours-override``), e.g. ``model.dim=192 model.depth=6 optimizer.lr=5e-4``. Every
candidate is trained on every dataset for every seed at ``--cpu-seconds`` of process CPU time
(:mod:`benchmarks.harness`) and scored on the VALIDATION split: windowed rollout VRMSE,
amplitude ratio and change correlation (mean over fields). The test split is never read.

Candidates come from repeated ``--candidate NAME=overrides`` flags or from ``--candidates
FILE`` (YAML or JSON: ``{name: [override, ...]}`` or ``{name: "override override"}``; plain
``key=value`` strings only, checked one by one).

``benchmarks/results/<name>.json`` (default ``model_sweep``) is rewritten atomically after every
run, so a sweep that is cut keeps what finished; ``--resume`` skips the runs already in it (same
candidate overrides and budget required). The printed table ranks candidates by their mean
validation rollout VRMSE over steps 1-30, with parameter count and the processor's share of
parameters (and of FLOPs, where ``walrus.model.flops`` offers a breakdown)::

    python -m benchmarks.model_sweep --cpu-seconds 150 --seeds 0 --systems gray_scott_2d \\
        --candidate base= --candidate wide="model.dim=192 optimizer.lr=5e-4"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from benchmarks import harness as h
from benchmarks.common import RESULTS_DIR, print_table
from benchmarks.quality import add_run_args, check_overrides, dataset_refs, parse_candidates
from benchmarks.record import finish_record, run_record, save_result
from walrus.safe_yaml import load_yaml

FORMAT = "model_sweep/1"


def load_candidates(path: str | Path) -> dict[str, list[str]]:
    """Candidates from a YAML or JSON file: ``{name: [override, ...] | "override ..."}``."""
    try:
        data = load_yaml(path)  # JSON is YAML
    except (OSError, ValueError) as e:
        raise h.BenchmarkError(f"--candidates {path}: {e}") from None
    if not isinstance(data, Mapping) or not data:
        raise h.BenchmarkError(f"--candidates {path}: expected a mapping name -> overrides")
    out = {}
    for name, overrides in data.items():
        value = overrides.split() if isinstance(overrides, str) else overrides
        out[str(name)] = check_overrides(f"{name} in {path}", value if value is not None else [])
    return out


def model_shares(model: nn.Module, sample: Sequence[int], bcs: Sequence) -> dict[str, Any]:
    """Parameter count, and the processor's (``model.blocks``) share of parameters and of
    forward FLOPs (:func:`walrus.model.flops.forward_flops`) for one input of shape
    ``sample = (1, T, C, *S)`` with boundary codes ``bcs``."""
    from walrus.model import flops

    parts = flops.parameter_counts(model)
    fl = flops.forward_flops(model, *sample[:3], sample[3:], bcs)
    return {
        "params": parts["total"],
        "processor_param_share": parts["processor"] / parts["total"],
        "processor_flop_share": fl["processor"] / fl["total"],
    }


def sweep_run(
    ref: h.DatasetRef,
    name: str,
    overrides: Sequence[str],
    seed: int,
    budget: h.Budget,
    work_dir: Path,
    probe_steps: int = 10,
    eval_batch_size: int = 8,
) -> dict[str, Any]:
    """Train one candidate on ``ref`` at ``budget`` and score it on the validation split."""
    t, cfg, vocab = h.train_ours(
        ref, budget, work_dir / ref.name / name / f"seed{seed}", overrides, probe_steps, seed=seed
    )
    n_in = int(cfg.data.n_steps_input)
    res = h.evaluate(
        ref,
        {"ours": t.forecaster},
        split="valid",
        n_steps_input=n_in,
        time_stride=OmegaConf.to_container(cfg.data, resolve=True)["time_stride"],
        vocab=vocab,
        batch_size=eval_batch_size,
    )
    ours = res["models"]["ours"]
    sample = (1, n_in, len(res["fields"]), *res["grid"])
    return {
        "candidate": name,
        "dataset": ref.name,
        "seed": seed,
        "overrides": list(overrides),
        "score": h.selection_score(ours),
        "one_step": ours["one_step"]["mean"],
        "rollout": ours["rollout"]["mean"],
        "amplitude_ratio": ours["fidelity"]["amplitude_ratio"],
        "change_correlation": ours["fidelity"]["change_correlation"],
        "persistence": res["models"]["persistence"]["rollout"]["mean"],
        "valid_trajectories": res["trajectories"],
        **model_shares(t.forecaster.model, sample, res["bcs"]),
        "train": {k: t.info[k] for k in ("steps", "cpu_s", "wall_s", "max_steps")},
    }


def ranking(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per candidate, best (lowest mean validation score) first."""
    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["candidate"], []).append(r)

    def mean(values: list[Any]) -> float | None:
        ok = [v for v in values if v is not None and v != float("inf")]
        return statistics.fmean(ok) if ok and len(ok) == len(values) else None

    rows = []
    for name, rs in by.items():
        share = rs[0]["processor_flop_share"]
        rows.append(
            {
                "candidate": name,
                "runs": len(rs),
                "val_vrmse_1-30": mean([r["score"] for r in rs]),
                **{f"vrmse {w}": mean([r["rollout"].get(w) for r in rs]) for w in rs[0]["rollout"]},
                "amp 11-30": mean([r["amplitude_ratio"].get("11-30") for r in rs]),
                "corr 11-30": mean([r["change_correlation"].get("11-30") for r in rs]),
                "params": rs[0]["params"],
                "proc params": rs[0]["processor_param_share"],
                "proc flops": share,
            }
        )
    return sorted(rows, key=lambda r: (r["val_vrmse_1-30"] is None, r["val_vrmse_1-30"] or 0.0))


def _candidates(args: argparse.Namespace) -> dict[str, list[str]]:
    found = load_candidates(args.candidates) if args.candidates else {}
    for text in args.candidate:
        for name, overrides in parse_candidates(text).items():
            if name in found:
                raise h.BenchmarkError(f"candidate {name!r} is given twice")
            found[name] = overrides
    if not found:
        raise h.BenchmarkError("no candidates: give --candidate NAME=overrides or --candidates")
    return found


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Run (or resume) the sweep the parsed ``args`` describe; returns the JSON written."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    record = run_record(argv)
    if (args.cpu_seconds is None) == (args.steps is None):
        raise h.BenchmarkError("give one budget: --cpu-seconds S (or --steps N for a smoke run)")
    budget = (
        h.Budget("cpu_seconds", args.cpu_seconds)
        if args.cpu_seconds is not None
        else h.Budget("steps", args.steps)
    )
    candidates = _candidates(args)
    path = Path(args.results_dir or RESULTS_DIR) / f"{args.name}.json"
    data: dict[str, Any] = {"format": FORMAT, "split": "valid", "records": [], "runs": []}
    if path.exists() and not args.resume:
        raise h.BenchmarkError(f"{path} exists: pass --resume to continue it, or another --name")
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise h.BenchmarkError(f"--resume: cannot read {path}: {e}") from None
        if data.get("format") != FORMAT or data.get("budget", {}).get("label") != budget.label:
            raise h.BenchmarkError(f"--resume: {path} is not a {FORMAT} sweep at {budget.label}")
    data["budget"] = {"kind": budget.kind, "value": budget.value, "label": budget.label}
    data["common_overrides"] = list(args.ours_override)
    known = data.setdefault("candidates", {})
    for name, overrides in candidates.items():
        if known.setdefault(name, overrides) != overrides:
            raise h.BenchmarkError(f"--resume: candidate {name!r} had overrides {known[name]}")
    done = {(r["candidate"], r["dataset"], r["seed"]) for r in data["runs"]}
    data["records"].append(record)
    work = Path(
        args.work_dir or Path("outputs") / "model_sweep" / record["started"].replace(":", "-")
    )
    for ref in dataset_refs(args):
        for seed in args.seeds:
            for name, overrides in candidates.items():
                if (name, ref.name, seed) in done:
                    print(f"skip {name} on {ref.name}, seed {seed}: already in {path.name}")
                    continue
                print(f"[{budget.label}] {ref.name} seed {seed}: {name} {' '.join(overrides)}")
                t0 = time.perf_counter()
                result = sweep_run(
                    ref,
                    name,
                    [*args.ours_override, *overrides],
                    seed,
                    budget,
                    work,
                    args.probe_steps,
                    args.eval_batch_size,
                )
                result["run_wall_s"] = time.perf_counter() - t0
                data["runs"].append(result)
                data["records"][-1] = finish_record(record)
                save_result(args.name, data, path.parent)
    data["records"][-1] = finish_record(record)
    save_result(args.name, data, path.parent)
    print_table(ranking(data["runs"]))
    print(f"wrote {path}")
    return data


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.model_sweep",
        description="Candidates of our model at one CPU budget, ranked on validation rollouts.",
    )
    add_run_args(p, "model_sweep")
    p.add_argument("--candidate", action="append", default=[], metavar="NAME=OVERRIDES")
    p.add_argument("--candidates", help="YAML/JSON file: name -> overrides")
    p.add_argument("--resume", action="store_true", help="skip runs already in the JSON")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """CLI entry point; bad input exits 2 with a one-line ``benchmarks.model_sweep: ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        return run(args, argv)
    except (h.BenchmarkError, argparse.ArgumentTypeError) as e:
        print(f"benchmarks.model_sweep: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
