"""Ensemble calibration of a checkpoint: ``ensemble=N`` rollouts scored per step window.

``python -m benchmarks.ensemble CKPT [--members 8] [--seeds 0 1 2] [--steps N] [--name NAME]
[OVERRIDE ...]``

For every seed it runs ``infer.py rollout jitter=true ensemble=N seed=S`` and the deterministic
``ensemble=1 seed=S`` on the same trajectories (plots and predictions off, in a temporary folder;
OVERRIDEs such as ``paths.data_dir=DIR data.datasets=[NAME] trajectories=[0,1]`` go to both).
Per step window and seed it records, mean over fields: the corrected spread-skill ratio, the
CRPS, the largest rank-histogram bin over the flat level, the VRMSE of the ensemble mean, of the
deterministic rollout and of persistence, and the field whose spread-skill ratio is furthest
from 1. It prints a table of the means over seeds and writes
``benchmarks/results/ensemble_<name>.json`` with a run record.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.record import finish_record, run_record, save_result, spread
from walrus.metrics import ENSEMBLE


def summarise(ensemble: Mapping[str, Any], single: Mapping[str, Any]) -> dict[str, Any]:
    """Per window, mean over fields, of one dataset's ensemble and deterministic metrics.

    Args:
        ensemble: ``RolloutMetrics.to_dict()`` of the ensemble rollout (with ``"ensemble"``).
        single: the same of the deterministic rollout of the same trajectories.

    Returns:
        window -> ``{"spread_skill", "crps", "rank_max_over_flat", "vrmse_ensemble_mean",
        "vrmse_deterministic", "vrmse_persistence", "worst_spread_skill_field"}``.
    """
    ens = ensemble[ENSEMBLE]
    out: dict[str, Any] = {}
    for w in ensemble["windows"]:
        ratios = {f: ens["spread_skill"]["windows"][f][w] for f in ensemble["fields_in_mean"]}
        scored = {f: abs(math.log(v)) for f, v in ratios.items() if v is not None and v > 0}
        out[w] = {
            **{
                k: ens[k]["mean_over_fields"]["windows"][w]
                for k in ("spread_skill", "crps", "rank_max_over_flat")
            },  # fmt: skip
            "vrmse_ensemble_mean": ensemble["model"]["vrmse"]["mean_over_fields"]["windows"][w],
            "vrmse_deterministic": single["model"]["vrmse"]["mean_over_fields"]["windows"].get(w),
            "vrmse_persistence": ensemble["persistence"]["vrmse"]["mean_over_fields"]["windows"][w],
            "worst_spread_skill_field": max(scored, key=scored.__getitem__) if scored else None,
        }
    return out


def _rollout(ckpt: str, out: Path, members: int, seed: int, overrides: Sequence[str]) -> dict:
    import walrus

    args = [f"ckpt_path={ckpt}", f"out={out}", f"seed={seed}", f"ensemble={members}",
            "jitter=true", "plots=false", "save_predictions=false", "progress=false", *overrides]  # fmt: skip
    return walrus.infer("rollout", *args)["metrics"]


def run(ckpt: str, members: int, seeds: Sequence[int], overrides: Sequence[str]) -> dict[str, Any]:
    """Score ``members``-member rollouts of ``ckpt`` against deterministic ones, per seed."""
    if members < 2:
        raise ValueError(f"--members must be at least 2, got {members}")
    per_seed: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            ens = _rollout(ckpt, Path(tmp) / f"ens{seed}", members, seed, overrides)
            det = _rollout(ckpt, Path(tmp) / f"det{seed}", 1, seed, overrides)
            for name, entry in ens["datasets"].items():
                per_seed.setdefault(name, {})[str(seed)] = summarise(
                    entry["metrics"], det["datasets"][name]["metrics"]
                )
    summary: dict[str, Any] = {}
    for name, seeds_of in per_seed.items():
        first = next(iter(seeds_of.values()))  # window -> scores of one seed
        keys = [k for k in next(iter(first.values())) if k != "worst_spread_skill_field"]
        windows = list(first)
        summary[name] = {
            w: {k: spread([s[w][k] for s in seeds_of.values()]) for k in keys} for w in windows
        }
    return {"members": members, "seeds": list(seeds), "per_seed": per_seed, "summary": summary}


def table(result: Mapping[str, Any]) -> str:
    """The means over seeds as a text table, one block per dataset."""
    cols = ("spread_skill", "crps", "rank_max_over_flat", "vrmse_ensemble_mean",
            "vrmse_deterministic", "vrmse_persistence")  # fmt: skip
    heads = ("spread/skill", "CRPS", "rank max/flat", "VRMSE mean", "VRMSE det.", "VRMSE persist.")
    lines = []
    for name, windows in result["summary"].items():
        lines.append(f"{name}: {result['members']} members, seeds {result['seeds']}")
        lines.append("steps  " + "  ".join(f"{h:>14}" for h in heads))
        for w, row in windows.items():
            cells = [row[c]["mean"] for c in cols]
            lines.append(
                f"{w:>5}  "
                + "  ".join("n/a".rjust(14) if v is None else f"{v:14.4g}" for v in cells)
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point; a bad checkpoint or option exits 2 with a one-line message."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a walrus checkpoint (or hf:// URL)")
    parser.add_argument("--members", type=int, default=8, help="ensemble size (default 8)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="rollout steps (default: all)")
    parser.add_argument(
        "--name", default=None, help="results file suffix (default: checkpoint stem)"
    )
    parser.add_argument("overrides", nargs="*", help="infer.py overrides for both rollouts")
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options
    record = run_record(sys.argv if argv is None else ["benchmarks.ensemble", *argv])
    overrides = [*args.overrides, *([f"steps={args.steps}"] if args.steps else [])]
    try:
        result = run(args.ckpt, args.members, args.seeds, overrides)
    except (OSError, ValueError) as e:
        print(f"benchmarks.ensemble: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(table(result))
    name = args.name or Path(args.ckpt).stem
    print(f"wrote {save_result(f'ensemble_{name}', {**result, 'record': finish_record(record)})}")


if __name__ == "__main__":
    main()
