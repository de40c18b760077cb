"""Full-scale work accounting of one forward, on fake tensors (no real compute, no memory).

Builds a model preset (default ``walrus_1b``) and counts, for one forward under bf16 autocast on
the CPU at batch sizes 1, 2, 4 and 8: FLOPs per sample (``FlopCounterMode`` with the CPU SDPA
kernel registered, and the analytic processor count of
:func:`walrus.model.flops.processor_flops`), bytes materialised per ATen op (views
excluded) and in total, ATen calls returning tensors, and host syncs. See
:mod:`benchmarks.accounting` for the definitions. Fused and plain blocks are both counted.

Each run in the JSON lists its ten largest writers (``top_writers``: bytes written per op,
fresh and in place). ``call_breakdown`` splits calls and bytes written per op into one
processor block and the rest, at B=4 (or the largest batch). Before overwriting the results
file, the script prints the fused model's largest writers there next to the new ones and keeps
that listing as ``previous`` (the figures this run replaced).

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
import json
import math
from pathlib import Path
from typing import Any

import torch
import yaml
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks.accounting import OpStat, Report, account
from benchmarks.common import RESULTS_DIR, print_table, save_json
from walrus.bcs import BoundaryType
from walrus.data.batch import Batch
from walrus.model.flops import processor_flops
from walrus.model.jitter import JitterDraws
from walrus.model.walrus import Walrus
from walrus.training.module import WalrusModule

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"
REFERENCE = {"tflop_per_sample": 13.32, "gb": 208.1, "calls": 4312, "syncs": 5}
TARGETS = {"gb": 73.0, "calls": 1400, "syncs": 0, "flops_rel": 0.03}
TOP = 10  # largest writers listed per run


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
    table_b = 4 if 4 in batches else batches[-1]
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
            writers = r.top(TOP)
            runs.append(
                {**row, "syncs": r.syncs, "top_writers": writers, "ops": r.to_dict()["ops"]}
            )
            if b == table_b:
                top[f"fused={fused}"] = writers
    breakdown = {}
    for fused in (True, False):
        breakdown[f"fused={fused}"] = call_breakdown(cfg, fused, table_b, args)
    print(f"{args.preset}: {tuple(args.grid)} grid, T={args.frames}, bf16 autocast, forward")
    print("FLOPs: 'stock' = FlopCounterMode with the CPU SDPA kernel registered (the reference's")
    print("method, in-place GEMMs count zero); 'complete' adds the in-place GEMMs (addmm_).")
    print_table(rows)
    for name, t in top.items():
        print(f"\nlargest writers (GB written), {name}, B={table_b}:")
        print_table(t)
    for name, bd in breakdown.items():
        print(f"\nATen calls per op, {name}: {bd['per_block_total']} per block x {cfg['depth']}")
        print(f"+ {bd['outside_total']} outside the blocks (embedding, encoder, decoder, jitter);")
        print(f"GB written at B={bd['B']}: {bd['per_block_GB']:.3g} per block, that is")
        print(f"{bd['per_block_token_matrices']:.3g} bf16 token matrices (B*T*S, C);", end=" ")
        print(f"{bd['outside_GB']:.3g} outside the blocks")
        print_table(bd["table"])
    results_dir = Path(args.results_dir) if args.results_dir else RESULTS_DIR
    previous = previous_writers(results_dir / "scale.json", args, table_b)
    if previous is not None:
        now = next(r for r in runs if r["fused"] and r["B"] == table_b)
        print(f"\nlargest writers, fused=True, B={table_b}: the results file this run replaces")
        print(f"({previous['time']}: {previous['written_GB']:.3g} GB written) and now")
        print(f"({now['written_GB']:.3g} GB written):")
        print_table(compare_writers(previous["top_writers"], now["ops"]))
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
            "previous": previous,
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
    """ATen calls and bytes written per op, per processor block and outside the blocks.

    Counts a 1-block and a 2-block copy of the preset at batch ``b`` (calls and bytes do not
    depend on the depth otherwise): the difference is one block, the rest is the embedding,
    encoder, decoder and jitter. ``per_block_token_matrices`` is the bytes written per block
    in units of one bf16 token matrix ``(B*T*S, C)``.
    """
    hists, models = [], []
    for depth in (1, 2):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = fake_model({**cfg, "depth": depth}, mode)
        model.set_fused(fused)
        with mode:
            r = _count(model, b, args)
        hists.append({k: (v.calls, v.bytes + v.inplace_bytes) for k, v in r.ops.items()})
        models.append(model)
    one, two = hists
    ops = sorted(set(one) | set(two))
    zero = (0, 0)
    block = {k: [y - x for x, y in zip(one.get(k, zero), two.get(k, zero))] for k in ops}
    outside = {k: [x - y for x, y in zip(one.get(k, zero), block[k])] for k in ops}
    table = [
        {
            "op": k,
            "per_block": block[k][0],
            "outside": outside[k][0],
            "per_block_GB": block[k][1] / 1e9,
            "outside_GB": outside[k][1] / 1e9,
        }
        for k in sorted(ops, key=lambda k: (-block[k][0], -outside[k][0], -block[k][1], k))
        if any(block[k]) or any(outside[k])
    ]
    per_block_bytes = sum(v[1] for v in block.values())
    tokens = b * args.frames * _latent_tokens(models[0], args.grid)
    return {
        "B": b,
        "per_block_total": sum(v[0] for v in block.values()),
        "outside_total": sum(v[0] for v in outside.values()),
        "per_block_GB": per_block_bytes / 1e9,
        "outside_GB": sum(v[1] for v in outside.values()) / 1e9,
        "per_block_token_matrices": per_block_bytes / (tokens * models[0].dim * 2),
        "table": table,
    }


def previous_writers(path: Path, args: argparse.Namespace, b: int) -> dict[str, Any] | None:
    """The fused model's largest writers at batch ``b`` in an earlier ``scale.json``.

    ``None`` when there is no such file, it is not valid JSON, or it counted another preset,
    grid or frame count, or not batch ``b``. Files written before ``top_writers`` existed
    are ranked from their per-op totals.
    """
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    same = (old.get("preset"), old.get("grid"), old.get("frames"))
    if same != (args.preset, list(args.grid), args.frames):
        return None
    run = next((r for r in old.get("runs", []) if r.get("fused") and r.get("B") == b), None)
    if run is None or "ops" not in run:
        return None
    writers = run.get("top_writers") or _rank(run["ops"])
    return {
        "time": old.get("environment", {}).get("time"),
        "B": b,
        "written_GB": run.get("written_GB"),
        "calls": run.get("calls"),
        "top_writers": writers,
    }


def _rank(ops: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """``top_writers`` rows (:meth:`Report.top`) from the per-op totals of a JSON run."""
    return Report(ops={k: OpStat(**v) for k, v in ops.items()}).top(TOP)


def compare_writers(
    before: list[dict[str, Any]], now_ops: dict[str, dict[str, int]]
) -> list[dict[str, Any]]:
    """Rows ``op, before_GB, now_GB, change_GB`` over the earlier largest writers ``before``
    and the new run's (``now_ops``: its per-op totals), largest now first."""

    def now(op: str) -> float:
        v = now_ops.get(op)
        return 0.0 if v is None else (v["bytes"] + v["inplace_bytes"]) / 1e9

    old = {w["op"]: w["written_GB"] for w in before}
    ops = dict.fromkeys([w["op"] for w in _rank(now_ops)] + list(old))
    rows = [
        {
            "op": k,
            "before_GB": old.get(k),
            "now_GB": now(k),
            "change_GB": now(k) - old[k] if k in old else None,
        }
        for k in ops
    ]
    return sorted(rows, key=lambda r: -r["now_GB"])


def _latent_tokens(model: Walrus, grid: list[int]) -> int:
    sizes = [g for g in grid if g > 1]
    strides = model._pick_strides(sizes + [1] * (3 - len(sizes)), len(grid))
    return math.prod(math.ceil(n / (s1 * s2)) for n, (s1, s2) in zip(sizes, strides))


if __name__ == "__main__":
    main()
