"""The patch model's folded field embedding against embedding first, at the quickstart shape.

`small` (patch encoder) normally folds the field embedding, boundary tokens and bias into its
first patch GEMM (``Walrus.embedding_folded``). This script times the bare training step
(forward, MAE loss, backward, AdamW) and the inference forward of the same model with the fold
and with it switched off (embedding applied to every point first, as while input dropout is
active), interleaved round by round in one process, and reports the median ratio::

    python -m benchmarks.studies.fold_embedding            # 5 rounds
    python -m benchmarks.studies.fold_embedding --rounds 1 --iters 3

Writes ``benchmarks/results/fold_embedding.json`` with the machine's load average.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import OmegaConf

from benchmarks.common import print_table
from benchmarks.record import finish_record, run_record, save_result
from walrus.checkpoint import build_model

MODEL = Path(__file__).resolve().parents[2] / "configs" / "model" / "small.yaml"
# experiment=quickstart: batch 8, 4 input frames, navier_stokes_2d (3 fields, periodic 64^2)
B, T, C, H, W = 8, 4, 3, 64, 64


def _seconds(fn: Callable[[], object], iters: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def main(argv: list[str] | None = None) -> None:
    record = run_record(sys.argv if argv is None else ["fold_embedding", *argv])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5, help="timed steps per variant and round")
    args = parser.parse_args(argv)
    cfg = OmegaConf.to_container(OmegaConf.load(MODEL))
    cfg.pop("_target_")
    cfg["include_d"] = [2]  # training builds the data's set only
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(B, T, C, H, W)  # (B, T, C, H, W)
    fields, bcs = torch.arange(C), torch.full((2, 2), 2)

    def train_step() -> None:
        model.train()
        model(x, fields, bcs).abs().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def forward() -> None:
        model.eval()
        with torch.inference_mode():
            model(x, fields, bcs, jitter_seed=0)

    rows = []
    for r in range(args.rounds):
        row: dict[str, float | int] = {"round": r}
        for folded in (True, False):
            model.__dict__.pop("embedding_folded", None)  # the class's method: fold
            if not folded:
                model.embedding_folded = lambda: False  # embedding first, as with input dropout
            tag = "folded" if folded else "embed_first"
            row[f"train_{tag}_ms"] = _seconds(train_step, args.iters) * 1e3
            row[f"fwd_{tag}_ms"] = _seconds(forward, args.iters) * 1e3
        row["train_speedup"] = row["train_embed_first_ms"] / row["train_folded_ms"]
        row["fwd_speedup"] = row["fwd_embed_first_ms"] / row["fwd_folded_ms"]
        rows.append(row)
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    print_table(rows)
    print("median:")
    print_table([median])
    save_result(
        "fold_embedding",
        {
            "shape": {"B": B, "T": T, "C": C, "H": H, "W": W},
            "rounds": rows,
            "median": median,
            "record": finish_record(record),
        },
    )


if __name__ == "__main__":
    main()
