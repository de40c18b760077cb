"""The whole quickstart training step against the bare forward+backward+AdamW step it contains.

Generates the quickstart's data (``navier_stokes_2d``, its default trajectory counts, 64x64) in a
temporary folder, then, in one process and interleaved round by round:

* a real ``train(cfg)`` run of ``experiment=quickstart`` (CSV logger, its callbacks, its
  validation), limited to ``--steps`` training batches of the first epoch; a callback records
  when each batch starts and ends and when validation runs;
* the bare step of the same model at the same batch shape: forward, MAE loss, backward and an
  AdamW step (the lower bound for a training step), timed before and after each run.

The whole step per optimiser step is the wall time from the end of the last warm-up batch to the
end of the last batch, over the steps, plus the epoch end (validation, ``best-*.ckpt`` and
``last.ckpt`` saves, measured after the last batch) amortised over the quickstart's full epoch,
which is when those happen. It splits into ``step`` (batch start to batch end: the module's
training step, backward, clipping, optimiser, logging), ``between`` (batch end to the next batch
start: loading and collating the batch, Lightning's loop, callbacks) and the amortised epoch end.
The ratio whole/bare is the figure issue 13 asks to bring to <= 1.1.

Run from the repository root::

    python -m benchmarks.train_step             # 3 rounds of 60 steps
    python -m benchmarks.train_step --quick     # 1 round of 20 steps
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from benchmarks.common import print_table, save_json
from walrus.checkpoint import build_model
from walrus.data.synthetic import generate
from walrus.training.losses import normalized_loss
from walrus.training.optim import param_groups

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DATASET = "navier_stokes_2d"


class StepTimer(pl.Callback):
    """Records ``time.perf_counter()`` at each training batch's start and end, around each
    validation run (the sanity check excluded) and when training ends."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.vals: list[tuple[float, float]] = []
        self.train_end = 0.0
        self._val_start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.ends.append(time.perf_counter())

    def on_validation_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        if not trainer.sanity_checking:
            self.vals.append((self._val_start, time.perf_counter()))

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.train_end = time.perf_counter()


def quickstart_config(data_dir: Path, out_dir: Path, steps: int) -> Any:
    """``experiment=quickstart`` on ``data_dir``: one epoch of ``steps`` batches, then validation."""
    overrides = [
        "experiment=quickstart",
        f"paths.data_dir={data_dir}",
        f"paths.output_dir={out_dir}",
        "trainer.max_epochs=1",
        f"trainer.limit_train_batches={steps}",
        f"+callbacks.step_timer._target_={StepTimer.__module__}.{StepTimer.__qualname__}",
    ]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose(config_name="train", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def whole_run(data_dir: Path, out_dir: Path, steps: int, warmup: int) -> dict[str, Any]:
    """One quickstart run: per-step wall time after ``warmup`` batches and its parts."""
    from walrus.training.train import train

    cfg = quickstart_config(data_dir, out_dir, steps)
    t0 = time.perf_counter()
    _, objects = train(cfg)
    run_s = time.perf_counter() - t0
    trainer, dm = objects["trainer"], objects["datamodule"]
    timer = next(c for c in trainer.callbacks if isinstance(c, StepTimer))
    starts, ends = timer.starts, timer.ends
    if len(ends) != steps or steps <= warmup:
        raise RuntimeError(f"expected {steps} > {warmup} timed batches, got {len(ends)}")
    val_s = sum(b - a for a, b in timer.vals)
    # the epoch ends after the last batch: validation, best-*.ckpt and last.ckpt saves
    epoch_end_s = timer.train_end - ends[-1]
    n = steps - warmup
    between = [starts[i] - ends[i - 1] for i in range(warmup, steps)]
    step = [ends[i] - starts[i] for i in range(warmup, steps)]
    epoch_batches = len(dm.train_dataloader())  # the quickstart's full epoch
    per_step = (ends[-1] - ends[warmup - 1]) / n
    batch = next(iter(dm.train_dataloader()))
    return {
        "module": objects["module"],
        "batch": batch,
        "per_step_s": per_step,
        "step_s": statistics.mean(step),
        "between_s": statistics.mean(between),
        "val_s": val_s,
        "epoch_end_s": epoch_end_s,
        "epoch_end_per_step_s": epoch_end_s / epoch_batches,
        "epoch_batches": epoch_batches,
        "run_s": run_s,
    }


def bare_step_s(module: Any, batch: Any, warmup: int, iters: int) -> float:
    """Mean seconds of forward, MAE loss, backward and AdamW step of a copy of ``module.model``
    at ``batch``'s shape (normalised inputs and targets as the module makes them)."""
    model = build_model(module.model.config.to_dict())
    model.load_state_dict(module.model.state_dict())
    model.train()
    frames = torch.cat([batch.input_fields, batch.output_fields], dim=1)  # (B, Ti+To, C, H, W)
    x, target, _ = module._targets(batch.input_fields, frames, 0, batch.metadata.get("field_names"))
    opt = torch.optim.AdamW(param_groups(model, module.weight_decay), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        normalized_loss(model(x, batch.field_ids, batch.bcs), target, "mae").backward()
        opt.step()

    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) / iters


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse arguments, run, print a table, write ``benchmarks/results/train_step.json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 20 steps")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=60, help="training batches per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed batches per run")
    parser.add_argument("--bare-iters", type=int, default=10, help="bare steps per round")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.bare_iters = 1, 20, 5
    if args.steps <= args.warmup or args.rounds < 1 or args.bare_iters < 1:
        parser.error("need --steps > --warmup, --rounds >= 1 and --bare-iters >= 1")

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="walrus-train-step-") as tmp:
        data_dir = Path(tmp) / "data"
        t0 = time.perf_counter()
        generate(DATASET, data_dir, resolution=64, progress=False)
        print(f"generated {DATASET} in {time.perf_counter() - t0:.1f} s")
        # an untimed first run supplies the model and a batch for the bare step, which is then
        # timed before and after each run (their mean is the run's bound)
        run = whole_run(data_dir, Path(tmp) / "warmup", args.warmup + 1, args.warmup)
        bare_before = bare_step_s(run["module"], run["batch"], 2, args.bare_iters)
        for r in range(args.rounds):
            run = whole_run(data_dir, Path(tmp) / f"run{r}", args.steps, args.warmup)
            bare_after = bare_step_s(run["module"], run["batch"], 2, args.bare_iters)
            bare, bare_before = (bare_before + bare_after) / 2, bare_after
            whole = run["per_step_s"] + run["epoch_end_per_step_s"]
            rows.append(
                {
                    "round": r,
                    "bare_ms": bare * 1e3,
                    "whole_ms": whole * 1e3,
                    "ratio": whole / bare,
                    "step_ms": run["step_s"] * 1e3,
                    "between_ms": run["between_s"] * 1e3,
                    "epoch_end_amortised_ms": run["epoch_end_per_step_s"] * 1e3,
                    "val_s": run["val_s"],
                    "ckpt_s": run["epoch_end_s"] - run["val_s"],
                    "epoch_batches": run["epoch_batches"],
                    "run_s": run["run_s"],
                    "load1": os.getloadavg()[0],
                }
            )
            print_table(rows[-1:])
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    shape = list(run["batch"].input_fields.shape)
    print("\nmedian over rounds:")
    print_table([med])
    path = save_json(
        "train_step",
        {
            "config": "experiment=quickstart (small, B=8, 4 input frames, 64x64, 3 fields)",
            "input_shape": shape,
            "steps_per_run": args.steps,
            "warmup": args.warmup,
            "target_ratio": 1.1,
            "median": med,
            "rounds": rows,
        },
    )
    print(f"wrote {path}")
    return med


if __name__ == "__main__":
    main()
