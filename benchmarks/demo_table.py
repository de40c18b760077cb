"""The demo's rollout table: windowed VRMSE of the model against its references, per window.

``python -m benchmarks.demo_table [--from RUN/rollout/metrics.json] [--write]``

``--from`` first copies a ``make demo`` rollout's ``metrics.json`` to
``benchmarks/results/demo_metrics.json``. The table (mean over fields: model, persistence,
the spatial mean of each true frame where the file has it, and the model's worst field) is
printed; with ``--write`` it replaces the ``demo-table`` block on README.md and on
``docs/results.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR
from benchmarks.pages import README, RESULTS_PAGE, write_between
from walrus.atomic import write_text_atomic

DEMO_METRICS = RESULTS_DIR / "demo_metrics.json"
MARKER = "demo-table"


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def render(report: Mapping[str, Any]) -> str:
    """The Markdown table of the first dataset of an ``infer.py rollout`` ``metrics.json``."""
    name, entry = next(iter(report["datasets"].items()))
    m = entry["metrics"]
    labels = list(m["windows"])
    refs = [s for s in ("persistence", "spatial_mean") if s in m]
    head = ["steps", "model", *(s.replace("_", " ") for s in refs), "worst field (model)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fields = m["fields_in_mean"]
    for w in labels:
        cells = [w, _fmt(m["model"]["vrmse"]["mean_over_fields"]["windows"][w])]
        cells += [_fmt(m[s]["vrmse"]["mean_over_fields"]["windows"][w]) for s in refs]
        per_field = {f: m["model"]["vrmse"]["windows"][f][w] for f in fields}
        scored = {f: v for f, v in per_field.items() if v is not None}
        worst = max(scored, key=scored.__getitem__) if scored else None
        cells.append(f"{worst} {_fmt(scored[worst])}" if worst else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    n = len(entry["trajectories"])
    lines.append("")
    lines.append(
        f"VRMSE, {name}, {report['split']} split, {n} trajectories, {m['steps']} steps, mean over "
        f"{', '.join(fields)}; `benchmarks/results/{DEMO_METRICS.name}`."
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point; a missing or malformed file exits 2 with a one-line message."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path, help="a rollout's metrics.json")
    parser.add_argument("--write", action="store_true", help="update README.md and the docs")
    args = parser.parse_args(argv)
    try:
        if args.source is not None:
            write_text_atomic(DEMO_METRICS, args.source.read_text())
        table = render(json.loads(DEMO_METRICS.read_text()))
        print(table)
        if args.write:
            for page in (README, RESULTS_PAGE):
                print(f"wrote {write_between(page, MARKER, table)}")
    except (OSError, ValueError) as e:
        print(f"benchmarks.demo_table: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (KeyError, StopIteration, TypeError) as e:
        print(f"benchmarks.demo_table: not a rollout metrics.json ({e!r})", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
