"""Summary and docs table of ``benchmarks.transfer`` results: mean and spread over seeds of
each measure in each rollout window, and the fine-tuned / scratch VRMSE ratios."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import BenchmarkError
from walrus.atomic import write_text_atomic

MEASURES = ("vrmse", "amplitude_ratio", "change_correlation")
START, END = "<!-- transfer-table:start -->", "<!-- transfer-table:end -->"


def markers(name: str = "transfer") -> tuple[str, str]:
    """Page markers of the table of results file ``name`` (``transfer``: the plain ones)."""
    if name == "transfer":
        return START, END
    return f"<!-- transfer-table:start:{name} -->", f"<!-- transfer-table:end:{name} -->"


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean and sample standard deviation of the finite ``values`` (``None`` when there are none)."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    mean = statistics.fmean(v) if v else None
    return {"mean": mean, "std": statistics.stdev(v) if len(v) > 1 else None, "n": len(v)}


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per held-out set and model: mean and spread over seeds of each measure in each window,
    and for every F the fine-tuned / scratch ratio of the seed means of VRMSE."""
    out: dict[str, Any] = {}
    for held in dict.fromkeys(r["held_out"] for r in runs):
        mine = [r for r in runs if r["held_out"] == held]
        models: dict[str, Any] = {}
        for label in dict.fromkeys(k for r in mine for k in r["models"]):
            tests = [r["models"][label]["test"]["model"] for r in mine if label in r["models"]]
            models[label] = {
                k: {w: spread([t[k].get(w) for t in tests]) for w in tests[0][k]} for k in MEASURES
            }
        ratios = {}
        for label in models:
            if label.startswith("finetune ") and f"scratch {label[9:]}" in models:
                ft, sc = models[label]["vrmse"], models[f"scratch {label[9:]}"]["vrmse"]
                ratios[label[9:]] = {
                    w: ft[w]["mean"] / sc[w]["mean"]
                    if ft[w]["mean"] is not None and sc[w]["mean"]
                    else None
                    for w in ft
                }
        seeds = [r["seed"] for r in mine]
        out[held] = {"seeds": seeds, "models": models, "ft_over_scratch": ratios}
    return out


def _cell(s: Mapping[str, Any] | None) -> str:
    if not s or s["mean"] is None:
        return "n/a"
    return f"{s['mean']:.3g}" + (f" ± {s['std']:.2g}" if s["std"] is not None else "")


def render_table(data: Mapping[str, Any]) -> str:
    """Markdown table of the summary: windowed test VRMSE (mean ± std over seeds), the amplitude
    ratio and change correlation in the last window, and the fine-tuned / scratch ratios."""
    summary = data.get("summary") or {}
    windows = list(
        dict.fromkeys(w for s in summary.values() for m in s["models"].values() for w in m["vrmse"])
    )
    head = ["held out", "model", *(f"VRMSE {w}" for w in windows), "amplitude", "change corr"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for held, s in summary.items():
        for label, m in s["models"].items():
            last = next((w for w in reversed(windows) if w in m["vrmse"]), None)
            cells = [_cell(m["vrmse"].get(w)) for w in windows]
            fid = [_cell(m[k].get(last)) for k in ("amplitude_ratio", "change_correlation")]
            lines.append("| " + " | ".join([held, label, *cells, *fid]) + " |")
        for f, r in s["ft_over_scratch"].items():
            cells = [f"{r[w]:.2f}" if r.get(w) is not None else "n/a" for w in windows]
            lines.append(
                "| " + " | ".join([held, f"fine-tuned / scratch, {f} steps", *cells, "", ""]) + " |"
            )
    rec, args = data.get("record", {}), data.get("args", {})
    steps = [
        r["pretrain"]["steps"] for r in data.get("runs", []) if "steps" in r.get("pretrain", {})
    ]
    pool = str(args.get("systems", "")).replace(",", ", ")
    lines.append(
        f"\nSeeds {args.get('seeds')}; {args.get('pretrain_time')} s of pretraining per held-out "
        f"set and seed on {pool or 'n/a'} (less the held-out system)"
        + (f", {min(steps)}-{max(steps)} steps" if steps else "")
        + f"; commit {rec.get('commit')}{' (dirty)' if rec.get('dirty') else ''}, "
        f"started {rec.get('started')}. Amplitude, change correlation: last window; 1 is ideal."
    )
    return "\n".join(lines)


def render_page(page: Path, data: Mapping[str, Any], name: str = "transfer") -> Path:
    """Replace the text between the markers of results file ``name`` on ``page`` (see
    :func:`markers`) with its table."""
    start, end = markers(name)
    text = page.read_text()
    if start not in text or end not in text or text.index(start) > text.index(end):
        raise BenchmarkError(f"{page}: no {start} ... {end} markers to put the table between")
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    return write_text_atomic(page, f"{head}{start}\n{render_table(data)}\n{end}{tail}")
