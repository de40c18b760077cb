"""Render the quality and model-sweep JSON as the docs' Markdown tables.

``python -m benchmarks.quality_table [FILE ...] [--sweep FILE] [--write]``

- The quality protocol's newest version (``benchmarks/results/quality_v<N>/``, written by
  ``benchmarks.quality_protocol``): its full table on ``docs/results.md`` and one headline
  table in ``README.md`` (per cell and window, the ratio of 3-seed means of ours+jitter to the
  better tuned baseline, the per-seed range and the pass rule), each stating the version, its
  commit and how many versions came before. Older versions are not rendered.
- Quality files (default: every ``benchmarks/results/quality*.json``): one row per budget,
  dataset and model with the steps and CPU seconds training used, the one-step VRMSE and the
  windowed rollout VRMSE (mean over fields). Files written by ``benchmarks.quality`` with seeds
  (``format: quality/2``) show ``mean ± std`` over seeds and the ratios of the means of ours,
  without and with inference jitter (``infer.py``'s default), to the FNO's and to
  persistence's, naming the candidate of ours chosen on validation unless it is
  ``quickstart``, and the VRMSE of predicting each frame's spatial mean where the file has it;
  older single-seed files show plain values and ours / FNO. These top-level files predate the
  protocol and are rendered as superseded.
- The sweep files (default ``benchmarks/results/model_sweep*.json``): one table each, one row
  per candidate, ranked as ``benchmarks.model_sweep`` ranks them.

Without ``--write`` the tables are printed. With it, the text between
``<!-- quality-table:start -->`` and ``<!-- quality-table:end -->`` on ``docs/results.md`` (the
``quality-protocol`` markers there and the ``quality-headline`` markers in ``README.md`` for
the protocol; the ``sweep-table`` markers on ``docs/studies.md``, when a sweep file is
rendered) is replaced, so the pages' numbers come from the JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import quality_protocol as protocol
from benchmarks.common import RESULTS_DIR
from benchmarks.model_sweep import ranking
from benchmarks.pages import README, RESULTS_PAGE, STUDIES_PAGE, write_between
from benchmarks.record import portable_path

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


def _label(run: Mapping[str, Any], model: str) -> str:
    """``model``, with the candidate chosen on validation where there was a choice."""
    chosen = run.get("selection", {}).get(model.split("+")[0], {}).get("chosen")
    if model == "fno" and chosen and re.fullmatch(r"fno\d+_noise.*", chosen):
        return "fno, width " + chosen.removeprefix("fno").replace("_noise", ", noise ")
    return f"{model} ({chosen})" if chosen and chosen != "quickstart" else model


def _seeded_rows(data: Mapping[str, Any]) -> list[list[str]]:
    """Rows of a ``quality/2`` file: ``mean ± std`` over seeds, the spatial mean's VRMSE (the
    reference VRMSE 1 stands for) where recorded, ratios of means."""

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
            cells = [cell(st["one_step"]), *(cell(st["rollout"].get(w)) for w in WINDOWS)]
            out.append([*head, _label(run, model), used, *cells])
        if "spatial_mean" in run:
            flat = run["spatial_mean"]["mean"]
            cells = ["–" if flat.get(w) is None else f"{flat[w]:.4g}" for w in WINDOWS]
            out.append([*head, "spatial mean", "", "–", *cells])  # 4 digits: just under 1
        for mine in ("ours", "ours+jitter"):
            for other in (m for m in models if m not in ("ours", "ours+jitter")):
                if mine in models:
                    ours, ref = means(models[mine]["stats"]), means(models[other]["stats"])
                    cells = [_fmt(_ratio(a, b)) for a, b in zip(ours, ref)]
                    out.append([*head, f"**{mine} / {other}**", "", *cells])
    return out


def machine(data: Mapping[str, Any]) -> str:
    """The CPU a result file was measured on: model (when recorded), vector capability, threads;
    the run record's (read when the run started) before the one written at save time."""
    env = {**(data.get("environment") or {}), **(data.get("record") or {})}  # start's first
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


PROTOCOL_DOC = "quality_protocol.md"  # docs/, where the protocol is written down


def version_line(results_dir: Path = RESULTS_DIR, link: str = PROTOCOL_DOC) -> str:
    """Which version of the protocol the tables show: its number, commit, start, CPU, how many
    cells it holds and how many versions came before (or that none has run yet)."""
    found = protocol.versions(results_dir)
    if not found:
        return (
            f"No version of the [quality protocol]({link}) has run yet: `make benchmark-quality` "
            "runs one (hours: about two days on one core)."
        )
    n, path = found[-1]
    rec = protocol.manifest(path).get("record", {})
    commit = (rec.get("commit") or "unknown")[:7]
    dirty = ", uncommitted changes" if rec.get("dirty") else ""
    cpu = rec.get("cpu_model") or "CPU not recorded"
    done, total = len(protocol.done_cells(path)), len(protocol.cells())
    earlier = len(found) - 1
    return (
        f"Version {n} of the [quality protocol]({link}) (`{portable_path(path)}`): "
        f"commit `{commit}`{dirty}, started {rec.get('started', 'unknown')}, {cpu}; "
        f"{done} of {total} cells run; {earlier} earlier version{'s' if earlier != 1 else ''}."
    )


def _cell_files(results_dir: Path) -> list[Path]:
    found = protocol.versions(results_dir)
    if not found:
        return []
    path = found[-1][1]
    return [path / f"{name}.json" for name in protocol.done_cells(path)]


def protocol_markdown(results_dir: Path = RESULTS_DIR, link: str = PROTOCOL_DOC) -> str:
    """The newest version's full table (every model, the spatial mean, the ratios)."""
    files = _cell_files(results_dir)
    line = version_line(results_dir, link)
    return f"{line}\n\n{markdown(files)}" if files else line


def headline_markdown(results_dir: Path = RESULTS_DIR, link: str = PROTOCOL_DOC) -> str:
    """One row per cell of the newest version: per window the ratio of 3-seed means of
    ``protocol.RULE_MODEL`` to the better baseline, its per-seed range, and the pass rule."""
    files = _cell_files(results_dir)
    line = version_line(results_dir, link)
    if not files:
        return line
    rule = f"≤ {protocol.MEAN_MAX:g}, every seed ≤ {protocol.SEED_MAX:g}"
    head = ["budget", "data", *(w.replace("-", "–") for w in protocol.WINDOWS), rule]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    passed = 0
    for path in files:
        for run in json.loads(path.read_text())["runs"]:
            v = protocol.verdict(run)
            passed += v["pass"]
            cells = []
            for w in protocol.WINDOWS:
                r = v["windows"].get(w)
                if r is None:
                    cells.append("n/a")  # the rollout does not reach this window
                    continue
                seeds = [x for x in r["seed_ratios"] if x is not None]
                span = f"{min(seeds):.2f}–{max(seeds):.2f}, " if seeds else ""
                cells.append(
                    "–" if r["ratio"] is None else f"{r['ratio']:.2f} ({span}{r['baseline']})"
                )
            label = [run["budget"]["label"], Path(run["dataset"]).name]
            lines.append(
                "| " + " | ".join([*label, *cells, "yes" if v["pass"] else "**no**"]) + " |"
            )
    return "\n".join(
        [
            line,
            "",
            *lines,
            "",
            f"Ratio of 3-seed mean test VRMSE (mean over fields), {protocol.RULE_MODEL} over the "
            "better tuned baseline in each window; in brackets the range of the per-seed ratios "
            f"and that baseline. {passed} of {len(lines) - 2} cells pass.",
        ]
    )


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
    """Replace the (superseded) quality table on ``results_page`` and, given ``sweep`` (one
    sweep file or several, one table each), the sweep tables on ``studies_page``, from the JSON."""
    written = [write_between(results_page, "quality-table", markdown(quality))]
    sweeps = [sweep] if isinstance(sweep, Path) else list(sweep or [])
    if sweeps:
        body = "\n\n".join(sweep_markdown(json.loads(p.read_text())) for p in sweeps)
        written.append(write_between(studies_page, "sweep-table", body))
    return written


def write_protocol(
    results_page: Path = RESULTS_PAGE, readme: Path = README, results_dir: Path = RESULTS_DIR
) -> list[Path]:
    """Replace the protocol's table on ``results_page`` and its headline in ``readme`` with the
    newest version under ``results_dir``."""
    link = f"docs/{PROTOCOL_DOC}"
    return [
        write_between(results_page, "quality-protocol", protocol_markdown(results_dir)),
        write_between(readme, "quality-headline", headline_markdown(results_dir, link)),
    ]


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point; a missing file or marker exits 2 with a one-line message."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "files", nargs="*", type=Path, help="superseded quality JSON files (before the protocol)"
    )
    parser.add_argument(
        "--sweep", type=Path, action="append", help="model sweep JSON (repeat for several)"
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="update the tables on docs/results.md, docs/studies.md and README.md",
    )
    args = parser.parse_args(argv)
    files = args.files or sorted(RESULTS_DIR.glob("quality*.json"))
    sweep = args.sweep or sorted(RESULTS_DIR.glob("model_sweep*.json"))
    try:
        if args.write:
            for page in [*write_protocol(), *write_pages(files, sweep)]:
                print(f"wrote {page}")
            return
        print(headline_markdown())
        print()
        print(protocol_markdown())
        print()
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
