"""The demo's recipe judged on validation: training candidates x seeds x inference settings.

Each candidate is a list of Hydra overrides applied after ``experiment=quickstart``; it is
trained exactly as ``make demo`` trains (``train.py``, the whole quickstart schedule on the
built-in ``navier_stokes_2d``) once per seed, and its ``last.ckpt`` is rolled out over the
VALIDATION split by ``infer.py rollout`` once per ``--jitter-average`` K (``--rollout-data-dir``
rolls out on another root's validation split, e.g. 16 trajectories generated with another seed,
reusing the checkpoints). The test split is never read. Per run the JSON keeps the windowed
means over fields of rollout VRMSE, amplitude ratio (with its smallest and largest step), change
correlation and high-wavenumber power ratio, and the wall time; the printed table averages them
over seeds::

    python -m benchmarks.studies.demo_sweep --data-dir data --seeds 0,1 \\
        --candidate base= --candidate overlap=+model.decoder_overlap=true --jitter-average 1,4

``benchmarks/results/<--name>.json`` is rewritten after every rollout; ``--resume`` skips what it
holds (a run folder that already holds ``last.ckpt`` is rolled out, not retrained).
``--write`` only renders the JSON's table onto ``docs/studies.md`` between
``<!-- demo-sweep:start -->`` and ``<!-- demo-sweep:end -->``. Runs go one after another; ``--threads`` sets each process's torch threads (run two
sweeps side by side with ``--threads 1`` on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, print_table
from benchmarks.pages import STUDIES_PAGE, write_between
from benchmarks.quality import parse_candidates
from benchmarks.record import finish_record, run_record, save_result

FORMAT = "demo_sweep/1"
DATASET = "navier_stokes_2d"
MEASURES = {
    "vrmse": "vrmse",
    "amp": "amplitude_ratio",
    "corr": "change_correlation",
    "hik": "power_ratio_high",
}
REPO = Path(__file__).resolve().parents[2]


def summarise(metrics_json: Path) -> dict[str, Any]:
    """Windowed means over fields from an ``infer.py rollout`` metrics.json."""
    metrics = json.loads(metrics_json.read_text())["datasets"][DATASET]["metrics"]["model"]
    out: dict[str, Any] = {}
    for short, key in MEASURES.items():
        mean = metrics[key]["mean_over_fields"]
        for window, value in mean["windows"].items():
            out[f"{short} {window}"] = value
    per_step = metrics["amplitude_ratio"]["mean_over_fields"]["per_step"]
    defined = [v for v in per_step if v is not None]
    out["amp min"], out["amp max"] = min(defined), max(defined)
    return out


def _run(cmd: list[str], log: Path, threads: int) -> float:
    """Run ``cmd`` from the repository root, output to ``log``; wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data-dir", help="parent of navier_stokes_2d/ (made if missing); needed to run"
    )
    parser.add_argument(
        "--rollout-data-dir",
        help="roll out on this data root's validation split instead of --data-dir's (e.g. a "
        "larger validation set: python -m walrus.data.synthetic navier_stokes_2d --out D "
        "--n-traj 1,16,16 --seed 777)",
    )
    parser.add_argument("--work-dir", default="outputs/demo_sweep", help="run folders")
    parser.add_argument("--candidate", action="append", default=[], help="NAME=overrides")
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds")
    parser.add_argument("--jitter-average", default="1,4", help="comma-separated K values")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--name", default="demo_sweep", help="results file stem")
    parser.add_argument("--resume", action="store_true", help="skip runs already in the JSON")
    parser.add_argument("--write", action="store_true", help="only render the docs table")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR), help="where the JSON goes")
    args = parser.parse_args(argv)
    path = Path(args.results_dir) / f"{args.name}.json"
    if args.write:
        body = markdown(json.loads(path.read_text()))
        print(f"wrote {write_between(STUDIES_PAGE, 'demo-sweep', body)}")
        return
    if args.data_dir is None:
        parser.error("--data-dir is required to run candidates")
    try:
        candidates = parse_candidates(";".join(args.candidate)) if args.candidate else {"base": []}
    except argparse.ArgumentTypeError as e:
        parser.error(f"--candidate: {e}")
    seeds = [int(s) for s in args.seeds.split(",")]
    draws = [int(k) for k in args.jitter_average.split(",")]
    record = run_record(sys.argv)
    result = json.loads(path.read_text()) if args.resume and path.is_file() else None
    if result is None or result.get("format") != FORMAT:
        result = {"format": FORMAT, "records": [], "runs": []}
    earlier = list(result["records"])

    def save() -> None:
        result["records"] = [*earlier, finish_record(record)]
        save_result(args.name, result, args.results_dir)

    result["candidates"] = {**result.get("candidates", {}), **candidates}
    done = {(r["candidate"], r["seed"], r["jitter_average"]) for r in result["runs"]}
    py, work = sys.executable, Path(args.work_dir).resolve()
    rollout_data = args.rollout_data_dir or args.data_dir
    result["rollout_data"] = Path(rollout_data).name
    folder = f"valid_{result['rollout_data']}" if args.rollout_data_dir else "valid"
    for name, overrides in candidates.items():
        for seed in seeds:
            run_dir = work / f"{name}-s{seed}"
            ckpt = run_dir / "checkpoints" / "last.ckpt"
            train_s = None
            if any((name, seed, k) not in done for k in draws) and not ckpt.is_file():
                run_dir.mkdir(parents=True, exist_ok=True)
                cmd = [py, "train.py", "experiment=quickstart", f"paths.data_dir={args.data_dir}",
                       f"hydra.run.dir={run_dir}", f"seed={seed}", *overrides]  # fmt: skip
                train_s = _run(cmd, run_dir / "train.out", args.threads)
            for k in draws:
                if (name, seed, k) in done:
                    continue
                out = run_dir / f"{folder}_k{k}"
                cmd = [py, "infer.py", "rollout", f"ckpt_path={ckpt}", "split=valid",
                       f"out={out}", "overwrite=true", f"jitter_average={k}", "plots=false",
                       "save_predictions=false", f"paths.data_dir={rollout_data}"]  # fmt: skip
                infer_s = _run(cmd, run_dir / f"infer_k{k}.out", args.threads)
                result["runs"].append(
                    {
                        "candidate": name,
                        "seed": seed,
                        "jitter_average": k,
                        "train_s": train_s,
                        "infer_s": infer_s,
                        **summarise(out / "metrics.json"),
                    }  # fmt: skip
                )
                save()
    save()
    print_table(table(result))


def table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Mean over seeds per (candidate, K)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in result["runs"]:
        groups.setdefault((r["candidate"], r["jitter_average"]), []).append(r)
    rows = []
    keys = [k for k in result["runs"][0] if k.split(" ")[0] in MEASURES] if result["runs"] else []
    for (name, k), runs in sorted(groups.items()):
        row: dict[str, Any] = {"candidate": name, "K": k, "seeds": len(runs)}
        for key in keys:
            values = [r[key] for r in runs if r.get(key) is not None]
            row[key] = statistics.fmean(values) if values else None
        rows.append(row)
    return rows


# Table columns: (header, key)
TABLE_COLUMNS = [
    ("VRMSE 1", "vrmse 1"), ("2-10", "vrmse 2-10"), ("11-30", "vrmse 11-30"),
    ("31-60", "vrmse 31-60"), ("61-76", "vrmse 61-76"), ("change corr 11-30", "corr 11-30"),
    ("amplitude min", "amp min"), ("amplitude max", "amp max"), ("high-k power 1", "hik 1"),
    ("high-k power 11-30", "hik 11-30"),
]  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    """The docs table: one row per (candidate, K), means over seeds."""
    lines = [
        "| candidate | overrides | jitter_average | seeds | "
        + " | ".join(h for h, _ in TABLE_COLUMNS)
        + " |",
        "|" + "---|" * (4 + len(TABLE_COLUMNS)),
    ]
    for row in table(result):
        overrides = " ".join(result.get("candidates", {}).get(row["candidate"], [])) or "-"
        cells = [row["candidate"], f"`{overrides}`" if overrides != "-" else "-", str(row["K"]),
                 str(row["seeds"])]  # fmt: skip
        for _, key in TABLE_COLUMNS:
            v = row.get(key)
            cells.append("n/a" if v is None else f"{v:.3g}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
