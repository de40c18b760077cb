"""Model forward and train-step speed on the CPU, against the machine's own fp32 GEMM rate.

Configs: ``small`` (the CPU quickstart preset at the quickstart's training shape: B=8, 4 input
frames, 3 fields, 64x64 2D) and ``scaled`` (a scaled Walrus: hidden 384, 6 heads, 4 blocks, T=6,
128x128 2D, B=1), fp32. For each: forward and train-step (forward, backward, AdamW step)
milliseconds, FLOPs (``FlopCounterMode`` with the CPU SDPA kernel registered), achieved GFLOP/s
and its ratio to the fp32 GEMM rate measured in the same run, and the forward time with the
fused blocks switched off (plain) against on. ``--compile`` also times the whole model compiled
(``torch.compile``, :mod:`walrus.model.compile`), interleaved call by call with eager.

Run from the repository root::

    python -m benchmarks.forward            # full (quiet machine)
    python -m benchmarks.forward --quick    # fewer repeats, scaled config only
    python -m benchmarks.forward --configs small --compile
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.accounting import account
from benchmarks.common import gemm_gflops, print_table, save_json, timeit
from benchmarks.scale import load_preset
from walrus.bcs import BoundaryType
from walrus.model.compile import compile_model
from walrus.model.flops import estimate_mfu
from walrus.model.walrus import Walrus

P = int(BoundaryType.PERIODIC)
SCALED = dict(n_fields=8, dim=384, depth=4, heads=6, projection_dim=48, groups=16)
CASES = {
    "small": (lambda: {**load_preset("small"), "n_fields": 8}, (8, 4, 3, 64, 64)),
    "scaled": (lambda: dict(SCALED), (1, 6, 4, 128, 128)),
}


def count_flops(fn) -> int:  # noqa: ANN001
    """Complete FLOPs of ``fn()``: ``FlopCounterMode`` (CPU SDPA registered) plus in-place GEMMs."""
    return account(fn, fake=False).flops


def interleaved(fns: list[Callable[[], Any]], warmup: int, iters: int) -> list[float]:
    """Median milliseconds of each of ``fns``, called in turn (so load changes hit all alike)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(ts) for ts in times]


def compare_compiled(model: Walrus, x: torch.Tensor, fields, bcs, iters: int) -> dict[str, Any]:  # noqa: ANN001
    """Whole-model compiled against eager, forward (no grad) and train step, interleaved."""
    compiled = copy.deepcopy(model)
    compile_model(compiled, "model")
    out: dict[str, Any] = {}
    for task in ("fwd", "train"):
        steps = []
        for m in (model, compiled):
            m.train(task == "train")
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

            def step(m: Walrus = m, opt: torch.optim.Optimizer = opt, task: str = task) -> None:
                if task == "fwd":
                    with torch.no_grad():
                        m(x, fields, bcs)
                    return
                opt.zero_grad(set_to_none=True)
                m(x, fields, bcs).square().mean().backward()
                opt.step()

            steps.append(step)
        t0 = time.perf_counter()
        steps[1]()  # compile
        out[f"{task}_compile_s"] = time.perf_counter() - t0
        eager_ms, compiled_ms = interleaved(steps, 1, iters)
        out[f"{task}_compiled_ms"] = compiled_ms
        out[f"{task}_compiled_vs_eager"] = compiled_ms / eager_ms
    return out


def bench_case(
    name: str, warmup: int, iters: int, gemm: float, compiled: bool = False
) -> dict[str, Any]:
    """Forward (fused and plain) and train-step timings of one config (and compiled ones)."""
    make_cfg, shape = CASES[name]
    torch.manual_seed(0)
    model = Walrus(**{**make_cfg(), "jitter": False})
    x = torch.randn(shape)
    fields = torch.arange(shape[2])
    bcs = [[P, P]] * (len(shape) - 3)

    model.eval()

    @torch.no_grad()
    def fwd() -> None:
        model(x, fields, bcs)

    fwd_flops = count_flops(fwd)
    model.set_fused(True)
    fused_ms = timeit(fwd, warmup, iters)
    model.set_fused(False)
    plain_ms = timeit(fwd, warmup, iters)
    model.set_fused(True)

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x, fields, bcs).square().mean().backward()
        opt.step()

    train_flops = count_flops(step)
    train_ms = timeit(step, max(1, warmup // 2), max(2, iters // 2))
    fwd_rate = fwd_flops / fused_ms / 1e6  # GFLOP/s
    train_rate = train_flops / train_ms / 1e6
    extra = compare_compiled(model, x, fields, bcs, max(2, iters // 2)) if compiled else {}
    return {
        "config": name,
        "shape": list(shape),
        "params_M": model.num_params() / 1e6,
        "fwd_GFLOP": fwd_flops / 1e9,
        "fwd_ms": fused_ms,
        "fwd_plain_ms": plain_ms,
        "fused_speedup": plain_ms / fused_ms,
        "fwd_GFLOP/s": fwd_rate,
        "fwd_vs_gemm": estimate_mfu(fwd_flops, fused_ms / 1e3, gemm * 1e9),
        "train_GFLOP": train_flops / 1e9,
        "train_ms": train_ms,
        "train_GFLOP/s": train_rate,
        "train_vs_gemm": estimate_mfu(train_flops, train_ms / 1e3, gemm * 1e9),
        **extra,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Parse arguments, run, print a table, write ``benchmarks/results/forward.json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, scaled only")
    parser.add_argument("--configs", nargs="+", choices=sorted(CASES), default=None)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(model)")
    args = parser.parse_args(argv)
    names = args.configs or (["scaled"] if args.quick else ["small", "scaled"])
    warmup, iters = (1, 3) if args.quick else (2, 7)
    gemm = max(gemm_gflops(torch.float32, n) for n in (1024, 2048))
    print(f"measured fp32 GEMM rate: {gemm:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    rows = [bench_case(n, warmup, iters, gemm, args.compile) for n in names]
    print_table(rows)
    path = save_json(
        "forward_compile" if args.compile else "forward",
        {"gemm_gflops_fp32": gemm, "quick": args.quick, "target_vs_gemm": 0.70, "rows": rows},
    )
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
