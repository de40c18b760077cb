"""GPU benchmark: forward and train step, ms per sample and MFU against a measured GEMM rate.

``walrus_1b`` (official width; ``--depth`` fewer blocks if memory requires) on 2D 128x128 input,
6 frames, bf16 autocast, batch 1, 2, 4, 8; eager and compiled (``torch.compile`` of the whole
model, :mod:`walrus.model.compile`); the ``sdpa`` temporal kernel (``--kernels sdpa chunked``
adds the other); peak memory. Each row is an inference forward or a train step (forward,
backward with gradient checkpointing, AdamW step). MFU is
:func:`walrus.model.flops.estimate_mfu` of the ``FlopCounterMode`` FLOPs (CPU SDPA kernel
registered) against the bf16 GEMM rate measured in the same run. ``--tiny`` runs the ``tiny``
preset on a 32x32 grid, on whatever device there is (the CPU here), to show the script works.
Configurations still to run when ``--budget-s`` is spent are recorded as skipped.

Run from the repository root (``benchmarks/gpu.sh`` wraps it)::

    python -m benchmarks.gpu --out DIR       # the full GPU run, JSON in DIR
    python -m benchmarks.gpu --tiny          # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.accounting import register_cpu_sdpa_flops
from benchmarks.common import gemm_gflops, print_table, save_json, timeit
from benchmarks.scale import load_preset
from walrus.bcs import BoundaryType
from walrus.model.compile import compile_model
from walrus.model.flops import estimate_mfu
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


def train_once(
    model: Walrus,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    fields,  # noqa: ANN001
    bcs,  # noqa: ANN001
    dtype: torch.dtype,
) -> None:
    """One bf16-autocast train step: forward, backward (checkpointed blocks), AdamW step."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=dtype):
        y = model(x, fields, bcs)
    y.float().square().mean().backward()
    opt.step()


def build(
    preset: str, kernel: str, device: torch.device, compiled: bool, train: bool, depth: int | None
) -> Walrus:
    """The preset on ``device`` with the given temporal kernel, in train (no jitter, so one
    graph serves every step; checkpointed blocks) or eval mode, compiled whole or eager."""
    cfg = {**load_preset(preset), "temporal_kernel": kernel, "grad_checkpointing": train}
    cfg["jitter"] = False
    if depth is not None:
        cfg["depth"] = depth
    torch.manual_seed(0)
    with device:
        model = Walrus(**cfg).train(train)
    compile_model(model, "model" if compiled else False)
    return model


def measure(
    fn: Callable[[], None], b: int, gemm: float, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """Warm ``fn`` up (compiles), count its FLOPs once, then time it: one row's figures."""
    fn()  # compile / warm caches before counting and timing
    with FlopCounterMode(display=False) as counter:
        fn()
    flops = counter.get_total_flops()
    peak_memory_reset(device)
    ms = timeit(fn, args.warmup, args.iters, device)
    return {
        "ms": ms,
        "ms/sample": ms / b,
        "TFLOP/sample": flops / b / 1e12,
        "TFLOP/s": flops / ms / 1e9,
        "MFU_vs_gemm": estimate_mfu(flops, ms / 1e3, gemm * 1e9),
        "peak_GB": peak_memory_gb(device),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every (kernel, mode, batch); returns the JSON payload."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = torch.bfloat16
    gemm = gemm_gflops(dtype, args.gemm_n, device)
    print(f"device {device}: measured bf16 GEMM rate {gemm / 1e3:.1f} TFLOP/s")
    register_cpu_sdpa_flops()
    torch._dynamo.config.automatic_dynamic_shapes = False  # one static graph per batch size
    start, rows = time.perf_counter(), []
    for kernel, task, compiled in itertools.product(args.kernels, args.tasks, args.modes):
        model = opt = None
        for b in args.batches:
            mode = "compiled" if compiled else "eager"
            row = {"task": task, "kernel": kernel, "mode": mode, "B": b}
            if time.perf_counter() - start > args.budget_s:
                rows.append({**row, "skipped": "budget"})
                continue
            train = task == "train"
            if model is None:
                model = build(args.preset, kernel, device, compiled, train, args.depth)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5) if train else None
            x = torch.randn(b, args.frames, args.channels, *args.grid, device=device)
            fields = torch.arange(args.channels)
            bcs = [[P, P]] * len(args.grid)
            if train:
                fn = functools.partial(train_once, model, opt, x, fields, bcs, dtype)
            else:
                fn = functools.partial(forward_once, model, x, fields, bcs, dtype)
            try:
                rows.append({**row, **measure(fn, b, gemm, device, args)})
            except Exception as err:  # out of memory, compile failure: recorded, the rest runs
                traceback.print_exc()
                rows.append({**row, "error": f"{type(err).__name__}: {str(err)[:200]}".strip()})
            print_table(rows[-1:])
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return {
        "device": name,
        "preset": args.preset,
        "grid": args.grid,
        "frames": args.frames,
        "depth": args.depth,
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
    parser.add_argument("--kernels", nargs="+", default=["sdpa"], choices=["sdpa", "chunked"])
    parser.add_argument("--tasks", nargs="+", default=["forward", "train"])
    parser.add_argument("--depth", type=int, default=None, help="fewer blocks (memory)")
    parser.add_argument("--out", default=None, help="output folder (default benchmarks/results)")
    parser.add_argument("--eager-only", action="store_true")
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="batch sizes")
    args = parser.parse_args(argv)
    bad = sorted(set(args.tasks) - {"forward", "train"})
    if bad:
        parser.error(f"--tasks takes forward and/or train, got {bad}")
    args.modes = [False] if args.eager_only else [False, True]
    args.preset, args.frames, args.channels = ("tiny" if args.tiny else "walrus_1b"), 6, 4
    args.grid = [32, 32] if args.tiny else [128, 128]
    if args.batches is None:
        args.batches = [1, 2] if args.tiny else [1, 2, 4, 8]
    elif min(args.batches) < 1:
        parser.error(f"--batches takes positive sizes, got {args.batches}")
    args.warmup, args.iters = (1, 2) if args.tiny else (2, 5)
    args.gemm_n = 512 if args.tiny else 8192
    payload = run(args)
    print_table(payload["rows"])
    path = save_json("gpu_tiny" if args.tiny else "gpu", payload, args.out)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
