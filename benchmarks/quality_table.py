"""Render the quality and model-sweep JSON as the docs' Markdown tables.

``python -m benchmarks.quality_table [FILE ...] [--sweep FILE] [--write]``

- Quality files (default: every ``benchmarks/results/quality*.json``): one row per budget,
  dataset and model with the steps and CPU seconds training used, the one-step VRMSE and the
  windowed rollout VRMSE (mean over fields). Files written by ``benchmarks.quality`` with seeds
  (``format: quality/2``) show ``mean ± std`` over seeds and the ratios of the means of ours,
  without and with inference jitter (``infer.py``'s default), to the FNO's and to
  persistence's, naming the candidate of ours chosen on validation unless it is
  ``quickstart``; older single-seed files show plain values and ours / FNO.
- The sweep files (default ``benchmarks/results/model_sweep*.json``): one table each, one row
  per candidate, ranked as ``benchmarks.model_sweep`` ranks them.

Without ``--write`` the tables are printed. With it, the text between
``<!-- quality-table:start -->`` and ``<!-- quality-table:end -->`` on ``docs/results.md`` (and
between the ``sweep-table`` markers on ``docs/studies.md``, when a sweep file is rendered) is
replaced, so the pages' numbers come from the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR
from benchmarks.model_sweep import ranking
from benchmarks.pages import RESULTS_PAGE, STUDIES_PAGE, write_between

WINDOWS = ("1", "2-10", "11-30", "31-60", "61+")
HEAD = [
    "budget",
    "data",
    "model",
    "steps / CPU-s",
    "one-step",
    "1",
    "2–10",
    "11–30",
    "31–60",
    "61+",
]


def _fmt(v: Any) -> str:
    return "–" if v is None else f"{v:.3g}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def rows(data: Mapping[str, Any]) -> list[list[str]]:
    """Markdown cells per budget / dataset / model (mean over fields), and ratio rows."""
    if data.get("format") == "quality/2":
        return _seeded_rows(data)
    out = []
    for run in data["runs"]:
        models = run["models"]
        name = Path(run["dataset"]).name
        for model in ("ours", "fno", "persistence"):
            if model not in models:
                continue
            m = models[model]
            train = m.get("train", {})
            used = f"{train['steps']} / {train['cpu_s']:.0f}" if train else ""
            cells = [_fmt(m["one_step"]["mean"])] + [
                _fmt(m["rollout"]["mean"].get(w)) for w in WINDOWS
            ]
            out.append([run["budget"]["label"], name, model, used, *cells])
        if "ours" in models and "fno" in models:
            a, b = models["ours"], models["fno"]
            ratio = [_ratio(a["one_step"]["mean"], b["one_step"]["mean"])]
            for w in WINDOWS:
                ratio.append(_ratio(a["rollout"]["mean"].get(w), b["rollout"]["mean"].get(w)))
            out.append([run["budget"]["label"], name, "**ours / fno**", "", *map(_fmt, ratio)])
    return out


def _seeded_rows(data: Mapping[str, Any]) -> list[list[str]]:
    """Rows of a ``quality/2`` file: ``mean ± std`` over seeds, ratios of means."""

    def cell(st: Mapping[str, Any] | None) -> str:
        if st is None or st["mean"] is None:
            return "–"
        return f"{st['mean']:.3g} ± {st['std']:.2g}" if st["n"] > 1 else f"{st['mean']:.3g}"

    def means(st: Mapping[str, Any]) -> list[float | None]:
        return [st["one_step"]["mean"], *(st["rollout"].get(w, {}).get("mean") for w in WINDOWS)]

    out = []
    for run in data["runs"]:
        head = [run["budget"]["label"], Path(run["dataset"]).name]
        models = run["models"]
        for model, res in models.items():
            st = res["stats"]
            trained = [s["train"] for s in res["per_seed"] if "train" in s]
            used = ""
            if trained:
                steps = sum(t["steps"] for t in trained) / len(trained)
                cpu = sum(t["cpu_s"] for t in trained) / len(trained)
                used = f"{steps:.0f} / {cpu:.0f}"
            label = model
            chosen_ours = run.get("selection", {}).get("ours", {}).get("chosen", "quickstart")
            if model.startswith("ours") and chosen_ours != "quickstart":
                label = f"{model} ({chosen_ours})"
            if model == "fno":
                chosen = run["selection"]["fno"]["chosen"].removeprefix("fno")
                label = "fno, width " + chosen.replace("_noise", ", noise ")
            cells = [cell(st["one_step"]), *(cell(st["rollout"].get(w)) for w in WINDOWS)]
            out.append([*head, label, used, *cells])
        for mine in ("ours", "ours+jitter"):
            for other in ("fno", "persistence"):
                if mine in models and other in models:
                    ours, ref = means(models[mine]["stats"]), means(models[other]["stats"])
                    cells = [_fmt(_ratio(a, b)) for a, b in zip(ours, ref)]
                    out.append([*head, f"**{mine} / {other}**", "", *cells])
    return out


def machine(data: Mapping[str, Any]) -> str:
    """The CPU a result file was measured on: model (when recorded), vector capability, threads."""
    env = data.get("environment") or {}
    cpu = " ".join(str(env[k]) for k in ("cpu_model", "cpu_capability") if env.get(k))
    threads = env.get("threads")
    return (cpu or "CPU not recorded") + (f", {threads} thread(s)" if threads else "")


def markdown(files: Sequence[Path]) -> str:
    """The quality table of ``files``, then the machine each file was measured on."""
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    machines = []
    for path in files:
        data = json.loads(Path(path).read_text())
        for cells in rows(data):
            lines.append("| " + " | ".join(cells) + " |")
        machines.append(f"`{Path(path).name}`: {machine(data)}")
    lines.append("\nMeasured on (equal CPU seconds buy different steps on different CPUs): ")
    lines[-1] += "; ".join(machines) + "."
    return "\n".join(lines)


def sweep_markdown(data: Mapping[str, Any]) -> str:
    """The sweep's ranking as a Markdown table, with its budget and split."""
    ranked = ranking(data["runs"])
    if not ranked:
        return f"(no finished runs in the sweep at {data['budget']['label']})"
    cols = list(ranked[0])
    datasets = ", ".join(sorted({str(r["dataset"]) for r in data["runs"]}))
    lines = [
        f"{datasets}: budget {data['budget']['label']} per run, scored on the {data['split']} split.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in ranked:
        cells = [
            v if isinstance(v, str) else str(v) if isinstance(v, int) else _fmt(v)
            for v in r.values()
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_pages(
    quality: Sequence[Path],
    sweep: Path | Sequence[Path] | None = None,
    results_page: Path = RESULTS_PAGE,
    studies_page: Path = STUDIES_PAGE,
) -> list[Path]:
    """Replace the quality table on ``results_page`` and, given ``sweep`` (one sweep file or
    several, one table each), the sweep tables on ``studies_page``, from the JSON."""
    written = [write_between(results_page, "quality-table", markdown(quality))]
    sweeps = [sweep] if isinstance(sweep, Path) else list(sweep or [])
    if sweeps:
        body = "\n\n".join(sweep_markdown(json.loads(p.read_text())) for p in sweeps)
        written.append(write_between(studies_page, "sweep-table", body))
    return written


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point; a missing file or marker exits 2 with a one-line message."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="quality JSON files")
    parser.add_argument(
        "--sweep", type=Path, action="append", help="model sweep JSON (repeat for several)"
    )
    parser.add_argument(
        "--write", action="store_true", help="update the tables on docs/results.md, docs/studies.md"
    )
    args = parser.parse_args(argv)
    files = args.files or sorted(RESULTS_DIR.glob("quality*.json"))
    sweep = args.sweep or sorted(RESULTS_DIR.glob("model_sweep*.json"))
    try:
        if args.write:
            for page in write_pages(files, sweep):
                print(f"wrote {page}")
            return
        print(markdown(files))
        for path in sweep:
            print()
            print(sweep_markdown(json.loads(path.read_text())))
    except (OSError, ValueError) as e:
        print(f"benchmarks.quality_table: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyError as e:
        print(f"benchmarks.quality_table: a result file lacks the field {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
