"""Full-scale work accounting of one forward, on fake tensors (no real compute, no memory).

Builds a model preset (default ``walrus_1b``) and counts, for one forward under bf16 autocast on
the CPU at batch sizes 1, 2, 4 and 8: FLOPs per sample (``FlopCounterMode`` with the CPU SDPA
kernel registered, and the analytic processor count of
:func:`walrus.model.flops.processor_flops`), bytes materialised per ATen op (views
excluded) and in total, ATen calls returning tensors, and host syncs. See
:mod:`benchmarks.accounting` for the definitions. Fused and plain blocks are both counted.

Run from the repository root::

    python -m benchmarks.scale                 # walrus_1b, 2D 128x128, T=6, B=1,2,4,8
    python -m benchmarks.scale --quick         # B=4 only
    python -m benchmarks.scale --train-step    # a full training step instead (see below)

``--train-step`` counts one training step per batch size instead of the forward, as ``trainer=gpu`` runs it: the
LightningModule's ``training_step`` (normalisation, forward under bf16 autocast with activation
checkpointing, loss, the deferred non-finite check), backward, the gradient norm it logs,
gradient clipping and an AdamW step. The optimizer's step counters are host tensors, as
they are on a GPU (non-capturable AdamW), so reading them is no sync. The bar is 0 syncs.
It writes ``benchmarks/results/scale_train_step.json``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
import yaml
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks.accounting import Report, account
from benchmarks.common import print_table, save_json
from walrus.bcs import BoundaryType
from walrus.data.batch import Batch
from walrus.model.flops import processor_flops
from walrus.model.jitter import JitterDraws
from walrus.model.walrus import Walrus
from walrus.training.module import WalrusModule

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
    parser.add_argument("--train-step", action="store_true", help="count a training step")
    parser.add_argument("--results-dir", default=None, help="default: benchmarks/results")
    args = parser.parse_args(argv)
    if not 1 <= len(args.grid) <= 3 or min(args.grid) < 1:
        raise ValueError(f"--grid must give 1-3 positive sizes, got {args.grid}")
    batches = [4] if args.quick else args.batches
    cfg = load_preset(args.preset)
    if args.train_step:
        return _main_train_step(cfg, batches, args)

    rows, runs, top = [], [], {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = fake_model(cfg, mode)
    for fused in (True, False):
        model.set_fused(fused)
        for b in batches:
            with mode:
                r = _count(model, b, args)
            latent = _latent_tokens(model, args.grid)
            analytic = processor_flops(model.dim, model.depth, model.mlp_dim, args.frames, latent)
            row = {
                "fused": fused,
                "B": b,
                "TFLOP/sample_stock": r.flops_stock / b / 1e12,
                "vs_ref_13.32": r.flops_stock / b / 1e12 / REFERENCE["tflop_per_sample"] - 1,
                "TFLOP/sample_complete": r.flops / b / 1e12,
                "analytic_proc_T": analytic / 1e12,
                "GB": r.materialised_bytes / 1e9,
                "inplace_GB": r.inplace_bytes / 1e9,
                "written_GB": (r.materialised_bytes + r.inplace_bytes) / 1e9,
                "calls": r.calls,
                "host_calls": r.host_calls,
                "syncs": len(r.syncs),
            }
            rows.append(row)
            runs.append({**row, "syncs": r.syncs, "ops": r.to_dict()["ops"]})
            if b == (4 if 4 in batches else batches[-1]):  # the table at B=4
                top[f"fused={fused}"] = r.top(12)
    breakdown = {}
    for fused in (True, False):
        breakdown[f"fused={fused}"] = call_breakdown(cfg, fused, batches[0], args)
    print(f"{args.preset}: {tuple(args.grid)} grid, T={args.frames}, bf16 autocast, forward")
    print("FLOPs: 'stock' = FlopCounterMode with the CPU SDPA kernel registered (the reference's")
    print("method, in-place GEMMs count zero); 'complete' adds the in-place GEMMs (addmm_).")
    print_table(rows)
    for name, t in top.items():
        print(f"\nlargest writers (GB written), {name}, B={4 if 4 in batches else batches[-1]}:")
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


def _main_train_step(cfg: dict[str, Any], batches: list[int], args: argparse.Namespace) -> dict:
    rows = [train_step_row(cfg, b, args) for b in batches]
    print(f"{args.preset}: {tuple(args.grid)} grid, T={args.frames}, one training step")
    print("(training_step under bf16 autocast, checkpointed blocks, backward, grad norm, clip,")
    print("AdamW; FLOPs complete as for the forward)")
    print_table([{k: v for k, v in r.items() if k != "sync_list"} for r in rows])
    path = save_json(
        "scale_train_step",
        {"preset": args.preset, "grid": args.grid, "frames": args.frames, "runs": rows},
        args.results_dir,
    )
    print(f"\nwrote {path}")
    return {"train_step": rows}


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


class HostDraws(JitterDraws):
    """Jitter draws from a CPU generator, drawn outside the fake mode: in a real run they are
    host work (no device tensor), which a fake mode would otherwise turn into fake ``.item()``."""

    def randint(self, low: int, high: int) -> int:
        with torch.utils._python_dispatch._disable_current_modes():
            return super().randint(low, high)


def host_adamw(params: list[torch.Tensor], **kwargs: Any) -> torch.optim.AdamW:
    """AdamW with its state made up front: moments like the parameters (fake under a fake
    mode), step counters as real host tensors (where a non-capturable AdamW keeps them)."""
    opt = torch.optim.AdamW(params, **kwargs)
    for p in params:
        with torch.utils._python_dispatch._disable_current_modes():
            step = torch.tensor(0.0)
        opt.state[p] = {
            "step": step,
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    return opt


def training_step(
    module: WalrusModule, optimizer: torch.optim.Optimizer, batch: Batch, clip: float = 1.0
) -> None:
    """One training step as Lightning runs it with ``gradient_clip_val`` and bf16-mixed."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = module.training_step(batch, 0)
    loss.backward()
    module.on_before_optimizer_step(optimizer)
    torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def fake_batch(b: int, frames: int, channels: int, grid: list[int]) -> Batch:
    """A batch of fake frames (call inside the fake mode) with host ``field_ids`` and ``bcs``."""
    x = torch.empty(b, frames + 1, channels, *grid)
    with torch.utils._python_dispatch._disable_current_modes():
        fields = torch.arange(channels)
        bcs = torch.full((len(grid), 2), int(BoundaryType.PERIODIC))
    return Batch(x[:, :frames], x[:, frames:], fields, bcs, {"dataset": "fake"})


def train_step_row(cfg: dict[str, Any], b: int, args: argparse.Namespace) -> dict[str, Any]:
    """Counts of one training step (after a warm-up step) at batch ``b``."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    n_sp = len(args.grid)
    model = fake_model({**cfg, "include_d": [n_sp], "grad_checkpointing": True}, mode).train()
    model._draws = HostDraws(torch.Generator().manual_seed(0))
    module = WalrusModule(model, optimizer=None)
    with mode:
        opt = host_adamw(list(model.parameters()), lr=1e-4, weight_decay=0.05)
        batch = fake_batch(b, args.frames, args.channels, args.grid)
        account(lambda: training_step(module, opt, batch))  # warm the per-grid caches
        r = account(lambda: training_step(module, opt, batch))
    return {
        "B": b,
        "TFLOP/sample": r.flops / b / 1e12,
        "GB": r.materialised_bytes / 1e9,
        "inplace_GB": r.inplace_bytes / 1e9,
        "calls": r.calls,
        "host_calls": r.host_calls,
        "syncs": len(r.syncs),
        "sync_list": r.syncs,
    }


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
