"""``run_rollout(cfg)``, the ``infer.py rollout`` command: roll a checkpoint out over trajectories and report how far it stays right.

Frames of a trajectory are counted at the data's time stride. The model gets frames
``start .. start + n_steps_input - 1`` as context and predicts the following ``steps`` frames
autoregressively; each is scored against the ground truth, and so is persistence (the last
context frame repeated).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from walrus.data.batch import Batch
from walrus.data.well_dataset import WellDataset
from walrus.errors import CommandInterrupted
from walrus.inference.loading import build_trainer, positive_int, prepare, select_trajectories
from walrus.inference.report import format_rollout_table, write_json_atomic, write_predictions
from walrus.inference.rollout_module import (
    DatasetPlan,
    JobDataModule,
    JobDataset,
    RolloutModule,
    make_jobs,
)
from walrus.safe_paths import make_dirs
from walrus.signals import check_stop


def load_rollout_sample(
    ds: WellDataset, index: int, *, start: int, n_steps_input: int, steps: int, stride: int
) -> Batch:
    """Trajectory ``index`` as a rollout sample; reads only the frames it holds.

    Returns:
        ``Batch`` with ``input_fields (1, n_steps_input, C, *sp)`` (frames ``start ..``) and
        ``output_fields (1, steps, C, *sp)`` (the frames to predict).
    """
    return ds.trajectory(index, stride=stride, n_frames=n_steps_input + steps, start=start)


def run_rollout(cfg: DictConfig) -> dict[str, Any]:
    """Roll out every selected trajectory, then write metrics, predictions and plots.

    Options (``configs/infer.yaml``): ``ckpt_path``, ``data``, ``split``, ``trajectories``,
    ``start``, ``steps``, ``batch_size``, ``jitter``, ``ensemble``, ``seed``, ``bf16``, ``save_predictions``,
    ``save_members``, ``plots``, ``progress``, ``out``, ``trainer``.

    What is stored: ``predictions.hdf5`` holds one prediction per trajectory, the deterministic
    rollout (``ensemble=1``) or an ensemble's mean with each field's spread beside it
    (``<field>_spread``); ``save_members=true`` adds every member in ``members.hdf5``. The
    ensemble scores (spread-skill ratio, CRPS, rank histograms) are in ``metrics.json`` either way.

    Returns:
        On global rank 0: ``{"metrics": <metrics.json content>, "files": [written paths],
        "notes": [messages]}``; on other ranks an empty dict.
    """
    steps = positive_int(cfg, "steps", allow_null=True)
    start = positive_int(cfg, "start", minimum=0)
    save_members = cfg.get("save_members", False)
    if not isinstance(save_members, bool):
        raise ValueError(f"option save_members must be true or false, got {save_members!r}")
    if save_members and positive_int(cfg, "ensemble") < 2:
        raise ValueError(
            "option save_members=true needs ensemble=2 or more (one member is the "
            "predictions.hdf5 of a plain rollout)"
        )
    prep = prepare(
        cfg, n_steps_output=0, plan=partial(_plan, cfg.trajectories, steps=steps, start=start)
    )
    n_in, stride = prep.data["n_steps_input"], prep.data["time_stride"]
    plans, selected, notes = prep.plan

    jobs = make_jobs(selected, prep.batch_size)
    loaders = {
        ds.dataset: partial(
            load_rollout_sample,
            ds,
            start=start,
            n_steps_input=n_in,
            steps=plans[ds.dataset].steps,
            stride=stride,
        )
        for ds in prep.datasets
    }
    module = RolloutModule.from_prepared(
        prep,
        plans,
        keep_predictions=bool(cfg.save_predictions or cfg.plots),
        keep_members=save_members,
        progress=bool(cfg.progress),
        job_steps=[plans[name].steps for name, _ in jobs],
    )
    trainer = build_trainer(cfg)
    try:
        trainer.predict(
            module, datamodule=JobDataModule(JobDataset(jobs, loaders)), return_predictions=False
        )
    except CommandInterrupted as e:  # within one model call of the signal
        raise CommandInterrupted(e.signum, f"rollout wrote no result file to {prep.out}") from None
    finally:
        module.on_predict_end()  # the progress bar
    check_stop(f"rollout wrote no result file to {prep.out}")
    module.gather()
    if not trainer.is_global_zero:
        return {}

    for d in module.diverged:
        notes.append(
            f"{d['dataset']}: trajectories {d['trajectories']} diverged at step {d['step']} "
            f"(NaN/Inf in {d['fields']}); kept the {d['step'] - 1} steps before it"
        )
    report: dict[str, Any] = {
        "command": "rollout",
        "checkpoint": str(prep.ckpt.path),
        "split": str(cfg.split),
        "start": start,
        "steps_requested": steps,
        "n_steps_input": n_in,
        "time_stride": stride,
        **prep.settings(),
        "notes": notes,
        "datasets": {},
    }
    many = len(prep.datasets) > 1
    for ds in prep.datasets:
        name = ds.dataset
        report["datasets"][name] = {
            "trajectories": selected[name],
            "steps": plans[name].steps,
            "diverged": [d for d in module.diverged if d["dataset"] == name],
            "files_dir": str(prep.folders[name] if many else prep.out),
            "metrics": module.metrics[name].to_dict(),
        }
    files = [write_json_atomic(prep.out / "metrics.json", report)]
    for ds in prep.datasets:
        files += _write_dataset_files(
            cfg, ds, module, report, selected[ds.dataset], start, n_in, stride, notes, prep.out
        )
    if notes:
        write_json_atomic(prep.out / "metrics.json", report)
    for note in notes:
        print(f"note: {note}")
    for name, entry in report["datasets"].items():
        if entry["metrics"]["steps"]:
            print(format_rollout_table(name, entry["metrics"]))
    print(f"wrote {', '.join(str(f) for f in files)}")
    check_stop(f"after writing the results to {prep.out} (every file listed is complete)")
    return {"metrics": report, "files": files, "notes": notes}


def _plan(
    trajectories: Any,
    data: dict[str, Any],
    datasets: list[WellDataset],
    *,
    steps: int | None,
    start: int,
) -> tuple[dict[str, DatasetPlan], dict[str, list[int]], list[str]]:
    """The trajectories and steps of each dataset, checked before anything is written.

    Returns:
        ``(plans, selected trajectories, notes)``, each by dataset name (notes: a list).
    """
    n_in, stride = data["n_steps_input"], data["time_stride"]
    plans: dict[str, DatasetPlan] = {}
    selected: dict[str, list[int]] = {}
    notes: list[str] = []
    for ds in datasets:
        sel = select_trajectories(trajectories, ds.n_trajectories, ds.dataset)
        lengths = {i: ds.frames_available(i, stride) for i in sel}
        shortest = min(sel, key=lambda i: lengths[i])
        avail = lengths[shortest] - start - n_in
        if avail < 1:
            fix = (
                f"lower start (at most {lengths[shortest] - n_in - 1})"
                if lengths[shortest] > n_in
                else "pick longer trajectories or a smaller data.time_stride"
            )
            raise ValueError(
                f"dataset {ds.dataset!r}: trajectory {shortest} has {lengths[shortest]} frames at "
                f"time stride {stride}; start={start} plus {n_in} context frames leaves nothing "
                f"to predict; {fix}"
            )
        n_steps = avail if steps is None else min(steps, avail)
        if steps is not None and steps > avail:
            notes.append(
                f"{ds.dataset}: asked for {steps} steps, but the ground truth ends after {avail} "
                f"(trajectory {shortest} has {lengths[shortest]} frames, start={start}, {n_in} "
                f"context frames); rolled out {avail} steps"
            )
        plans[ds.dataset] = DatasetPlan(ds.dataset, tuple(ds.field_names), n_steps)
        selected[ds.dataset] = sel
    return plans, selected, notes


def _write_dataset_files(
    cfg: DictConfig,
    ds: WellDataset,
    module: RolloutModule,
    report: dict[str, Any],
    sel: list[int],
    start: int,
    n_in: int,
    stride: int,
    notes: list[str],
    top: Path,
) -> list[Path]:
    """predictions.hdf5 (members.hdf5) and the plots of one dataset (vrmse.png, spectral.png,
    fidelity.png, fidelity_fields.png, rank_histogram.png for an ensemble, snapshots.png,
    rollout.gif or .mp4) in ``top`` or its folder there; appends to ``notes`` what was
    skipped."""
    from walrus.metrics import ENSEMBLE
    from walrus.viz import (
        plot_error_curves,
        plot_fidelity,
        plot_fidelity_fields,
        plot_rank_histogram,
        plot_snapshots,
        write_animation,
    )

    name = ds.dataset
    entry = report["datasets"][name]
    out = Path(entry["files_dir"])
    files: list[Path] = []
    preds = [module.predictions[(name, i)] for i in sel] if module.keep_predictions else []
    done = min((p.shape[0] for p in preds), default=0)
    spreads = [module.spreads.get((name, i)) for i in sel] if module.members > 1 else []
    spreads = spreads if spreads and all(sp is not None for sp in spreads) else None
    writes = (cfg.save_predictions and done >= 1) or (cfg.plots and entry["metrics"]["steps"])
    if out != top and writes:
        make_dirs(top, out.name)  # a real folder inside out=, never through a planted link
    if cfg.save_predictions:
        if done >= 1:
            files.append(
                write_predictions(
                    out / "predictions.hdf5",
                    ds,
                    [p[:done] for p in preds],
                    sel[0],
                    start + n_in,
                    stride,
                    spreads=None if spreads is None else [sp[:done] for sp in spreads],
                )
            )
            entry["predictions"] = {"file": "predictions.hdf5", "trajectories": sel, "steps": done}
            if done < entry["steps"]:
                notes.append(
                    f"{name}: predictions.hdf5 holds the first {done} steps, the ones every "
                    "selected trajectory completed"
                )
        else:
            notes.append(f"{name}: no finite prediction to store; predictions.hdf5 not written")
    member_preds = (
        [module.member_predictions[(name, i)] for i in sel] if module.keep_members else []
    )
    member_done = min((p.shape[1] for p in member_preds), default=0)  # each (K, S_done, C, *sp)
    if member_done >= 1:
        k = module.members
        files.append(
            write_predictions(
                out / "members.hdf5",
                ds,
                [p[m, :member_done] for p in member_preds for m in range(k)],
                sel[0],
                start + n_in,
                stride,
            )
        )
        entry["members"] = {
            "file": "members.hdf5",
            "trajectories": sel,
            "members": k,
            "steps": member_done,
            "layout": "trajectory n * members + m of the file is member m of trajectories[n]",
        }
    if not cfg.plots or not entry["metrics"]["steps"]:
        return files
    members = f", ensemble of {module.members}" if module.members > 1 else ""
    if module.jitter_average > 1:
        members += f", mean of {module.jitter_average} jitter draws per step"
    if module.spectral_limit:
        members += f", spectral limit {module.spectral_limit:g}"
    steps_run = entry["metrics"]["steps"]
    about = f"{name}: {_trajectories_label(sel)}, {steps_run} steps{members}"
    files.append(plot_error_curves(entry["metrics"], out / "vrmse.png", "vrmse", title=about))
    files.append(plot_error_curves(entry["metrics"], out / "spectral.png", "spectral", title=about))
    files.append(plot_fidelity(entry["metrics"], out / "fidelity.png", title=about))
    files.append(plot_fidelity_fields(entry["metrics"], out / "fidelity_fields.png", title=about))
    if ENSEMBLE in entry["metrics"]:
        files.append(plot_rank_histogram(entry["metrics"], out / "rank_histogram.png", title=about))
    pred = preds[0]  # (S_done, C, *sp) of the first selected trajectory
    if pred.shape[0] >= 1:
        truth = load_rollout_sample(
            ds, sel[0], start=start, n_steps_input=n_in, steps=pred.shape[0], stride=stride
        ).output_fields[0]  # (S_done, C, *sp)
        spread = None if spreads is None else spreads[0]  # (S_done, C, *sp)
        one = f"{name}: trajectory {sel[0]}"
        files.append(
            plot_snapshots(
                truth,
                pred,
                ds.field_names,
                None,
                out / "snapshots.png",
                spread=spread,
                title=f"{one}, steps 1-{pred.shape[0]}{members}",
            )
        )
        files.append(
            write_animation(truth, pred, ds.field_names, out / "rollout", title=one + members)
        )
    return files


def _trajectories_label(sel: list[int]) -> str:
    """``"trajectory 3"``, ``"trajectories [0, 2]"`` or, for many, ``"12 trajectories [0, 1, ..., 11]"``."""
    if len(sel) == 1:
        return f"trajectory {sel[0]}"
    if len(sel) <= 6:
        return f"trajectories {sel}"
    return f"{len(sel)} trajectories [{sel[0]}, {sel[1]}, ..., {sel[-1]}]"
