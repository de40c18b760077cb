"""Sample-efficiency results of ``python -m benchmarks.transfer --sample-efficiency``: the pure
parts (the data-efficiency factor, the rate grid's edges), the summary over seeds, the table on
the results page and the headline row in the README.

The benchmark trains fine-tuned and scratch models on the first N trajectories of a held-out set
(``data.train_trajectories=N``) for every N of a grid and scores each on the full test split.
The **data-efficiency factor** of a window is how many trajectories scratch needs to match the
fine-tuned model at the reference N (2), divided by that N: read by log-log interpolation of
scratch's test VRMSE against N, or "more than all" when scratch never gets there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.pages import README, RESULTS_PAGE, write_between
from benchmarks.transfer_table import spread

NAME = "sample_efficiency"  # results file stem
TABLE = "sample-efficiency-table"  # marker on the results page
HEADLINE = "sample-efficiency-headline"  # marker in the README
COMMAND = (
    "python -m benchmarks.transfer --sample-efficiency --pretrain-time 1800 --seeds 0,1,2 "
    "--widen-grid --near data/gray_scott_pypde --page docs/results.md"
)
RENDER = "python -m benchmarks.transfer --sample-efficiency --render-only"
GROUPS = ("2D", "1D", "3D", "near")  # order of the held-out sets in the table


def match_trajectories(
    ns: Sequence[float], scratch: Sequence[float | None], target: float | None
) -> dict[str, Any]:
    """How many trajectories scratch needs to reach VRMSE ``target``.

    Args:
        ns: the trajectory counts trained on, increasing.
        scratch: scratch's VRMSE at each of ``ns`` (``None`` where there is none).
        target: the VRMSE to match (the fine-tuned model's at the reference N).

    Returns:
        ``{"trajectories": n, "bound": b}``. Walking up the N grid, the first N at which scratch
        is at or below ``target``: ``b == "interpolated"`` when scratch crosses it between two
        grid points (log-log interpolation; a curve that is not monotone counts its first
        crossing), ``"at most"`` when scratch is already there at the smallest N (so
        ``n`` is an upper bound), ``"more than all"`` (``n`` is ``None``) when it never is,
        and ``"n/a"`` when there is no target or no scratch value.
    """
    points = [(n, s) for n, s in zip(ns, scratch) if s is not None and math.isfinite(s) and s > 0]
    if target is None or not math.isfinite(target) or target <= 0 or not points:
        return {"trajectories": None, "bound": "n/a"}
    if points[0][1] <= target:
        return {"trajectories": float(points[0][0]), "bound": "at most"}
    for (n0, s0), (n1, s1) in zip(points, points[1:]):
        if s0 > target >= s1:
            frac = (math.log(target) - math.log(s0)) / (math.log(s1) - math.log(s0))
            n = math.exp(math.log(n0) + frac * (math.log(n1) - math.log(n0)))
            return {"trajectories": n, "bound": "interpolated"}
    return {"trajectories": None, "bound": "more than all"}


def efficiency_factor(
    ns: Sequence[float], scratch: Sequence[float | None], finetuned: float | None, reference: int
) -> dict[str, Any]:
    """:func:`match_trajectories` for the fine-tuned VRMSE ``finetuned`` at ``reference``
    trajectories, with ``factor`` = trajectories needed / ``reference`` (``None`` unless a count
    was read)."""
    m = match_trajectories(ns, scratch, finetuned)
    n = m["trajectories"]
    return {**m, "factor": None if n is None else n / reference}


def edge(rate: float, grid: Sequence[float]) -> str | None:
    """``"low"`` or ``"high"`` when ``rate`` is the lowest or highest rate of ``grid`` (a grid of
    one rate is at both edges: ``"low"``); else ``None``."""
    if rate <= min(grid):
        return "low"
    if rate >= max(grid):
        return "high"
    return None


def widen(grid: Sequence[float]) -> list[float]:
    """``grid`` (sorted) with one more rate below and above, a step of the grid's ratio at that
    end apart (a factor of 3 for a grid of one rate)."""
    g = sorted(grid)
    lo = g[1] / g[0] if len(g) > 1 else 3.0
    hi = g[-1] / g[-2] if len(g) > 1 else 3.0
    return [g[0] / lo, *g, g[-1] * hi]


def _n_value(n: str, all_count: int) -> int:
    return all_count if n == "all" else int(n)


def _windows(entry: Mapping[str, Any]) -> dict[str, float | None]:
    return dict(entry["test"]["model"]["vrmse"])


def summarize(runs: Sequence[Mapping[str, Any]], reference: int = 2) -> dict[str, Any]:
    """Per held-out set: per N and side the test VRMSE of each window (mean and spread over
    seeds), fine-tuned / scratch (ratio of the seed means, and each seed's), the data-efficiency
    factor per window (from the seed-mean curves, and each seed's), fine-tuned at ``reference`` over
    compute-matched scratch, and the rate choices left at the grid's edge."""
    out: dict[str, Any] = {}
    for held in dict.fromkeys(r["held_out"] for r in runs):
        mine = [r for r in runs if r["held_out"] == held]
        grid = list(mine[0]["curve"])
        all_count = mine[0]["train_trajectories_all"]
        windows = list(_windows(mine[0]["curve"][grid[0]]["finetune"]))
        curve: dict[str, Any] = {}
        for n in grid:
            sides = {
                side: {
                    w: spread([_windows(r["curve"][n][side]).get(w) for r in mine]) for w in windows
                }
                for side in ("finetune", "scratch")
            }
            per_seed = [
                {
                    w: _ratio(
                        _windows(r["curve"][n]["finetune"]).get(w),
                        _windows(r["curve"][n]["scratch"]).get(w),
                    )
                    for w in windows
                }
                for r in mine
            ]
            curve[n] = {
                **sides,
                "ratio": {
                    w: _ratio(sides["finetune"][w]["mean"], sides["scratch"][w]["mean"])
                    for w in windows
                },
                "ratio_by_seed": per_seed,
            }
        ns = [_n_value(n, all_count) for n in grid]
        ref = str(reference)
        factor = {
            w: efficiency_factor(
                ns,
                [curve[n]["scratch"][w]["mean"] for n in grid],
                curve[ref]["finetune"][w]["mean"] if ref in curve else None,
                reference,
            )
            for w in windows
        }
        factor_by_seed = [
            {
                w: efficiency_factor(
                    ns,
                    [_windows(r["curve"][n]["scratch"]).get(w) for n in grid],
                    _windows(r["curve"][ref]["finetune"]).get(w) if ref in r["curve"] else None,
                    reference,
                )
                for w in windows
            }
            for r in mine
        ]
        matched = [r["compute_matched"] for r in mine if "compute_matched" in r]
        compute = None
        if matched and ref in curve:
            sc = {w: spread([_windows(m).get(w) for m in matched]) for w in windows}
            compute = {w: _ratio(curve[ref]["finetune"][w]["mean"], sc[w]["mean"]) for w in windows}
        edges = [
            {"seed": r["seed"], "n": n, "side": side, "edge": r["curve"][n][side]["at_edge"]}
            for r in mine
            for n in grid
            for side in ("finetune", "scratch")
            if r["curve"][n][side].get("at_edge")
        ]
        out[held] = {
            "group": mine[0]["group"],
            "seeds": [r["seed"] for r in mine],
            "trajectories": dict(zip(grid, ns)),
            "windows": windows,
            "curve": curve,
            "factor": factor,
            "factor_by_seed": factor_by_seed,
            "ft_over_compute_matched": compute,
            "at_edge": edges,
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _f(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def factor_cell(f: Mapping[str, Any]) -> str:
    """A data-efficiency factor for a table: ``4.5× (9.1 traj.)``, ``≤ 0.5× (1 traj.)``,
    ``more than all`` or ``n/a``."""
    if f["bound"] in ("more than all", "n/a"):
        return f["bound"]
    cell = f"{f['factor']:.2g}× ({f['trajectories']:.3g} traj.)"
    return f"≤ {cell}" if f["bound"] == "at most" else cell


def not_run() -> str:
    """What the page says before a sample-efficiency JSON exists."""
    return (
        f"Not run yet. The full benchmark (about three days on 2 cores, estimated), then the table and the front "
        f"page's headline row from its JSON:\n\n```bash\n{COMMAND}\n{RENDER}\n```"
    )


def render_table(data: Mapping[str, Any]) -> str:
    """The results page's Markdown table: per held-out set, fine-tuned / scratch test VRMSE per
    N and window, the data-efficiency factor and the compute-matched row; then the settings."""
    summary, args = data.get("summary") or {}, data.get("args", {})
    reference = args.get("reference_n", 2)
    windows = list(dict.fromkeys(w for s in summary.values() for w in s["windows"]))
    head = ["held out", "set", "row", *windows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(summary.items(), key=lambda kv: GROUPS.index(kv[1]["group"]))
    for held, s in order:
        rows = [
            (
                f"fine-tuned / scratch, N={n}"
                + (f" ({s['trajectories'][n]})" if n == "all" else ""),
                [_f(c["ratio"].get(w)) for w in windows],
            )
            for n, c in s["curve"].items()
        ]
        rows.append(
            (
                f"data-efficiency factor (N={reference})",
                [factor_cell(s["factor"][w]) if w in s["factor"] else "n/a" for w in windows],
            )
        )
        if s["ft_over_compute_matched"]:
            rows.append(
                (
                    f"fine-tuned N={reference} / compute-matched scratch",
                    [_f(s["ft_over_compute_matched"].get(w)) for w in windows],
                )
            )
        for label, cells in rows:
            lines.append("| " + " | ".join([held, s["group"], label, *cells]) + " |")
    rec = data.get("record", {})
    edges = sum(len(s["at_edge"]) for s in summary.values())
    lines.append(
        f"\nTest VRMSE ratios of the seed means (below 1: fine-tuning wins); seeds "
        f"{args.get('seeds')}; {args.get('pretrain_time')} s of pretraining per held-out set and "
        f"seed; step cap {args.get('finetune_steps')}, validation every {args.get('val_every')} "
        f"steps, best-validation checkpoint; rates from {args.get('lrs')} "
        + ("widened until off the edge" if args.get("widen_grid") else "(not widened)")
        + f", {edges} choice(s) left at the grid's edge; commit {rec.get('commit')}"
        + (" (dirty)" if rec.get("dirty") else "")
        + f", started {rec.get('started')}; `benchmarks/results/{args.get('name', NAME)}.json`."
    )
    return "\n".join(lines)


def headline(data: Mapping[str, Any]) -> str:
    """The README's one-row table: over the 2D leave-one-out sets, the mean fine-tuned / scratch
    ratio at the reference N in each window, the smallest data-efficiency factor of the first
    window and the largest ratio at N = all."""
    summary, args = data.get("summary") or {}, data.get("args", {})
    reference = str(args.get("reference_n", 2))
    sets = {h: s for h, s in summary.items() if s["group"] == "2D"}
    if not sets:
        return not_run()
    windows = next(iter(sets.values()))["windows"][:3]
    ratios = [
        _mean(
            [
                s["curve"][reference]["ratio"].get(w)
                for s in sets.values()
                if reference in s["curve"]
            ]
        )
        for w in windows
    ]
    first = [s["factor"][windows[0]] for s in sets.values()]
    never = [f for f in first if f["bound"] == "more than all"]
    known = [f["factor"] for f in first if f["factor"] is not None]
    least = "more than all" if never else _f(min(known) if known else None, ".2g") + "×"
    worst_all = [
        max((r for r in s["curve"]["all"]["ratio"].values() if r is not None), default=None)
        for s in sets.values()
        if "all" in s["curve"]
    ]
    worst = max((r for r in worst_all if r is not None), default=None)
    head = [
        "held-out 2D sets",
        f"fine-tuned / scratch at N={reference}, windows {' / '.join(windows)}",
        f"smallest data-efficiency factor (window {windows[0]})",
        "worst fine-tuned / scratch at N=all",
    ]
    cells = [
        str(len(sets)),
        " / ".join(_f(r) for r in ratios),
        least,
        _f(worst),
    ]
    return "\n".join(
        [
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
            "| " + " | ".join(cells) + " |",
            "",
            f"Seeds {args.get('seeds')}, {args.get('pretrain_time')} s of pretraining; "
            f"`benchmarks/results/{args.get('name', NAME)}.json`, table in docs/results.md.",
        ]
    )


def _mean(values: Sequence[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return sum(v) / len(v) if v else None


def render_pages(
    data: Mapping[str, Any] | None, page: Path | None = RESULTS_PAGE, readme: Path | None = README
) -> list[Path]:
    """Write the table onto ``page`` and the headline into ``readme`` (either ``None``: skipped);
    ``data`` ``None`` (no results yet) writes what :func:`not_run` says on both."""
    written = []
    if page is not None:
        written.append(write_between(page, TABLE, render_table(data) if data else not_run()))
    if readme is not None:
        written.append(write_between(readme, HEADLINE, headline(data) if data else not_run()))
    return written
