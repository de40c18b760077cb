"""Settings for `make demo-quick` chosen on validation: each candidate runs the demo's whole
pipeline (generate ``navier_stokes_2d``, ``train.py experiment=quickstart``, ``infer.py rollout``
with plots and predictions) with its own generator flags and train overrides, rolled out on the
VALIDATION split (the same size as the test split `make demo` rolls out; the test split is never
read). Per candidate the JSON keeps the CPU seconds (user + system, of the child processes) of
each stage, the wall seconds, and the windowed rollout VRMSE (mean over fields) of the model and
of persistence, and whether the model wins every window; ``chosen`` names the candidate
:func:`choose` picks (the 3-minute budget is judged on CPU seconds, which a machine shared with
other jobs inflates less than wall seconds)::

    python -m benchmarks.studies.demo_quick_sweep --work-dir outputs/demo_quick_sweep \\
        --candidate 'r32=--resolution 32 | trainer.max_steps=300' --candidate ...

A candidate is ``NAME=GENERATOR FLAGS | TRAIN OVERRIDES``. Candidates run one after another;
``benchmarks/results/<--name>.json`` is rewritten after each, and ``--resume`` skips candidates it
already holds. ``--write`` only renders the JSON's table onto ``docs/getting-started.md`` between
``<!-- demo-quick-sweep:start -->`` and ``<!-- demo-quick-sweep:end -->``.
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, print_table
from benchmarks.pages import DOCS, write_between
from benchmarks.record import finish_record, run_record, save_result

FORMAT = "demo_quick_sweep/1"
PAGE = DOCS / "getting-started.md"
BUDGET_CPU_S = 180.0  # 3 minutes: within it even if the two cores' threads never overlap
DATASET = "navier_stokes_2d"
REPO = Path(__file__).resolve().parents[2]


def parse_candidate(text: str) -> tuple[str, list[str], list[str]]:
    """``NAME=GENERATOR FLAGS | TRAIN OVERRIDES`` as (name, generator args, train overrides)."""
    name, sep, rest = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=GENERATOR FLAGS | OVERRIDES")
    data, _, train = rest.partition("|")
    return name.strip(), shlex.split(data), shlex.split(train)


def windows(metrics_json: Path) -> dict[str, dict[str, float]]:
    """Windowed rollout VRMSE, mean over fields, of the model and persistence."""
    metrics = json.loads(metrics_json.read_text())["datasets"][DATASET]["metrics"]
    return {
        source: dict(metrics[source]["vrmse"]["mean_over_fields"]["windows"])
        for source in ("model", "persistence")
    }


def beats_persistence(vrmse: dict[str, dict[str, float]]) -> bool:
    """True when the model's VRMSE is below persistence's in every window."""
    return all(v < vrmse["persistence"][w] for w, v in vrmse["model"].items())


def choose(candidates: dict[str, Any], budget_cpu_s: float = BUDGET_CPU_S) -> str | None:
    """The candidate within ``budget_cpu_s`` that beats persistence in every window with the
    lowest mean ratio of model to persistence VRMSE over the windows (``None``: none does)."""

    def ratio(c: dict[str, Any]) -> float:
        model, persistence = c["vrmse"]["model"], c["vrmse"]["persistence"]
        return sum(v / persistence[w] for w, v in model.items()) / len(model)

    fit = {
        name: ratio(c)
        for name, c in candidates.items()
        if c["beats_persistence_every_window"] and c["cpu_s"]["total"] <= budget_cpu_s
    }
    return min(fit, key=fit.__getitem__) if fit else None


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(cmd: list[str], log: Path) -> tuple[float, float]:
    """Run ``cmd`` from the repository root, output to ``log``: (CPU seconds, wall seconds)."""
    cpu, start = _cpu_children(), time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}); see {log}")
    return _cpu_children() - cpu, time.perf_counter() - start


def run_candidate(work: Path, data_args: list[str], overrides: list[str]) -> dict[str, Any]:
    """The demo pipeline in ``work`` (data, run, valid rollout): CPU/wall seconds and VRMSE."""
    py, data, run = sys.executable, work / "data", work / "run"
    run.mkdir(parents=True, exist_ok=True)
    stages = {
        "generate": [py, "-m", "walrus.data.synthetic", DATASET, "--out", str(data), *data_args],
        "train": [py, "train.py", "experiment=quickstart", f"paths.data_dir={data}",
                  f"hydra.run.dir={run}", *overrides],
        "rollout": [py, "infer.py", "rollout", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
                    "split=valid", f"out={run / 'rollout'}", "overwrite=true"],
    }  # fmt: skip
    cpu: dict[str, float] = {}
    wall: dict[str, float] = {}
    for stage, cmd in stages.items():
        cpu[stage], wall[stage] = _run(cmd, work / f"{stage}.out")
    vrmse = windows(run / "rollout" / "metrics.json")
    return {
        "cpu_s": {**cpu, "total": sum(cpu.values())},
        "wall_s": {**wall, "total": sum(wall.values())},
        "vrmse": vrmse,
        "beats_persistence_every_window": beats_persistence(vrmse),
    }


def table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per candidate: CPU seconds, and model / persistence VRMSE per window."""
    rows = []
    for name, r in result["candidates"].items():
        row: dict[str, Any] = {"candidate": name, "cpu_s": r["cpu_s"]["total"]}
        for w, v in r["vrmse"]["model"].items():
            row[w] = f"{v:.3g}/{r['vrmse']['persistence'][w]:.3g}"
        row["wins all"] = r["beats_persistence_every_window"]
        rows.append(row)
    return rows


def markdown(result: dict[str, Any]) -> str:
    """The docs table: per candidate its settings, CPU seconds, and model / persistence VRMSE
    per window (the chosen one in bold)."""
    cands = result["candidates"]
    wins = list(next(iter(cands.values()))["vrmse"]["model"]) if cands else []
    lines = [
        "| candidate | generator flags | train overrides | CPU s | "
        + " | ".join(f"VRMSE {w}" for w in wins)
        + " | wins every window |",
        "|" + "---|" * (5 + len(wins)),
    ]
    for name, c in cands.items():
        shown = f"**{name}**" if name == result.get("chosen") else name
        cells = [shown, f"`{' '.join(c['generator_args'])}`", f"`{' '.join(c['train_overrides'])}`",
                 f"{c['cpu_s']['total']:.0f}"]  # fmt: skip
        cells += [
            f"{c['vrmse']['model'][w]:.3g} / {c['vrmse']['persistence'][w]:.3g}" for w in wins
        ]
        cells.append("yes" if c["beats_persistence_every_window"] else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="outputs/demo_quick_sweep", help="run folders")
    parser.add_argument("--candidate", action="append", default=[], type=parse_candidate)
    parser.add_argument("--name", default="demo_quick_sweep", help="results file stem")
    parser.add_argument("--resume", action="store_true", help="skip candidates in the JSON")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR), help="where the JSON goes")
    parser.add_argument("--write", action="store_true", help="only render the docs table")
    args = parser.parse_args(argv)
    path = Path(args.results_dir) / f"{args.name}.json"
    if args.write:
        body = markdown(json.loads(path.read_text()))
        print(f"wrote {write_between(PAGE, 'demo-quick-sweep', body)}")
        return
    record = run_record(sys.argv)
    result = json.loads(path.read_text()) if args.resume and path.is_file() else None
    if result is None or result.get("format") != FORMAT:
        result = {"format": FORMAT, "split": "valid", "records": [], "candidates": {}}
    earlier = list(result["records"])
    work = Path(args.work_dir).resolve()

    def save() -> None:
        result["budget_cpu_s"] = BUDGET_CPU_S
        result["chosen"] = choose(result["candidates"])
        result["records"] = [*earlier, finish_record(record)]
        save_result(args.name, result, args.results_dir)

    for name, data_args, overrides in args.candidate:
        if name in result["candidates"]:
            continue
        result["candidates"][name] = {
            "generator_args": data_args,
            "train_overrides": overrides,
            **run_candidate(work / name, data_args, overrides),
        }
        save()
    save()
    print_table(table(result))
    print(f"chosen: {result['chosen']}")


if __name__ == "__main__":
    main()
