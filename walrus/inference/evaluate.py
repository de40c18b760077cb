"""``run_evaluate(cfg)``: one-step errors of a checkpoint over every window of a split.

A window is ``n_steps_input`` context frames and the frame after them, from any start in any
trajectory (the data's time stride apart). The model predicts that frame once (no feedback),
and the errors of the model and of persistence are averaged over all windows.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from omegaconf import DictConfig

from walrus.data.well_dataset import WellDataset, evenly_spaced
from walrus.errors import CommandInterrupted
from walrus.inference.loading import build_trainer, positive_int, prepare
from walrus.inference.report import format_evaluate_table, write_json_atomic
from walrus.inference.rollout_module import (
    DatasetPlan,
    JobDataModule,
    JobDataset,
    RolloutModule,
    make_jobs,
)
from walrus.signals import check_stop

# Windows of one dataset evaluate scores when max_windows is null (docs/guide/inference.md).
MAX_EVALUATE_WINDOWS = 1_000_000


def run_evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Score one-step predictions over a split and write ``metrics.json``.

    Options (``configs/infer.yaml``): ``ckpt_path``, ``data``, ``split``, ``max_windows``
    (evenly spaced windows kept per dataset; ``null`` keeps all), ``batch_size``, ``jitter``, ``ensemble``,
    ``seed``, ``bf16``, ``out``, ``trainer``.

    Returns:
        On global rank 0: ``{"metrics": <metrics.json content>, "files": [path]}``; on other
        ranks an empty dict.
    """
    max_windows = positive_int(cfg, "max_windows", allow_null=True)
    prep = prepare(cfg, n_steps_output=1, plan=partial(_windows, max_windows))
    windows = prep.plan
    plans = {ds.dataset: DatasetPlan(ds.dataset, tuple(ds.field_names), 1) for ds in prep.datasets}
    jobs = make_jobs(windows, prep.batch_size)
    module = RolloutModule.from_prepared(prep, plans, keep_predictions=False)
    trainer = build_trainer(cfg)
    loaders = {ds.dataset: ds.__getitem__ for ds in prep.datasets}
    try:
        trainer.test(module, datamodule=JobDataModule(JobDataset(jobs, loaders)), verbose=False)
    except CommandInterrupted as e:  # within one model call of the signal
        raise CommandInterrupted(e.signum, f"evaluate wrote no result file to {prep.out}") from None
    check_stop(f"evaluate wrote no result file to {prep.out}")
    module.gather()
    if not trainer.is_global_zero:
        return {}

    notes = [
        f"{d['dataset']}: windows of trajectories {d['trajectories']} (starts {d['start']}) gave "
        f"NaN/Inf in {d['fields']}; left out of the averages"
        for d in module.diverged
    ]
    report: dict[str, Any] = {
        "command": "evaluate",
        "checkpoint": str(prep.ckpt.path),
        "split": str(cfg.split),
        "n_steps_input": prep.data["n_steps_input"],
        "time_stride": prep.data["time_stride"],
        **prep.settings(),
        "notes": notes,
        "datasets": {
            name: {"windows": len(idx), "metrics": module.metrics[name].to_dict()}
            for name, idx in windows.items()
        },
    }
    path = write_json_atomic(prep.out / "metrics.json", report)
    for note in notes:
        print(f"note: {note}")
    for name, entry in report["datasets"].items():
        print(format_evaluate_table(name, entry["metrics"], entry["windows"]))
    print(f"wrote {path}")
    check_stop(f"after writing {path} (complete)")
    return {"metrics": report, "files": [path]}


def _windows(max_windows: int | None, data: dict[str, Any], datasets: list[WellDataset]) -> dict:
    """The windows scored per dataset (evenly spaced, at most ``max_windows``), checked
    before anything is written: without ``max_windows`` a split may hold at most
    ``MAX_EVALUATE_WINDOWS``."""
    for ds in datasets:
        if max_windows is None and len(ds) > MAX_EVALUATE_WINDOWS:
            raise ValueError(
                f"dataset {ds.dataset!r} has {len(ds)} windows in this split; evaluate scores at "
                f"most {MAX_EVALUATE_WINDOWS} unless asked: pass max_windows=N"
            )
    return {ds.dataset: evenly_spaced(len(ds), max_windows) for ds in datasets}
