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

**The GEMM floor.** One step of ``small`` runs under :class:`GemmRecorder`, which keeps every
GEMM call (``mm``, ``addmm``, ``bmm``, ``baddbmm`` and their in-place / ``out=`` forms, forward
and backward: the calls the profiler lists) with its operands' sizes, strides and dtype.
:class:`GemmFloor` replays them alone on random tensors of the same layouts. Each round times
the step and then its floor, so the ratio ``step / floor`` (target <= 1.33) and the non-GEMM
share ``1 - floor / step`` (target <= 25 %) hold up on a busy machine better than either time.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from benchmarks.accounting import account
from benchmarks.common import gemm_gflops, print_table, save_json
from walrus.model.compile import compile_model
from walrus.model.config import WalrusConfig
from walrus.model.flops import forward_flops, parameter_counts
from walrus.model.walrus import Walrus

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MODELS = ("small", "small_conv")
PERIODIC = 2
N_FIELDS = 3  # navier_stokes_2d: vorticity and two velocity components
GRID = (64, 64)


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


def mean_seconds(fn: Callable[[], Any], iters: int) -> float:
    """Mean wall seconds of ``iters`` calls of ``fn`` (after one untimed call)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


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


GEMM_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::addmm_",
    "aten::bmm",
    "aten::baddbmm",
    "aten::baddbmm_",
)
COPY_OPS = ("aten::copy_", "aten::cat", "aten::fill_", "aten::zero_", "aten::stack", "aten::clone")


def op_kind(name: str) -> str:
    """``gemm``, ``attention``, ``copy`` or ``other`` for a profiled aten op name."""
    if name in GEMM_OPS:
        return "gemm"
    if "scaled_dot_product" in name or "attention" in name.lower():
        return "attention"
    return "copy" if name in COPY_OPS else "other"


def gemm_flops(name: str, shapes: list[list[int]]) -> int:
    """FLOPs of one GEMM op from its recorded input shapes (0 when they are not recorded).

    ``mm (m,k)(k,n)``, ``addmm[_] (c)(m,k)(k,n)`` and the batched ``bmm``/``baddbmm[_]`` forms:
    ``2 m k n`` per matrix product.
    """
    mats = [s for s in shapes if len(s) >= 2]
    if name in ("aten::addmm", "aten::addmm_", "aten::baddbmm", "aten::baddbmm_"):
        mats = mats[-2:] if len(mats) >= 2 else []
    if len(mats) < 2:
        return 0
    a, b = mats[0], mats[1]
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


_GEMM_PACKETS = {getattr(torch.ops.aten, n.removeprefix("aten::")) for n in GEMM_OPS}


@dataclass(frozen=True)
class TensorSpec:
    """Size, stride and dtype of a recorded GEMM operand."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def fresh(self) -> torch.Tensor:
        """A random tensor of this layout (its own storage, just large enough)."""
        extent = 1 + sum((n - 1) * s for n, s in zip(self.size, self.stride, strict=True))
        if 0 in self.size:
            extent = 0
        return torch.randn(extent, dtype=self.dtype).as_strided(self.size, self.stride)


GemmCall = tuple[Any, tuple, dict]  # (overload, args, kwargs), tensors as TensorSpec


class GemmRecorder(TorchDispatchMode):
    """Records the GEMM calls (``GEMM_OPS``) that run under it, forward and backward alike.

    ``calls`` holds ``(overload, args, kwargs)`` with every tensor replaced by its
    :class:`TensorSpec`: enough to replay the call on fresh tensors of the same layout.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[GemmCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func.overloadpacket in _GEMM_PACKETS:
            spec = tree_map(
                lambda t: (
                    TensorSpec(tuple(t.shape), t.stride(), t.dtype)
                    if isinstance(t, torch.Tensor)
                    else t
                ),
                (args, kwargs),
            )
            self.calls.append((func, *spec))
        return func(*args, **kwargs)


def step_gemms(step: Callable[[], Any]) -> list[GemmCall]:
    """The GEMM calls of one run of ``step`` (after one unrecorded run), in order."""
    step()
    with GemmRecorder() as rec:
        step()
    return rec.calls


def call_flops(func: Any, args: tuple) -> int:
    """FLOPs of one recorded GEMM call (see :func:`gemm_flops`)."""
    shapes = [list(a.size) for a in args if isinstance(a, TensorSpec)]
    return gemm_flops(f"aten::{func.overloadpacket.__name__}", shapes)


def _fresh(value: Any) -> Any:
    return value.fresh() if isinstance(value, TensorSpec) else value


class GemmFloor:
    """A step's GEMMs alone: every recorded call replayed on random tensors of its layout.

    Each call gets its own inputs (same sizes, strides and dtype as in the step), so caches see
    about what the step's GEMMs see; in-place calls write into their own buffer each time.
    """

    def __init__(self, calls: list[GemmCall]):
        self.calls = [
            (func, tree_map(_fresh, args), tree_map(_fresh, kw)) for func, args, kw in calls
        ]
        self.flops = sum(call_flops(func, args) for func, args, _ in calls)

    def __call__(self) -> None:
        for func, args, kwargs in self.calls:
            func(*args, **kwargs)

    def seconds(self, iters: int) -> float:
        """Mean wall seconds of ``iters`` replays (after one untimed replay)."""
        return mean_seconds(self, iters)


def op_breakdown(step: Callable[[], Any]) -> dict[str, Any]:
    """One profiled forward+backward of ``step``: CPU seconds per op kind and GEMM FLOPs.

    Returns:
        ``{"seconds": {kind: s}, "total_s", "gemm_flops"}`` over the ops' self CPU time.
    """
    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    seconds = dict.fromkeys(("gemm", "attention", "copy", "other"), 0.0)
    flops = 0
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        kind = op_kind(ev.name)
        seconds[kind] += ev.self_cpu_time_total * 1e-6
        if kind == "gemm":
            flops += gemm_flops(ev.name, [list(s) for s in ev.input_shapes])
    return {"seconds": seconds, "total_s": sum(seconds.values()), "gemm_flops": flops}


def floor_summary(calls: list[GemmCall]) -> list[dict[str, Any]]:
    """The distinct GEMM calls of a step: op, operand sizes, count and FLOPs per call."""
    seen: dict[tuple, dict[str, Any]] = {}
    for func, args, _ in calls:
        sizes = [list(a.size) for a in args if isinstance(a, TensorSpec)]
        key = (str(func), str(sizes))
        entry = seen.setdefault(
            key, {"op": str(func), "sizes": sizes, "count": 0, "flops": call_flops(func, args)}
        )
        entry["count"] += 1
    return sorted(seen.values(), key=lambda e: -e["count"] * e["flops"])


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
    args = parser.parse_args(argv)
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
    calls = step_gemms(steps["small"])
    floor = GemmFloor(calls)
    print(
        f"small: {len(calls)} GEMM calls per step ({floor.flops / 1e9:.2f} GFLOP, "
        f"{len(floor_summary(calls))} distinct), replayed alone as its floor"
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
    print("\nmedian over rounds:")
    print_table([median])
    floor_facts: dict[str, Any] = {
        "gemm_calls": len(calls),
        "gemm_flops": floor.flops,
        "target_over_floor": 1.33,
        "calls": floor_summary(calls),
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
        "gemm_rate",
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
    return median


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
