"""Model forward and train-step speed on the CPU, against the machine's own fp32 GEMM rate.

Configs: ``small`` (the CPU quickstart preset, 64x64 2D, T=6, B=1) and ``scaled`` (a scaled
Walrus: hidden 384, 6 heads, 4 blocks, T=6, 128x128 2D, B=1), fp32. For each: forward and
train-step (forward, backward, AdamW step) milliseconds, FLOPs (``FlopCounterMode`` with the CPU
SDPA kernel registered), achieved GFLOP/s and its ratio to the fp32 GEMM rate measured in the
same run, and the forward time with the fused blocks switched off (plain) against on.

Run from the repository root::

    python -m benchmarks.forward            # full (quiet machine)
    python -m benchmarks.forward --quick    # fewer repeats, scaled config only
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.accounting import account
from benchmarks.common import gemm_gflops, print_table, save_json, timeit
from benchmarks.scale import load_preset
from walrus.bcs import BoundaryType
from walrus.model.walrus import Walrus

P = int(BoundaryType.PERIODIC)
SCALED = dict(n_fields=8, dim=384, depth=4, heads=6, projection_dim=48, groups=16)
CASES = {
    "small": (lambda: {**load_preset("small"), "n_fields": 8}, (1, 6, 4, 64, 64)),
    "scaled": (lambda: dict(SCALED), (1, 6, 4, 128, 128)),
}


def count_flops(fn) -> int:  # noqa: ANN001
    """Complete FLOPs of ``fn()``: ``FlopCounterMode`` (CPU SDPA registered) plus in-place GEMMs."""
    return account(fn, fake=False).flops


def bench_case(name: str, warmup: int, iters: int, gemm: float) -> dict[str, Any]:
    """Forward (fused and plain) and train-step timings of one config."""
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
    fwd_rate = fwd_flops / fused_ms / 1e6
    train_rate = train_flops / train_ms / 1e6
    return {
        "config": name,
        "params_M": model.num_params() / 1e6,
        "fwd_GFLOP": fwd_flops / 1e9,
        "fwd_ms": fused_ms,
        "fwd_plain_ms": plain_ms,
        "fused_speedup": plain_ms / fused_ms,
        "fwd_GFLOP/s": fwd_rate,
        "fwd_vs_gemm": fwd_rate / gemm,
        "train_GFLOP": train_flops / 1e9,
        "train_ms": train_ms,
        "train_GFLOP/s": train_rate,
        "train_vs_gemm": train_rate / gemm,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Parse arguments, run, print a table, write ``benchmarks/results/forward.json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, scaled only")
    parser.add_argument("--configs", nargs="+", choices=sorted(CASES), default=None)
    args = parser.parse_args(argv)
    names = args.configs or (["scaled"] if args.quick else ["small", "scaled"])
    warmup, iters = (1, 3) if args.quick else (2, 7)
    gemm = max(gemm_gflops(torch.float32, n) for n in (1024, 2048))
    print(f"measured fp32 GEMM rate: {gemm:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    rows = [bench_case(n, warmup, iters, gemm) for n in names]
    print_table(rows)
    path = save_json(
        "forward",
        {"gemm_gflops_fp32": gemm, "quick": args.quick, "target_vs_gemm": 0.70, "rows": rows},
    )
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
