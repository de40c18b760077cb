"""What every training benchmark shares: datasets, budgets, training ours, scoring, run records.

- Datasets: :func:`builtin_dataset` (``walrus.data.synthetic``, generated when missing) and
  :func:`external_dataset` (any Well dataset directory).
- Budgets: ``--steps N`` optimiser steps or ``--cpu-seconds S`` of process CPU time
  (:mod:`benchmarks.budgets`; for a CPU budget each model first runs a short probe).
- :func:`train_ours`: ``experiment=quickstart`` plus Hydra overrides, through
  ``walrus.training.train.train``.
- :func:`evaluate`: scores forecasters and persistence on a chosen split (``valid`` or
  ``test``): one-step VRMSE over every window, and from the start of every trajectory to its
  end the windowed rollout VRMSE and the fidelity measures of ``walrus.metrics`` (amplitude
  ratio, change correlation, power ratio per wavenumber bin), accumulated by
  ``walrus.metrics.RolloutMetrics`` as ``infer.py rollout`` does.

Run records (commit, dirty flag and start time read when a run starts) and JSON without
absolute paths come from :mod:`benchmarks.record`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException
from torch import Tensor, nn

from benchmarks.budgets import (
    BenchmarkError,
    Budget,
    CPUBudget,
    cpu_per_step,
    step_ceiling,
    steps_for_budget,
)
from walrus import metrics
from walrus.data.batch import Batch, collate
from walrus.data.vocab import FieldVocabulary
from walrus.data.well_dataset import WellDataset
from walrus.data.well_file import SPLITS
from walrus.inference.loading import default_jitter_average
from walrus.rollout import ensemble_rollout, rollout

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"
SYSTEMS = ("navier_stokes_2d", "gray_scott_2d", "shallow_water_2d", "advection_diffusion_3d")
# Model selection scores the mean over fields of the rollout VRMSE over steps 1..SELECT_STEPS.
SELECT_STEPS = 30


# ---------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class DatasetRef:
    """A Well dataset directory ``root/name`` (holding ``data/{train,valid,test}``)."""

    root: Path
    name: str

    @property
    def path(self) -> Path:
        return self.root / self.name


def external_dataset(path: str | os.PathLike) -> DatasetRef:
    """Check that ``path`` is a Well dataset directory with train, valid and test splits."""
    path = Path(path)
    missing = [s for s in SPLITS if not (path / "data" / s).is_dir()]
    if missing:
        raise BenchmarkError(
            f"--dataset {path}: not a Well dataset directory (no data/{'/'.join(missing)} in it)"
        )
    return DatasetRef(path.resolve().parent, path.resolve().name)


def builtin_dataset(
    system: str,
    root: str | os.PathLike,
    n_traj: int | Sequence[int] | None = None,
    resolution: int | None = None,
    frames: int | None = None,
    seed: int = 0,
) -> DatasetRef:
    """A built-in system under ``root``, generated there with ``walrus.data.synthetic`` if missing.

    An existing ``root/system/data`` is reused as is (the size flags apply to new data only).
    """
    from walrus.data.synthetic import generate

    if system not in SYSTEMS:
        raise BenchmarkError(f"unknown system {system!r}; built-in systems: {', '.join(SYSTEMS)}")
    ref = DatasetRef(Path(root).resolve(), system)
    if not (ref.path / "data").is_dir():
        kwargs: dict[str, Any] = {"seed": seed, "progress": False}
        if n_traj is not None:
            kwargs["n_traj"] = n_traj
        generate(system, ref.root, resolution=resolution, steps=frames, **kwargs)
    return ref


# ---------------------------------------------------------------------------------------------
# Forecasters and the CPU budget


@dataclass
class Forecaster:
    """A trained model behind ``walrus.rollout``'s model interface, ready to roll out.

    Attributes:
        model: ``model(x (B, T, C, *S), fields, bcs, *, jitter_seed=None) -> (B, T', C, *S)``.
        normalizer: fits the per-sample statistics of each window.
        predict_delta: the model predicts the normalised delta to the next frame.
        jitter_seed: inference jitter seed (``None``: none).
        ensemble: number of jittered rollouts averaged (needs ``jitter_seed``).
        cap_delta_unit: ``walrus.rollout``'s option (``None``: its default, capped).
        jitter_average: jitter draws averaged per step (``None``: ``infer.py``'s default for
            this model and seed).
    """

    model: nn.Module
    normalizer: Any
    predict_delta: bool = True
    jitter_seed: int | None = None
    ensemble: int = 1
    cap_delta_unit: bool | None = None
    jitter_average: int | None = None

    def rollout(self, batch: Batch, steps: int) -> Iterator[Tensor]:
        """Predicted frames ``(B, C, *S)`` for steps 1..``steps`` (no NaN check)."""
        self.model.eval()
        draws = self.jitter_average
        kwargs = dict(
            normalizer=self.normalizer,
            predict_delta=self.predict_delta,
            check_finite=False,
            cap_delta_unit=self.cap_delta_unit,
            jitter_average=draws or default_jitter_average(self.model, self.jitter_seed),
        )
        if self.ensemble > 1:
            for mean, _ in ensemble_rollout(
                self.model,
                batch,
                steps,
                members=self.ensemble,
                jitter_seed=self.jitter_seed,
                **kwargs,
            ):
                yield mean
        else:
            yield from rollout(self.model, batch, steps, jitter_seed=self.jitter_seed, **kwargs)


@dataclass
class Trained:
    """A trained forecaster and the facts of its training run (``info``, JSON-able)."""

    forecaster: Forecaster
    info: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Our model


def ours_config(
    ref: DatasetRef, out_dir: str | os.PathLike, max_steps: int, overrides: Sequence[str] = ()
) -> DictConfig:
    """``experiment=quickstart`` on ``ref`` for ``max_steps`` steps, then the user's overrides.

    The run logs to ``out_dir`` (CSV) without a progress bar; a :class:`CPUBudget` callback is
    added with ``seconds`` null (:func:`train_ours` sets it).
    """
    base = [
        "experiment=quickstart",
        f"paths.data_dir={ref.root}",
        f"paths.output_dir={Path(out_dir).resolve()}",
        f"data.datasets=[{ref.name}]",
        "data.generate_if_missing=false",
        f"trainer.max_steps={int(max_steps)}",
        "trainer.max_epochs=-1",
        "callbacks.progress_bar=null",
        "+trainer.enable_progress_bar=false",
        f"+callbacks.cpu_budget._target_={CPUBudget.__module__}.{CPUBudget.__qualname__}",
        "+callbacks.cpu_budget.seconds=null",
    ]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose(config_name="train", overrides=[*base, *overrides])
    except (HydraException, OmegaConfBaseException) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BenchmarkError(f"--ours-override {list(overrides)}: {first}") from None
    finally:
        GlobalHydra.instance().clear()


def _fit_ours(cfg: DictConfig, seconds: float | None) -> tuple[dict[str, Any], CPUBudget, float]:
    from walrus.training.train import train

    cfg.callbacks.cpu_budget.seconds = seconds
    t0 = time.perf_counter()
    _, objects = train(cfg)
    wall = time.perf_counter() - t0
    budget = next(c for c in objects["trainer"].callbacks if isinstance(c, CPUBudget))
    return objects, budget, wall


def train_ours(
    ref: DatasetRef,
    budget: Budget,
    out_dir: str | os.PathLike,
    overrides: Sequence[str] = (),
    probe_steps: int = 10,
    weights: str = "last",
    jitter_seed: int | None = None,
    ensemble: int = 1,
    seed: int = 0,
) -> tuple[Trained, DictConfig, FieldVocabulary]:
    """Train our model on ``ref`` within ``budget``.

    Args:
        ref: the dataset.
        budget: steps, or CPU seconds (probed first, see the module docstring).
        out_dir: Lightning output folder (checkpoints, logs, config).
        overrides: Hydra overrides applied after the benchmark's own.
        probe_steps: steps of the CPU probe run.
        weights: ``"last"`` (the weights at the end) or ``"best"`` (the checkpoint that the
            config's ``callbacks.model_checkpoint`` kept).
        jitter_seed, ensemble: inference options of the returned forecaster.
        seed: the run's ``seed`` (model init, batch order, noise).

    Returns:
        ``(trained, cfg, vocab)``: the composed config and field vocabulary of the run.
    """
    if weights not in ("last", "best"):
        raise BenchmarkError(f"--ours-weights must be 'last' or 'best', got {weights!r}")
    out_dir = Path(out_dir)
    overrides = [f"seed={int(seed)}", *overrides]
    info: dict[str, Any] = {"overrides": overrides, "seed": int(seed)}
    seconds = None
    if budget.kind == "steps":
        max_steps = int(budget.value)
    else:
        probe_cfg = ours_config(
            ref,
            out_dir / "probe",
            probe_steps,
            [*overrides, "trainer.limit_val_batches=0", "callbacks.model_checkpoint=null"],
        )
        _, probe, _ = _fit_ours(probe_cfg, None)
        per_step = cpu_per_step(probe.step_cpu)
        planned, seconds = steps_for_budget(budget.value, per_step), budget.value
        max_steps = step_ceiling(planned)
        info["probe"] = {
            "steps": probe.steps,
            "cpu_s_per_step": per_step,
            "planned_steps": planned,
        }
    cfg = ours_config(ref, out_dir, max_steps, overrides)
    objects, used, wall = _fit_ours(cfg, seconds)
    module = objects["module"]
    if weights == "best":
        from walrus.checkpoint import load_checkpoint_file, model_state_dict

        best = objects["trainer"].checkpoint_callback
        path = getattr(best, "best_model_path", "") if best is not None else ""
        if not path:
            raise BenchmarkError("--ours-weights best: the run kept no best checkpoint")
        module.model.load_state_dict(model_state_dict(load_checkpoint_file(path)))
        info["weights"] = str(path)
    info.update(
        steps=objects["trainer"].global_step,
        cpu_s=used.used,
        wall_s=wall,
        max_steps=max_steps,
        params=sum(p.numel() for p in module.model.parameters()),
        normalizer=type(module.normalizer).__name__,
        n_steps_input=int(cfg.data.n_steps_input),
        batch_size=int(cfg.data.batch_size),
    )
    forecaster = Forecaster(
        module.model.eval(), module.normalizer, module.predict_delta, jitter_seed, ensemble
    )
    return Trained(forecaster, info), cfg, objects["datamodule"].vocab


# ---------------------------------------------------------------------------------------------
# Evaluation


def _num(x: float) -> float | None:
    """A JSON-safe float: NaN and Inf (undefined, or a diverged rollout) become ``None``."""
    x = float(x)
    return x if math.isfinite(x) else None


def windowed(per_step: Sequence[float | None], skip_undefined: bool = False) -> dict[str, Any]:
    """Means of per-step values over ``walrus.metrics``' windows, under their nominal labels.

    ``None`` is undefined: it makes its window ``None`` unless ``skip_undefined`` (then the
    window averages the defined steps; ``None`` if it has none).
    """
    values = torch.tensor([math.nan if v is None else v for v in per_step], dtype=torch.float64)
    n = len(values)
    labels = metrics.window_means(torch.zeros(n)).keys()
    spans = metrics.step_windows(n).values()
    mean = torch.nanmean if skip_undefined else torch.mean
    return {w: _num(mean(values[a - 1 : b])) for w, (a, b) in zip(labels, spans)}


def selection_score(summary: Mapping[str, Any], steps: int = SELECT_STEPS) -> float:
    """Mean over fields of the rollout VRMSE averaged over steps 1..``steps`` (inf if diverged)."""
    head = summary["rollout"]["per_step_mean"][:steps]
    return math.inf if not head or None in head else sum(head) / len(head)


def _model_summary(
    one_step: Tensor, block: Mapping[str, Any], names: Sequence[str], diverged: int | None
) -> dict[str, Any]:
    """JSON summary of one source from one-step VRMSE ``(C,)`` and ``RolloutMetrics.to_dict``."""

    def cut(values: list[float | None]) -> list[float | None]:  # no VRMSE after a divergence
        return (
            values
            if diverged is None
            else values[: diverged - 1] + [None] * (len(values) - diverged + 1)
        )

    vrmse = block["vrmse"]
    per_step = cut(vrmse["mean_over_fields"]["per_step"])
    return {
        "one_step": {
            "per_field": {n: _num(v) for n, v in zip(names, one_step)},
            "mean": _num(one_step.mean()),
        },
        "rollout": {
            "per_field": {n: windowed(cut(vrmse["per_step"][n])) for n in names},
            "mean": windowed(per_step),
            "per_step_mean": per_step,
            "diverged_at_step": diverged,
        },
        "fidelity": {
            m: windowed(block[m]["mean_over_fields"]["per_step"], skip_undefined=True)
            for m in metrics.FIDELITY
        },
    }


@torch.no_grad()
def evaluate(
    ref: DatasetRef,
    forecasters: Mapping[str, Forecaster],
    *,
    split: str = "test",
    n_steps_input: int,
    time_stride: int | Sequence[int] = 1,
    vocab: FieldVocabulary | None = None,
    batch_size: int = 8,
) -> dict[str, Any]:
    """Score ``forecasters`` and persistence on ``split`` (``"valid"`` or ``"test"``) of ``ref``.

    One-step VRMSE is averaged over every window of the split (true context frames). The
    rollout starts from the first ``n_steps_input`` frames of every trajectory and runs to its
    last frame; per-step VRMSE and fidelity measures are averaged over trajectories.

    Returns:
        ``{"split", "fields", "grid", "windows_scored", "trajectories", "rollout_steps",
        "windows", "spatial_mean", "models": {name: {"one_step", "rollout", "fidelity"}}}``; a
        model's VRMSE is ``None`` from the step its rollout first went non-finite
        (``diverged_at_step``). ``spatial_mean`` holds the windowed rollout VRMSE (``per_field``,
        and ``mean`` over the fields that are not constant) of predicting each true frame's own
        spatial mean: the reference a VRMSE of 1 stands for, ``sqrt((N - 1) / N)`` on N grid
        points since VRMSE divides by the unbiased spatial variance.
    """
    if not forecasters:
        raise BenchmarkError("evaluate needs at least one forecaster besides persistence")
    if split not in ("valid", "test"):
        raise BenchmarkError(f"evaluation split must be 'valid' or 'test', got {split!r}")
    stride = time_stride if isinstance(time_stride, int) else int(time_stride[0])
    ds = WellDataset(ref.root, ref.name, split, n_steps_input, 1, stride, vocab=vocab)
    names, n_sp = list(ds.field_names), ds.n_spatial
    sources = [*forecasters, "persistence"]

    one = {s: torch.zeros(len(names), dtype=torch.float64) for s in sources}
    for lo in range(0, len(ds), batch_size):
        batch = collate([ds[i] for i in range(lo, min(lo + batch_size, len(ds)))])
        truth = batch.output_fields[:, 0]  # (B, C, *S)
        for s in sources:
            if s == "persistence":
                pred = batch.input_fields[:, -1]  # (B, C, *S)
            else:
                pred = next(forecasters[s].rollout(batch, 1))
            one[s] += metrics.vrmse(pred, truth, n_spatial=n_sp).double().sum(dim=0)

    trajs = [ds.trajectory(i) for i in range(ds.n_trajectories)]
    steps = max(t.output_fields.shape[1] for t in trajs)
    acc = {s: metrics.RolloutMetrics(names, steps) for s in forecasters}
    diverged: dict[str, int | None] = {s: None for s in forecasters}
    for lo in range(0, len(trajs), batch_size):
        for n_out in sorted({t.output_fields.shape[1] for t in trajs[lo : lo + batch_size]}):
            group = [t for t in trajs[lo : lo + batch_size] if t.output_fields.shape[1] == n_out]
            batch = collate(group)
            truth = batch.output_fields  # (B, n_out, C, *S)
            last = batch.input_fields[:, -1]  # (B, C, *S)
            for s, forecaster in forecasters.items():
                for k, pred in enumerate(forecaster.rollout(batch, n_out)):  # pred (B, C, *S)
                    if not torch.isfinite(pred).all():
                        diverged[s] = min(diverged[s] or k + 1, k + 1)
                    acc[s].update(k + 1, pred, truth[:, k], last)
    ds.close()

    models: dict[str, Any] = {}
    for s in forecasters:
        report = acc[s].to_dict()
        models[s] = _model_summary(one[s] / len(ds), report["model"], names, diverged[s])
    # every accumulator scored persistence and the spatial mean alike; take the last one's
    models["persistence"] = _model_summary(
        one["persistence"] / len(ds), report["persistence"], names, None
    )
    flat = report["spatial_mean"]["vrmse"]
    return {
        "split": split,
        "fields": names,
        "grid": list(ds.spatial_shape),
        "bcs": ds.bcs.tolist(),
        "windows_scored": len(ds),
        "trajectories": ds.n_trajectories,
        "rollout_steps": steps,
        "windows": list(metrics.window_means(torch.zeros(steps)).keys()),
        "spatial_mean": {
            "per_field": {n: windowed(flat["per_step"][n]) for n in names},
            "mean": windowed(flat["mean_over_fields"]["per_step"]),
        },
        "models": models,
    }
