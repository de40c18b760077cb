"""Render ``benchmarks/results/quality*.json`` as the Markdown table in the README.

``python -m benchmarks.quality_table [FILE ...]`` (default: every ``quality*.json`` result).
Rows: one per budget, dataset and model (mean over fields), with the one-step VRMSE, the
windowed rollout VRMSE, and the steps and CPU seconds training used; plus ours/FNO ratios.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR


def _fmt(v: Any) -> str:
    return "–" if v is None else f"{v:.3g}"


def rows(data: dict[str, Any]) -> list[list[str]]:
    """Markdown cells per budget / dataset / model, and an ``ours / fno`` ratio row."""
    out = []
    for run in data["runs"]:
        wins = run["windows"]
        models = run["models"]
        name = Path(run["dataset"]).name
        for model in ("ours", "fno", "persistence"):
            if model not in models:
                continue
            m = models[model]
            train = m.get("train", {})
            used = f"{train['steps']} / {train['cpu_s']:.0f}" if train else ""
            cells = [_fmt(m["one_step"]["mean"])] + [
                _fmt(m["rollout"]["mean"].get(w)) for w in wins
            ]
            out.append([run["budget"]["label"], name, model, used, *cells])
        if "ours" in models and "fno" in models:
            a, b = models["ours"], models["fno"]
            ratio = [a["one_step"]["mean"] / b["one_step"]["mean"]]
            for w in wins:
                x, y = a["rollout"]["mean"].get(w), b["rollout"]["mean"].get(w)
                ratio.append(None if x is None or not y else x / y)
            out.append([run["budget"]["label"], name, "**ours / fno**", "", *map(_fmt, ratio)])
    return out


def markdown(files: list[Path]) -> str:
    head = [
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
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for path in files:
        for cells in rows(json.loads(path.read_text())):
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args()
    files = args.files or sorted(RESULTS_DIR.glob("quality*.json"))
    print(markdown(files))


if __name__ == "__main__":
    main()
