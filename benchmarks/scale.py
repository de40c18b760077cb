"""Full-scale work accounting of one forward, on fake tensors (no real compute, no memory).

Builds a model preset (default ``walrus_1b``) and counts, for one forward under bf16 autocast on
the CPU at batch sizes 1, 2, 4 and 8: FLOPs per sample (``FlopCounterMode`` with the CPU SDPA
kernel registered, and the analytic processor count), bytes materialised per ATen op (views
excluded) and in total, ATen calls returning tensors, and host syncs. See
:mod:`benchmarks.accounting` for the definitions. Fused and plain blocks are both counted.

Run from the repository root::

    python -m benchmarks.scale                 # walrus_1b, 2D 128x128, T=6, B=1,2,4,8
    python -m benchmarks.scale --quick         # B=4 only
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
import yaml
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks.accounting import Report, account, analytic_processor_flops
from benchmarks.common import print_table, save_json
from walrus.bcs import BoundaryType
from walrus.model.walrus import Walrus

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"
REFERENCE = {"tflop_per_sample": 13.32, "gb": 208.1, "calls": 4312, "syncs": 5}
TARGETS = {"gb": 73.0, "calls": 1400, "syncs": 0, "flops_rel": 0.03}


def load_preset(name: str) -> dict[str, Any]:
    """Constructor kwargs of ``configs/model/<name>.yaml``.

    Raises:
        FileNotFoundError: no such preset.
    """
    path = CONFIGS / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"model preset {name!r} not found: {path} does not exist")
    cfg = yaml.safe_load(path.read_text())
    cfg.pop("_target_", None)
    return cfg


def fake_model(cfg: dict[str, Any], mode: FakeTensorMode) -> Walrus:
    """The model with fake parameters (built on ``meta``, so no init compute)."""
    with torch.device("meta"):
        model = Walrus(**cfg).eval()
    with mode:
        return model.to_empty(device="cpu")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse arguments, count, print tables, write ``benchmarks/results/scale.json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="walrus_1b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--frames", type=int, default=6)
    parser.add_argument("--grid", type=int, nargs="+", default=[128, 128])
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="B=4 only")
    parser.add_argument("--grad", action="store_true", help="count with autograd recording")
    parser.add_argument("--results-dir", default=None, help="default: benchmarks/results")
    args = parser.parse_args(argv)
    if not 1 <= len(args.grid) <= 3 or min(args.grid) < 1:
        raise ValueError(f"--grid must give 1-3 positive sizes, got {args.grid}")
    batches = [4] if args.quick else args.batches
    cfg = load_preset(args.preset)

    rows, runs, top = [], [], {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = fake_model(cfg, mode)
    for fused in (True, False):
        model.set_fused(fused)
        for b in batches:
            with mode:
                r = _count(model, b, args)
            latent = _latent_tokens(model, args.grid)
            analytic = analytic_processor_flops(
                model.dim, model.depth, model.mlp_dim, args.frames, latent
            )
            row = {
                "fused": fused,
                "B": b,
                "TFLOP/sample_stock": r.flops_stock / b / 1e12,
                "vs_ref_13.32": r.flops_stock / b / 1e12 / REFERENCE["tflop_per_sample"] - 1,
                "TFLOP/sample_complete": r.flops / b / 1e12,
                "analytic_proc_T": analytic / 1e12,
                "GB": r.materialised_bytes / 1e9,
                "inplace_GB": r.inplace_bytes / 1e9,
                "calls": r.calls,
                "host_calls": r.host_calls,
                "syncs": len(r.syncs),
            }
            rows.append(row)
            runs.append({**row, "syncs": r.syncs, "ops": r.to_dict()["ops"]})
            if b == batches[-1] or b == 4:
                top[f"fused={fused}"] = r.top(12)
    breakdown = {}
    for fused in (True, False):
        breakdown[f"fused={fused}"] = call_breakdown(cfg, fused, batches[0], args)
    print(f"{args.preset}: {tuple(args.grid)} grid, T={args.frames}, bf16 autocast, forward")
    print("FLOPs: 'stock' = FlopCounterMode with the CPU SDPA kernel registered (the reference's")
    print("method, in-place GEMMs count zero); 'complete' adds the in-place GEMMs (addmm_).")
    print_table(rows)
    for name, t in top.items():
        print(f"\nlargest writers, {name}:")
        print_table(t)
    for name, bd in breakdown.items():
        print(f"\nATen calls per op, {name}: {bd['per_block_total']} per block x {cfg['depth']}")
        print(f"+ {bd['outside_total']} outside the blocks (embedding, encoder, decoder, jitter)")
        print_table(bd["table"])
    path = save_json(
        "scale",
        {
            "preset": args.preset,
            "grid": args.grid,
            "frames": args.frames,
            "grad": args.grad,
            "reference": REFERENCE,
            "targets_at_B4": TARGETS,
            "runs": runs,
            "call_breakdown": breakdown,
        },
        args.results_dir,
    )
    print(f"\nwrote {path}")
    return {"rows": rows}


def _count(model: Walrus, b: int, args: argparse.Namespace) -> Report:
    x = torch.empty(b, args.frames, args.channels, *args.grid)
    bcs = [[int(BoundaryType.PERIODIC)] * 2] * len(args.grid)
    with torch.utils._python_dispatch._disable_current_modes():
        fields = torch.arange(args.channels)  # a real host tensor, as in a real run

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(args.grad):
            model(x, fields, bcs)

    account(run)  # warm the per-grid caches
    return account(run)


def call_breakdown(
    cfg: dict[str, Any], fused: bool, b: int, args: argparse.Namespace
) -> dict[str, Any]:
    """ATen calls per op, per processor block and outside the blocks.

    Counts a 1-block and a 2-block copy of the preset (calls do not depend on the depth
    otherwise): the difference is one block, the rest is the embedding, encoder, decoder and
    jitter.
    """
    hists = []
    for depth in (1, 2):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = fake_model({**cfg, "depth": depth}, mode)
        model.set_fused(fused)
        with mode:
            r = _count(model, b, args)
        hists.append({k: v.calls for k, v in r.ops.items()})
    one, two = hists
    ops = sorted(set(one) | set(two))
    block = {k: two.get(k, 0) - one.get(k, 0) for k in ops}
    outside = {k: one.get(k, 0) - block[k] for k in ops}
    table = [
        {"op": k, "per_block": block[k], "outside": outside[k]}
        for k in sorted(ops, key=lambda k: (-block[k], -outside[k], k))
        if block[k] or outside[k]
    ]
    return {
        "per_block_total": sum(block.values()),
        "outside_total": sum(outside.values()),
        "table": table,
    }


def _latent_tokens(model: Walrus, grid: list[int]) -> int:
    sizes = [g for g in grid if g > 1]
    strides = model._pick_strides(sizes + [1] * (3 - len(sizes)), len(grid))
    return math.prod(math.ceil(n / (s1 * s2)) for n, (s1, s2) in zip(sizes, strides))


if __name__ == "__main__":
    main()
