"""GPU forward benchmark: ms per sample and MFU against a GEMM rate measured in the same run.

``walrus_1b`` on 2D 128x128 input, 6 frames, bf16 autocast, batch 1, 2, 4, 8; eager and
compiled (``torch.compile`` per processor block); the ``sdpa`` and ``chunked`` temporal kernels;
peak memory. MFU is achieved FLOP/s (``FlopCounterMode`` FLOPs of one forward, CPU SDPA kernel
registered) over the measured bf16 GEMM rate. ``--tiny`` runs the ``tiny`` preset on a 32x32
grid, on whatever device there is (the CPU here), to show the script works. Configurations
still to run when ``--budget-s`` is spent are recorded as skipped.

Run from the repository root (``benchmarks/gpu.sh`` wraps it)::

    python -m benchmarks.gpu                 # the full GPU run
    python -m benchmarks.gpu --tiny          # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.accounting import register_cpu_sdpa_flops
from benchmarks.common import gemm_gflops, print_table, save_json, timeit
from benchmarks.scale import load_preset
from walrus.bcs import BoundaryType
from walrus.model.walrus import Walrus

P = int(BoundaryType.PERIODIC)


def peak_memory_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None


@torch.no_grad()
def forward_once(model: Walrus, x: torch.Tensor, fields, bcs, dtype: torch.dtype) -> None:  # noqa: ANN001
    """One bf16-autocast inference forward."""
    with torch.autocast(x.device.type, dtype=dtype):
        model(x, fields, bcs)


def build(preset: str, kernel: str, device: torch.device, compiled: bool) -> Walrus:
    """The preset in eval mode on ``device`` with the given temporal kernel."""
    cfg = {**load_preset(preset), "temporal_kernel": kernel, "grad_checkpointing": False}
    torch.manual_seed(0)
    with device:
        model = Walrus(**cfg).eval()
    if compiled:
        for blk in model.blocks:  # one graph serves every block
            blk.compile(dynamic=False)
    return model


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every (kernel, mode, batch); returns the JSON payload."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = torch.bfloat16
    gemm = gemm_gflops(dtype, args.gemm_n, device)
    print(f"device {device}: measured bf16 GEMM rate {gemm / 1e3:.1f} TFLOP/s")
    register_cpu_sdpa_flops()
    start, rows = time.perf_counter(), []
    for kernel in args.kernels:
        for compiled in args.modes:
            model = None
            for b in args.batches:
                row = {"kernel": kernel, "mode": "compiled" if compiled else "eager", "B": b}
                if time.perf_counter() - start > args.budget_s:
                    rows.append({**row, "skipped": "budget"})
                    continue
                model = model or build(args.preset, kernel, device, compiled)
                x = torch.randn(b, args.frames, args.channels, *args.grid, device=device)
                fields = torch.arange(args.channels)
                bcs = [[P, P]] * len(args.grid)
                fwd = functools.partial(forward_once, model, x, fields, bcs, dtype)
                fwd()  # compile / warm caches before counting and timing
                with FlopCounterMode(display=False) as counter:
                    fwd()
                flops = counter.get_total_flops()
                peak_memory_reset(device)
                ms = timeit(fwd, args.warmup, args.iters, device)
                rate = flops / ms / 1e6
                rows.append(
                    {
                        **row,
                        "ms": ms,
                        "ms/sample": ms / b,
                        "TFLOP/sample": flops / b / 1e12,
                        "TFLOP/s": rate / 1e3,
                        "MFU_vs_gemm": rate / gemm,
                        "peak_GB": peak_memory_gb(device),
                    }
                )
                print_table(rows[-1:])
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return {
        "device": name,
        "preset": args.preset,
        "grid": args.grid,
        "frames": args.frames,
        "gemm_tflops_bf16": gemm / 1e3,
        "elapsed_s": time.perf_counter() - start,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse arguments, measure, print a table, write ``benchmarks/results/gpu[_tiny].json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny preset, 32x32, CPU smoke run")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even with a GPU")
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--kernels", nargs="+", default=["sdpa", "chunked"])
    parser.add_argument("--eager-only", action="store_true")
    args = parser.parse_args(argv)
    args.modes = [False] if args.eager_only else [False, True]
    args.preset, args.frames, args.channels = ("tiny" if args.tiny else "walrus_1b"), 6, 4
    args.grid = [32, 32] if args.tiny else [128, 128]
    args.batches = [1, 2] if args.tiny else [1, 2, 4, 8]
    args.warmup, args.iters = (1, 2) if args.tiny else (2, 5)
    args.gemm_n = 512 if args.tiny else 8192
    payload = run(args)
    print_table(payload["rows"])
    path = save_json("gpu_tiny" if args.tiny else "gpu", payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
