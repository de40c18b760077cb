"""Forward+backward FLOP rate of the small models as a fraction of this machine's GEMM rate.

At the quickstart's training shape (``experiment=quickstart``: batch 8, 4 input frames, the
built-in ``navier_stokes_2d`` fields on its periodic 64x64 grid), for ``configs/model/small``
(patch encoder) and ``small_conv`` (the conv encoder it replaced), each built for 2D data only as
training builds it. The FLOPs of one forward+backward are counted once per model
(``FlopCounterMode`` with the CPU attention kernels and in-place GEMMs,
:func:`benchmarks.accounting.account`); the analytic forward split
(:func:`walrus.model.flops.forward_flops`) is stored next to it. Then, round by round and
interleaved, a square GEMM (:func:`benchmarks.common.gemm_gflops`) and the forward+backward of
each model are timed, so that a busy machine slows both alike. The figure is

    (counted FLOPs / forward+backward seconds) / (GEMM FLOP/s of the same round)

and the issue's target for ``small`` is >= 0.7. The load average is recorded with each round.

After the rounds, one profiled forward+backward of each model splits its CPU time by kind of op
(:func:`op_breakdown`): GEMM kernels, attention kernels, copies, and the rest (element-wise ops,
norms, reductions). The GEMM kernels' own FLOP rate, over the square GEMM's, bounds the figure
above: were every other op free, the step would run at that rate.

**The GEMM floor.** One step of ``small`` runs under :class:`benchmarks.kernels.KernelRecorder`,
which keeps every aten call that moves data (forward and backward: the calls the profiler lists)
with its operands' sizes, strides and dtype, sorted by kind. :class:`~benchmarks.kernels.KernelReplay`
replays calls alone on random tensors of the same layouts; over the GEMM calls (``mm``,
``addmm``, ``bmm``, ``baddbmm`` and their in-place / ``out=`` forms) that is the floor. Each round
times the step and then its floor, so the ratio ``step / floor`` (target <= 1.33) and the
non-GEMM share ``1 - floor / step`` (target <= 25 %) hold up on a busy machine better than either
time. Each round then replays the step's other kernels alone, kind by kind (attention, norms,
activations, copies, the rest): what is left of the step is dispatch, autograd and Python
overhead, and the floor plus the attention, norm and activation kernels alone bounds what
removing every copy and extra pass could reach with these kernels (``floor.kernels``).

``--compile blocks|model`` adds a compiled copy of ``small`` (``module.compile``) to the rounds.
The first ``--compile-warmup`` steps (compiles, and recompiles for new jitter offsets), less as
many steady compiled steps, are its compile time; the JSON gives the per-step gain and the step
count at which compiling breaks even. Inductor's on-disk cache serves a compile that ran before
on the machine; ``TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)`` measures a first (cold) compile, and
the JSON records whether the cache held entries.

Run from the repository root::

    python -m benchmarks.gemm_rate                # 5 rounds, 2 threads
    python -m benchmarks.gemm_rate --rounds 2 --threads 1
    python -m benchmarks.gemm_rate --compile model   # + compiled step, compile time (~3 min)
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from torch._inductor.runtime.cache_dir_utils import cache_dir

from benchmarks.accounting import account
from benchmarks.common import gemm_gflops, print_table, save_json
from benchmarks.gemm_rate_tables import TARGET_OVER_FLOOR, write_tables
from benchmarks.kernels import (
    KERNEL_KINDS,
    KernelReplay,
    floor_summary,
    mean_seconds,
    op_breakdown,
    step_kernels,
)
from walrus.model.compile import compile_model
from walrus.model.config import WalrusConfig
from walrus.model.flops import forward_flops, parameter_counts
from walrus.model.walrus import Walrus

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MODELS = ("small", "small_conv")
PERIODIC = 2
N_FIELDS = 3  # navier_stokes_2d: vorticity and two velocity components
GRID = (64, 64)
# the kinds of kernel the model's maths needs whatever the implementation (copies, fills and
# the other element-wise passes are the implementation's)
REQUIRED_KINDS = ("attention", "norm", "activation")


def quickstart_shape() -> tuple[int, int]:
    """Batch size and input frames of ``experiment=quickstart`` (read from its configs)."""
    quick = yaml.safe_load((CONFIGS / "experiment" / "quickstart.yaml").read_text())
    well = yaml.safe_load((CONFIGS / "data" / "base" / "well.yaml").read_text())
    return quick["data"].get("batch_size", well["batch_size"]), well["n_steps_input"]


def build(name: str) -> Walrus:
    """``configs/model/<name>.yaml`` for 2D data, in training mode."""
    cfg = yaml.safe_load((CONFIGS / "model" / f"{name}.yaml").read_text())
    torch.manual_seed(0)
    return Walrus(WalrusConfig.from_dict({**cfg, "include_d": [2]})).train()


class Step:
    """Forward, MAE loss and backward of one model on a fixed random batch."""

    def __init__(self, model: Walrus, batch: int, frames: int):
        self.model = model
        self.x = torch.randn(batch, frames, N_FIELDS, *GRID)  # (B, T, C, H, W)
        self.target = torch.randn_like(self.x)
        self.fields = torch.arange(N_FIELDS)
        self.bcs = [[PERIODIC, PERIODIC]] * len(GRID)

    def __call__(self) -> None:
        self.model.zero_grad(set_to_none=True)
        y = self.model(self.x, self.fields, self.bcs)
        (y - self.target).abs().mean().backward()

    def seconds(self, iters: int) -> float:
        """Mean wall seconds of ``iters`` steps (after one untimed step)."""
        return mean_seconds(self, iters)


def compile_warmup(step: Step, mode: str, steps: int) -> dict[str, Any]:
    """Compile ``step.model`` in place (``mode``, see :mod:`walrus.model.compile`) and run it.

    The first ``steps`` steps compile (and recompile for new jitter offsets); their wall
    seconds are returned, to be set against the steady compiled step.
    """
    compile_model(step.model, mode)
    seconds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
    return {"mode": mode, "warmup_steps": steps, "warmup_s": seconds}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse arguments, run, print, write ``benchmarks/results/gemm_rate.json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--iters", type=int, default=3, help="timed steps per model and round")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--compile",
        choices=("blocks", "model"),
        default=None,
        help="also time a compiled copy of small (module.compile=MODE) against its floor",
    )
    parser.add_argument(
        "--compile-warmup", type=int, default=8, help="compiled steps counted as compile time"
    )
    parser.add_argument("--note", default="", help="free text stored in the JSON (machine state)")
    parser.add_argument("--results-dir", default=None, help="where to write gemm_rate.json")
    parser.add_argument(
        "--name", default="gemm_rate", help="JSON file stem (gemm_rate_spin: the spinning policy)"
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="render the tables into docs/performance.md after the run",
    )
    parser.add_argument(
        "--render", action="store_true", help="only render the saved JSONs into the page, no run"
    )
    args = parser.parse_args(argv)
    if args.render:
        print(f"wrote {write_tables(args.results_dir)}")
        return {}
    if min(args.rounds, args.iters, args.threads, args.compile_warmup) < 1:
        parser.error("--rounds, --iters, --threads and --compile-warmup must be >= 1")
    torch.set_num_threads(args.threads)
    loadavg_start = list(os.getloadavg())
    batch, frames = quickstart_shape()
    bcs = [[PERIODIC, PERIODIC]] * len(GRID)
    steps, facts = {}, {}
    for name in MODELS:
        step = Step(build(name), batch, frames)
        steps[name] = step
        facts[name] = {
            "fwd_bwd_flops": account(step, fake=False).flops,
            "forward_flops": forward_flops(step.model, batch, frames, N_FIELDS, GRID, bcs),
            "params": parameter_counts(step.model),
        }
        parts = facts[name]["forward_flops"]
        print(
            f"{name}: {facts[name]['params']['total'] / 1e6:.2f}M parameters, forward "
            f"{parts['total'] / 1e9:.2f} GFLOP ({parts['processor'] / parts['total']:.0%} in the "
            f"processor), forward+backward {facts[name]['fwd_bwd_flops'] / 1e9:.2f} GFLOP"
        )
    kernels = step_kernels(steps["small"])
    calls = kernels["gemm"]
    floor = KernelReplay(calls)
    alone = {kind: KernelReplay(kernels[kind]) for kind in KERNEL_KINDS if kind != "gemm"}
    print(
        f"small: {len(calls)} GEMM calls per step ({floor.flops / 1e9:.2f} GFLOP, "
        f"{len(floor_summary(calls))} distinct), replayed alone as its floor; "
        + ", ".join(f"{len(kernels[k])} {k}" for k in alone)
        + " calls replayed alone by kind"
    )
    compiled, warm = None, {}
    if args.compile:
        cache = Path(cache_dir())
        cache_warm = cache.is_dir() and any(cache.iterdir())
        compiled = Step(copy.deepcopy(steps["small"].model), batch, frames)
        compiled.x, compiled.target = steps["small"].x, steps["small"].target
        warm = compile_warmup(compiled, args.compile, args.compile_warmup)
        warm["inductor_cache_had_entries"] = cache_warm
        seconds = [round(s, 2) for s in warm["warmup_s"]]
        print(f"compile={args.compile} (inductor cache {cache}): first steps {seconds} s")
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        row: dict[str, Any] = {"round": r, "load1": os.getloadavg()[0]}
        gemm = [gemm_gflops()]
        for name, step in steps.items():
            s = step.seconds(args.iters)
            gemm.append(gemm_gflops())
            row[f"{name}_ms"] = s * 1e3
            row[f"{name}_gflops"] = facts[name]["fwd_bwd_flops"] / s / 1e9
            if name == "small":  # the floor right after its step, then the compiled step
                row["small_floor_ms"] = floor.seconds(args.iters) * 1e3
                for kind, replay in alone.items():
                    row[f"small_{kind}_alone_ms"] = replay.seconds(args.iters) * 1e3
                if compiled is not None:
                    row["small_compiled_ms"] = compiled.seconds(args.iters) * 1e3
        row["gemm_gflops"] = statistics.mean(gemm)
        for name in steps:
            row[f"{name}_fraction"] = row[f"{name}_gflops"] / row["gemm_gflops"]
        row["small_over_floor"] = row["small_ms"] / row["small_floor_ms"]
        row["small_floor_fraction"] = floor.flops / row["small_floor_ms"] / 1e6 / row["gemm_gflops"]
        if compiled is not None:
            row["small_compiled_over_floor"] = row["small_compiled_ms"] / row["small_floor_ms"]
            row["small_compiled_over_eager"] = row["small_compiled_ms"] / row["small_ms"]
        rows.append(row)
        print_table([row])
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    median["small_non_gemm_share"] = 1 - 1 / median["small_over_floor"]
    split = kernel_split(rows, {k: len(v) for k, v in kernels.items()})
    print("\nsmall: its kernels replayed alone by kind (median ms over rounds):")
    print_table(split["table"])
    print(
        f"kernels alone {split['kernels_ms']:.0f} ms of a {split['step_ms']:.0f} ms step; the "
        f"GEMM floor with the attention, norm and activation kernels alone is "
        f"{split['required_over_floor']:.2f}x the floor (target {TARGET_OVER_FLOOR}x)"
    )
    print("\nmedian over rounds:")
    print_table([median])
    floor_facts: dict[str, Any] = {
        "gemm_calls": len(calls),
        "gemm_flops": floor.flops,
        "target_over_floor": TARGET_OVER_FLOOR,
        "calls": floor_summary(calls),
        "kernels": split,
    }
    if compiled is not None:
        f = floor_facts["compiled"] = compile_facts(warm, rows)
        print(
            f"compile={args.compile}: {f['compile_s']:.0f} s of compilation, break-even after "
            f"{f['break_even_steps']} steps"
        )
    breakdown = {}
    for name, step in steps.items():
        gemm = statistics.mean([gemm_gflops(), gemm_gflops()])
        parts = op_breakdown(step)
        gemm_s = parts["seconds"]["gemm"]
        parts["gemm_kernel_fraction"] = parts["gemm_flops"] / gemm_s / 1e9 / gemm if gemm_s else 0
        parts["square_gemm_gflops"] = gemm
        breakdown[name] = parts
    print("\nself CPU time by kind of op (one profiled step; profiling adds overhead):")
    print_table(
        [
            {
                "model": name,
                **{f"{k}_%": 100 * v / b["total_s"] for k, v in b["seconds"].items()},
                "gemm_kernels_vs_square": b["gemm_kernel_fraction"],
            }
            for name, b in breakdown.items()
        ]
    )
    path = save_json(
        args.name,
        {
            "shape": {"batch": batch, "frames": frames, "fields": N_FIELDS, "grid": list(GRID)},
            "threads": args.threads,
            "iters": args.iters,
            "target_fraction": 0.7,
            "note": args.note,
            # libgomp's wait policy changes the step (many short parallel regions) more than
            # its floor; train.py runs with OMP_WAIT_POLICY=PASSIVE unless the user set one
            "openmp_env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
            "models": facts,
            "floor": floor_facts,
            "median": median,
            "rounds": rows,
            "op_breakdown": breakdown,
            "loadavg_start": loadavg_start,
            "loadavg_end": list(os.getloadavg()),
        },
        args.results_dir,
    )
    print(f"wrote {path}")
    if args.write:
        print(f"wrote {write_tables(args.results_dir)}")
    return median


def kernel_split(rows: list[dict[str, Any]], counts: dict[str, int]) -> dict[str, Any]:
    """The small step's kernels alone by kind, against its GEMM floor.

    Per kind: calls per step and the median over rounds of their replay alone. ``overhead_ms``
    is the step less all its kernels alone: dispatch, autograd and Python. The required
    kernels (:data:`REQUIRED_KINDS`) alone, over the floor, bound what removing every copy,
    extra pass and overhead could reach with these kernels.
    """
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_ms")}
    floor, step = med["small_floor_ms"], med["small_ms"]
    alone = {"gemm": floor} | {
        k: med[f"small_{k}_alone_ms"] for k in KERNEL_KINDS if f"small_{k}_alone_ms" in med
    }
    total = sum(alone.values())
    required = floor + sum(alone.get(k, 0.0) for k in REQUIRED_KINDS)
    table = [
        {"kind": k, "calls": counts.get(k, 0), "alone_ms": v, "of_step": v / step}
        for k, v in alone.items()
    ]
    table.append(
        {"kind": "overhead", "calls": 0, "alone_ms": step - total, "of_step": 1 - total / step}
    )
    return {
        "step_ms": step,
        "floor_ms": floor,
        "kernels_ms": total,
        "overhead_ms": step - total,
        "required_ms": required,
        "required_over_floor": required / floor,
        "table": table,
    }


def compile_facts(warm: dict[str, Any], rows: list[dict[str, Any]], run_steps: int = 600) -> dict:
    """Compile time and break-even of the compiled step against eager.

    Compile time is the warm-up steps' wall time less as many of its fastest (steady) step.
    The gain per step is the median over rounds of eager less compiled ms, each pair timed
    back to back. The break-even is the step count from which compiling saves time (``None``:
    never).
    """
    steady = min(warm["warmup_s"])
    compile_s = sum(warm["warmup_s"]) - len(warm["warmup_s"]) * steady
    gain = statistics.median(r["small_ms"] - r["small_compiled_ms"] for r in rows) * 1e-3
    eager = statistics.median(r["small_ms"] for r in rows) * 1e-3
    return {
        **warm,
        "compile_s": compile_s,
        "gain_ms_per_step": gain * 1e3,
        "break_even_steps": math.ceil(compile_s / gain) if gain > 0 else None,
        "run_steps": run_steps,
        "run_s": {"eager": run_steps * eager, "compiled": compile_s + run_steps * (eager - gain)},
    }


if __name__ == "__main__":
    main()
