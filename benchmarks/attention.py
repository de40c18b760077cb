"""Benchmark the attention kernels (sdpa | chunked | math): time and peak memory.

Cases (fp32, CPU unless CUDA is asked for):

- ``long``: one sequence of N tokens, 8 batch*heads, head dim 64, forward without grad;
  N = 1k..16k (``--quick``: 512..2k). ``math`` only up to N = 8k (its N x N matrix is 2 GiB there).
- ``temporal``: 6144 sequences (768 tokens x 8 heads) of T = 6, 16, 32 frames, head dim 64,
  causal, with a learned relative-position bias ``(heads, T, T)``; forward and forward+backward
  (gradients of q, k, v and the bias).

Time is the median (``--stat min``: minimum) wall time of a few calls
(``benchmarks.common.timeit``); the minimum is steadier on a machine shared with other jobs. Peak memory is the
peak of live bytes of tensors created by ATen ops during one call, measured with a
``TorchDispatchMode`` tracker (``benchmarks.common.peak_alloc_bytes``): deterministic and not
disturbed by other processes or by allocator caching, and it includes tensors saved for backward
and the gradients. It does not see scratch memory a fused kernel allocates internally (SDPA's
per-thread blocks, a few MiB at most), so SDPA's figure is a slight under-count. Inputs are
allocated before measuring and are not counted.

Usage (from the repository root)::

    python -m benchmarks.attention --quick
    python -m benchmarks.attention            # full sizes
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch

from benchmarks.common import gemm_gflops, peak_alloc_bytes, print_table, save_json, timeit
from walrus.nn.attention import attention

KERNELS = ("sdpa", "chunked", "math")
HEADS, HEAD_DIM = 8, 64
MATH_MAX_N = 8192
TEMPORAL_TOKENS = 768  # x 8 heads = 6144 sequences


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    kernel: str,
) -> None:
    with torch.no_grad():
        attention(q, k, v, bias=bias, causal=causal, kernel=kernel)


def _forward_backward(
    leaves: list[torch.Tensor], grad_out: torch.Tensor, causal: bool, kernel: str
) -> None:
    """Forward and gradients of q, k, v and the bias (``leaves``)."""
    q, k, v, bias = leaves
    out = attention(q, k, v, bias=bias, causal=causal, kernel=kernel)
    torch.autograd.grad(out, leaves, grad_out)


def _measure(
    fn: Callable[[], object], warmup: int, iters: int, device: torch.device, stat: str
) -> tuple[float, float]:
    """(ms, peak MiB) of ``fn``."""
    ms = timeit(fn, warmup=warmup, iters=iters, device=device, stat=stat)
    peak = peak_alloc_bytes(fn) / 2**20
    return ms, peak


def bench_long(
    ns: list[int], warmup: int, iters: int, device: torch.device, stat: str
) -> list[dict]:
    """Forward (no grad) over long sequences for every kernel."""
    rows = []
    for n in ns:
        gen = torch.Generator(device=device).manual_seed(n)
        q, k, v = (
            torch.randn(1, HEADS, n, HEAD_DIM, generator=gen, device=device) for _ in range(3)
        )
        flops = 4 * HEADS * n * n * HEAD_DIM
        for kernel in KERNELS:
            if kernel == "math" and n > MATH_MAX_N:
                continue

            fn = partial(_forward, q, k, v, None, False, kernel)
            ms, peak = _measure(fn, warmup, iters, device, stat)
            rows.append(
                {
                    "case": "long",
                    "pass": "fwd",
                    "shape": f"1x{HEADS}x{n}x{HEAD_DIM}",
                    "n": n,
                    "kernel": kernel,
                    "ms": ms,
                    "gflops": flops / (ms * 1e-3) / 1e9,
                    "peak_mib": peak,
                }
            )
    return rows


def bench_temporal(
    ts: list[int], warmup: int, iters: int, device: torch.device, stat: str
) -> list[dict]:
    """Causal short sequences with a relative-position bias, forward and forward+backward."""
    rows = []
    for t in ts:
        gen = torch.Generator(device=device).manual_seed(t)
        q, k, v = (
            torch.randn(TEMPORAL_TOKENS, HEADS, t, HEAD_DIM, generator=gen, device=device)
            for _ in range(3)
        )
        bias = torch.randn(HEADS, t, t, generator=gen, device=device)
        grad_out = torch.randn_like(q)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
        for kernel in KERNELS:
            fwd = partial(_forward, q, k, v, bias, True, kernel)
            fwd_bwd = partial(_forward_backward, leaves, grad_out, True, kernel)
            for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                ms, peak = _measure(fn, warmup, iters, device, stat)
                rows.append(
                    {
                        "case": "temporal",
                        "pass": name,
                        "shape": f"{TEMPORAL_TOKENS}x{HEADS}x{t}x{HEAD_DIM}",
                        "n": t,
                        "kernel": kernel,
                        "ms": ms,
                        "peak_mib": peak,
                    }
                )
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Add time relative to sdpa and peak memory relative to math, per (case, pass, shape)."""
    ref: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        ref.setdefault((r["case"], r["pass"], r["shape"]), {})[r["kernel"]] = r
    for r in rows:
        group = ref[(r["case"], r["pass"], r["shape"])]
        r["x_sdpa_time"] = r["ms"] / group["sdpa"]["ms"] if "sdpa" in group else None
        r["x_math_mem"] = (
            r["peak_mib"] / group["math"]["peak_mib"]
            if "math" in group and group["math"]["peak_mib"] > 0
            else None
        )


def check_targets(rows: list[dict]) -> dict[str, object]:
    """Evaluate the issue's targets on whatever sizes were run."""
    long_chunked = [r for r in rows if r["case"] == "long" and r["kernel"] == "chunked"]
    ratios = {r["n"]: r["x_sdpa_time"] for r in long_chunked if r["n"] >= 4096}
    mem_8k = [r["x_math_mem"] for r in long_chunked if r["n"] == 8192]
    fastest = {}
    for r in rows:
        if r["case"] != "temporal":
            continue
        key = f"T={r['n']} {r['pass']}"
        if key not in fastest or r["ms"] < fastest[key][1]:
            fastest[key] = (r["kernel"], r["ms"])
    return {
        "chunked_over_sdpa_time_n_ge_4k": ratios or None,
        "chunked_within_1.5x_sdpa": all(x <= 1.5 for x in ratios.values()) if ratios else None,
        "chunked_over_math_mem_n8k": mem_8k[0] if mem_8k else None,
        "chunked_mem_le_5pct_math": mem_8k[0] <= 0.05 if mem_8k else None,
        "temporal_fastest": {k: v[0] for k, v in fastest.items()},
        "temporal_chunked_fastest": (
            all(v[0] == "chunked" for v in fastest.values()) if fastest else None
        ),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a minute on 2 cores)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--stat", choices=("median", "min"), default="median", help="time statistic per case"
    )
    parser.add_argument("--name", default="attention", help="results file stem")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.quick:
        ns, ts, warmup, iters = [512, 1024, 2048], [6, 16, 32], 1, 5
    else:
        ns, ts, warmup, iters = [1024, 2048, 4096, 8192, 16384], [6, 16, 32], 2, 5
    rows = bench_long(ns, warmup, iters, device, args.stat)
    rows += bench_temporal(ts, warmup, iters, device, args.stat)
    add_ratios(rows)
    print_table(rows)
    targets = check_targets(rows)
    result = {
        "quick": args.quick,
        "device": str(device),
        "time_stat": args.stat,
        "gemm_gflops_fp32": gemm_gflops(torch.float32, device=device),
        "rows": rows,
        "targets": targets,
    }
    path = save_json(args.name, result)
    print(f"targets: {targets}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
