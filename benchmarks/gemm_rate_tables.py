"""The tables of :mod:`benchmarks.gemm_rate` on docs/performance.md, from its saved JSONs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR
from benchmarks.pages import DOCS, write_between

PAGE = DOCS / "performance.md"
TARGET_OVER_FLOOR = 1.33


def _load(results_dir: str | Path | None, name: str) -> dict[str, Any] | None:
    path = Path(results_dir or RESULTS_DIR) / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def floor_table(runs: dict[str, dict[str, Any]]) -> str:
    """Markdown: the small step, its GEMM floor and their ratio, one column per saved run."""
    cols = list(runs)
    lines = [
        "| `small`, forward + backward | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]

    def row(label: str, cell: Callable[[dict[str, Any]], str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(runs[c]) for c in cols) + " |")

    def spread(d: dict[str, Any]) -> str:
        ratios = [r["small_over_floor"] for r in d["rounds"]]
        return f"rounds {min(ratios):.2f}–{max(ratios):.2f}"

    row("step", lambda d: f"{d['median']['small_ms']:.0f} ms")
    row(
        "GEMM floor",
        lambda d: (
            f"{d['median']['small_floor_ms']:.0f} ms "
            f"({d['median']['small_floor_fraction']:.0%} of the square-GEMM rate)"
        ),
    )
    row(
        "**step / floor**",
        lambda d: (
            f"**{d['median']['small_over_floor']:.2f}×** ({spread(d)}; non-GEMM share "
            f"{d['median']['small_non_gemm_share']:.0%})"
        ),
    )
    row("load average (1 min)", lambda d: f"{d['median']['load1']:.1f}")
    row("measured", lambda d: f"{d['environment']['time'][:10]}, {len(d['rounds'])} rounds")
    return "\n".join(lines)


def kernels_table(data: dict[str, Any]) -> str:
    """Markdown: the small step's kernels replayed alone by kind (:func:`kernel_split`)."""
    split = data["floor"]["kernels"]
    lines = ["| kind | calls per step | alone | share of the step |", "|---|---|---|---|"]
    for r in split["table"]:
        calls = "" if r["kind"] == "overhead" else str(r["calls"])
        lines.append(f"| {r['kind']} | {calls} | {r['alone_ms']:.1f} ms | {r['of_step']:.0%} |")
    lines.append(
        f"\nFloor plus the attention, norm and activation kernels alone: "
        f"{split['required_ms']:.0f} ms, **{split['required_over_floor']:.2f}× the floor** "
        f"(target {TARGET_OVER_FLOOR}×); all kernels alone {split['kernels_ms']:.0f} ms of the "
        f"{split['step_ms']:.0f} ms step."
    )
    return "\n".join(lines)


def compile_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: compile time, per-step gain and break-even of ``--compile`` runs, a row each."""
    lines = [
        "| compile | inductor cache | compile time | gain per step | break-even | "
        f"{runs[0]['floor']['compiled']['run_steps']}-step run, eager / compiled | "
        "compiled step / floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for data in runs:
        c = data["floor"]["compiled"]
        cache = "warm (held entries)" if c["inductor_cache_had_entries"] else "cold (empty)"
        even = c["break_even_steps"]
        run = c["run_s"]
        lines.append(
            f"| `module.compile={c['mode']}` | {cache} | {c['compile_s']:.0f} s | "
            f"{c['gain_ms_per_step']:.0f} ms (compiled / eager "
            f"{data['median']['small_compiled_over_eager']:.2f}) | "
            f"{'never' if even is None else f'{even:,} steps'} | "
            f"{run['eager']:.0f} s / {run['compiled']:.0f} s | "
            f"{data['median']['small_compiled_over_floor']:.2f}× |"
        )
    return "\n".join(lines)


# saved runs of the floor table, in column order: train.py's setting, then others
FLOOR_RUNS = ("gemm_rate", "gemm_rate_passive", "gemm_rate_spin")


def policy_label(env: dict[str, str | None]) -> str:
    """A table label for the OpenMP variables a run was measured with."""
    if (env.get("OMP_WAIT_POLICY") or "").upper() == "PASSIVE":
        return "passive (`OMP_WAIT_POLICY=PASSIVE`)"
    spin = env.get("GOMP_SPINCOUNT")
    if spin == "10000":
        return "short spin (`GOMP_SPINCOUNT=10000`, `train.py`'s)"
    if spin is not None:
        return f"`GOMP_SPINCOUNT={spin}`"
    return "spinning (libgomp's default)"


def write_tables(results_dir: str | Path | None = None) -> Path:
    """Render ``gemm_rate.json`` into :data:`PAGE`, with the other :data:`FLOOR_RUNS` (other
    OpenMP settings) and ``gemm_rate_compile.json`` / ``gemm_rate_compile_warm.json`` (``--compile``
    runs with an empty and a filled inductor cache) when saved.

    Raises:
        FileNotFoundError: no ``gemm_rate.json`` in ``results_dir``.
    """
    main_run = _load(results_dir, "gemm_rate")
    if main_run is None:
        raise FileNotFoundError(
            f"no gemm_rate.json in {results_dir or RESULTS_DIR}: run python -m benchmarks.gemm_rate"
        )
    runs = {}
    for name in FLOOR_RUNS:
        data = main_run if name == "gemm_rate" else _load(results_dir, name)
        if data is not None:
            runs[policy_label(data.get("openmp_env") or {})] = data
    write_between(PAGE, "gemm-floor", floor_table(runs))
    if "kernels" in main_run["floor"]:
        write_between(PAGE, "step-kernels", kernels_table(main_run))
    compiled = [_load(results_dir, n) for n in ("gemm_rate_compile", "gemm_rate_compile_warm")]
    compiled = [d for d in compiled if d is not None and "compiled" in d["floor"]]
    if compiled:
        write_between(PAGE, "step-compile", compile_table(compiled))
    return PAGE
