"""Quality benchmark: our model against an FNO and persistence, at the same training budget.

For every built-in system (2D Navier-Stokes, Gray-Scott, shallow water, 3D advection-diffusion)
and every extra Well dataset given with ``--dataset``:

1. train OUR model with ``walrus.training.train.train`` on ``experiment=quickstart`` plus
   ``--ours-override key=value`` options, pointed at that dataset;
2. train a standard FNO baseline (neuraloperator's ``FNO``; ``pip install -e '.[baseline]'
   torch==2.13.0``) on the same windows at the same budget;
3. score both, and persistence (copy the last input frame), on the test split: one-step VRMSE
   over every test window, and rollout VRMSE from the start of every test trajectory to its end,
   averaged over the windows of steps 1, 2-10, 11-30, 31-60 and 61+, per field and over fields.

Budgets (each given one runs separately): ``--steps N`` optimiser steps, or ``--cpu-seconds S``
of process CPU time (``time.process_time``: all threads of this process, so 2 threads spend
about 2 CPU seconds per wall second; validation is not counted). For a CPU budget each model
first runs ``--probe-steps`` steps to measure its CPU cost per step; the learning-rate schedule
then spans the steps the budget buys, and the :class:`CPUBudget` callback (ours) or the loop
(FNO) stops at the budget whichever comes first.

FNO baseline (the choices, all flags): neuraloperator ``FNO``, 4 layers, its default grid
positional embedding, no domain padding; in 2D 16 Fourier modes per axis and 64 hidden
channels (The Well's FNO keeps 16 modes), in 3D 8 modes and 20 channels, the FNO-3D size of
Li et al. (2021) (at 32^3 and batch 8 a 64-channel 3D FNO costs about 9 CPU-seconds per step,
the 20-channel one about 1). Input: the ``T_in`` frames of our window stacked as channels,
normalised with our model's per-sample normaliser; output: the next frame's normalised delta,
trained with MSE (The Well's training loss) by AdamW (lr 1e-3, weight decay 1e-4) under the
same warmup + cosine schedule as ours (5 % warmup, floor 1 %), gradient clipping at 1.0, and
the same batch size as ours. Our model is scored with its final weights (``--ours-weights
best``: the checkpoint its config kept), without inference jitter unless asked for.

Timing: on a machine whose cores are busy with other work, OpenMP threads spin and small ops
slow down many times over; use ``--threads 1`` there, or run on a quiet machine.

Run from the repository root::

    python -m benchmarks.quality --steps 600 --cpu-seconds 300 --dataset data/gray_scott_pypde
    python -m benchmarks.quality --systems gray_scott_2d --steps 20 --n-traj 4,1,1 \\
        --resolution 32 --frames 70 --data-root /tmp/quality_data      # smoke run

Built-in data is generated under ``--data-root`` when missing (system defaults, or the size
flags). Results: a printed table and ``benchmarks/results/quality.json`` (budgets, steps and
CPU seconds actually used, wall time, machine load before and after, threads, versions).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import Tensor, nn
from torch.utils.data import DataLoader

from benchmarks.common import print_table, save_json
from walrus import metrics
from walrus.data.batch import Batch, collate
from walrus.data.normalization import RMSNormalizer
from walrus.data.vocab import FieldVocabulary
from walrus.data.well_dataset import WellDataset
from walrus.data.well_file import SPLITS
from walrus.rollout import ensemble_rollout, rollout
from walrus.training.optim import WarmupCosine

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"
SYSTEMS = ("navier_stokes_2d", "gray_scott_2d", "shallow_water_2d", "advection_diffusion_3d")
MODELS = ("ours", "fno", "persistence")
PACKAGES = ("torch", "lightning", "hydra-core", "numpy", "h5py", "neuraloperator", "py-pde")
FNO_MISSING = (
    "the FNO baseline needs neuraloperator: pip install -e '.[baseline]' torch==2.13.0 "
    "(or pass --no-fno)"
)


class BenchmarkError(ValueError):
    """Bad input to the benchmark; the CLI prints it as one line."""


# ---------------------------------------------------------------------------------------------
# Budgets and data


@dataclass(frozen=True)
class Budget:
    """A training budget: ``kind`` is ``"steps"`` (optimiser steps) or ``"cpu_seconds"``."""

    kind: str
    value: float

    def __post_init__(self) -> None:
        if self.kind not in ("steps", "cpu_seconds"):
            raise BenchmarkError(f"budget kind must be 'steps' or 'cpu_seconds', got {self.kind}")
        if not self.value > 0 or (self.kind == "steps" and self.value != int(self.value)):
            raise BenchmarkError(
                f"--{self.kind.replace('_', '-')} must be positive, got {self.value}"
            )

    @property
    def label(self) -> str:
        return f"{int(self.value)} steps" if self.kind == "steps" else f"{self.value:g} cpu-s"


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
    """

    model: nn.Module
    normalizer: Any
    predict_delta: bool = True
    jitter_seed: int | None = None
    ensemble: int = 1

    def rollout(self, batch: Batch, steps: int) -> Iterator[Tensor]:
        """Predicted frames ``(B, C, *S)`` for steps 1..``steps`` (no NaN check)."""
        self.model.eval()
        kwargs = dict(
            normalizer=self.normalizer, predict_delta=self.predict_delta, check_finite=False
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


class CPUBudget(pl.Callback):
    """Stops training once it has used ``seconds`` of process CPU time; records what it used.

    CPU time (``time.process_time``) counts from the start of training and leaves out the time
    spent in validation. ``seconds=None`` only measures.

    Attributes:
        used: CPU seconds used by training so far.
        steps: optimiser steps done.
        step_cpu: ``used`` after each training batch.
    """

    def __init__(self, seconds: float | None = None) -> None:
        if seconds is not None and not seconds > 0:
            raise BenchmarkError(f"CPU budget must be positive seconds, got {seconds}")
        self.seconds = seconds
        self.used = 0.0
        self.steps = 0
        self.step_cpu: list[float] = []
        self._start: float | None = None
        self._val_start: float | None = None
        self._val_total = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._val_total = time.process_time(), 0.0

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._start is not None:
            self._val_start = time.process_time()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_start is not None:
            self._val_total += time.process_time() - self._val_start
            self._val_start = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.used = time.process_time() - self._start - self._val_total
        self.steps = trainer.global_step
        self.step_cpu.append(self.used)
        if self.seconds is not None and self.used >= self.seconds:
            trainer.should_stop = True


def cpu_per_step(step_cpu: Sequence[float], warmup: int = 2) -> float:
    """CPU seconds per step from cumulative per-step CPU times, skipping ``warmup`` steps."""
    if len(step_cpu) <= warmup:
        raise BenchmarkError(
            f"the CPU probe needs more than {warmup} steps, got {len(step_cpu)} "
            "(raise --probe-steps)"
        )
    return (step_cpu[-1] - step_cpu[warmup - 1]) / (len(step_cpu) - warmup)


def steps_for_budget(seconds: float, per_step: float) -> int:
    """Optimiser steps that ``seconds`` of CPU buy at ``per_step`` seconds each (at least 1)."""
    return max(1, math.ceil(seconds / max(per_step, 1e-9)))


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
        # the class's own module: ``__main__`` when run with ``python -m``
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

    Returns:
        ``(trained, cfg, vocab)``: the composed config and field vocabulary of the run.
    """
    if weights not in ("last", "best"):
        raise BenchmarkError(f"--ours-weights must be 'last' or 'best', got {weights!r}")
    out_dir = Path(out_dir)
    info: dict[str, Any] = {"overrides": list(overrides)}
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
        max_steps, seconds = steps_for_budget(budget.value, per_step), budget.value
        info["probe"] = {
            "steps": probe.steps,
            "cpu_s_per_step": per_step,
            "planned_steps": max_steps,
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
# FNO baseline


@dataclass(frozen=True)
class FNOOptions:
    """The FNO baseline's size and training recipe (see the module docstring)."""

    modes: int = 16
    modes_3d: int = 8
    hidden: int = 64
    hidden_3d: int = 20
    layers: int = 4
    lr: float = 1e-3
    weight_decay: float = 1e-4
    loss: str = "mse"
    grad_clip: float = 1.0


def fno_available() -> bool:
    """Whether neuraloperator can be imported."""
    try:
        from neuralop.models import FNO  # noqa: F401
    except ImportError:
        return False
    return True


class FNOForecaster(nn.Module):
    """neuraloperator's FNO behind our model interface.

    ``forward(x (B, T, C, *S), fields, bcs, *, jitter_seed=None) -> (B, 1, C, *S)``: the ``T``
    normalised frames stacked as ``T * C`` channels in, the normalised next-frame delta out.
    ``fields``, ``bcs`` and ``jitter_seed`` are ignored.
    """

    def __init__(
        self, n_steps_input: int, n_fields: int, spatial: Sequence[int], options: FNOOptions
    ) -> None:
        super().__init__()
        try:
            from neuralop.models import FNO
        except ImportError:
            raise BenchmarkError(FNO_MISSING) from None
        three_d = len(spatial) == 3
        modes = options.modes_3d if three_d else options.modes
        self.n_steps_input, self.n_fields = n_steps_input, n_fields
        self.fno = FNO(
            n_modes=tuple(min(modes, n) for n in spatial),
            in_channels=n_steps_input * n_fields,
            out_channels=n_fields,
            hidden_channels=options.hidden_3d if three_d else options.hidden,
            n_layers=options.layers,
        )

    def forward(
        self, x: Tensor, fields: Tensor, bcs: Tensor, *, jitter_seed: int | None = None
    ) -> Tensor:
        b, t, c = x.shape[:3]
        if (t, c) != (self.n_steps_input, self.n_fields):
            raise ValueError(
                f"FNO built for {self.n_steps_input} frames of {self.n_fields} fields, "
                f"got input {tuple(x.shape)}"
            )
        y = self.fno(x.reshape(b, t * c, *x.shape[3:]))  # (B, C, *S)
        return y.unsqueeze(1)  # (B, 1, C, *S)


def _fno_fit(
    model: FNOForecaster,
    loader: DataLoader,
    normalizer: Any,
    options: FNOOptions,
    total_steps: int,
    seconds: float | None,
) -> tuple[int, float, list[float], float]:
    """Train ``total_steps`` steps (or until ``seconds`` of CPU); returns steps, CPU, trace, loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=options.weight_decay)
    sched = WarmupCosine(opt, total_steps, warmup_steps=0.05, min_ratio=0.01)
    model.train()
    start, steps, trace, loss = time.process_time(), 0, [], float("nan")
    while steps < total_steps:
        for batch in loader:
            x, y = batch.input_fields, batch.output_fields[:, 0]  # (B, T, C, *S), (B, C, *S)
            stats = normalizer.fit(x, batch.metadata.get("field_names"))
            target = stats.normalize_delta((y - x[:, -1]).unsqueeze(1))[:, 0]  # (B, C, *S)
            pred = model(stats.normalize(x), batch.field_ids, batch.bcs)[:, 0]  # (B, C, *S)
            err = pred - target
            value = err.square().mean() if options.loss == "mse" else err.abs().mean()
            opt.zero_grad(set_to_none=True)
            value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), options.grad_clip)
            opt.step()
            sched.step()
            steps, loss = steps + 1, value.item()
            trace.append(time.process_time() - start)
            if steps >= total_steps or (seconds is not None and trace[-1] >= seconds):
                return steps, trace[-1], trace, loss
    return steps, trace[-1] if trace else 0.0, trace, loss


def train_fno(
    ref: DatasetRef,
    budget: Budget,
    *,
    n_steps_input: int,
    batch_size: int,
    time_stride: int | Sequence[int] = 1,
    normalizer: Any = None,
    options: FNOOptions | None = None,
    probe_steps: int = 10,
    seed: int = 0,
) -> Trained:
    """Train the FNO baseline on the train split of ``ref`` within ``budget``.

    Args:
        ref: the dataset.
        budget: steps, or CPU seconds (probed first on a throw-away model).
        n_steps_input, batch_size, time_stride: as our model's data config.
        normalizer: our model's normaliser (``RMSNormalizer()`` by default).
        options: size and recipe (``FNOOptions()`` by default).
        probe_steps: steps of the CPU probe.
        seed: model init and batch order.
    """
    options = FNOOptions() if options is None else options
    if options.loss not in ("mse", "mae"):
        raise BenchmarkError(f"--fno-loss must be 'mse' or 'mae', got {options.loss!r}")
    normalizer = RMSNormalizer() if normalizer is None else normalizer
    ds = WellDataset(ref.root, ref.name, "train", n_steps_input, 1, time_stride, train=True)
    if len(ds) < batch_size:
        raise BenchmarkError(f"{ref.path}: {len(ds)} training windows, fewer than one batch")

    def loader() -> DataLoader:
        gen = torch.Generator().manual_seed(seed)
        return DataLoader(
            ds, batch_size, shuffle=True, drop_last=True, collate_fn=collate, generator=gen
        )

    def model() -> FNOForecaster:
        torch.manual_seed(seed)
        return FNOForecaster(n_steps_input, len(ds.field_names), ds.spatial_shape, options)

    info: dict[str, Any] = {"options": vars(options)}
    seconds = None
    if budget.kind == "steps":
        total = int(budget.value)
    else:
        _, _, trace, _ = _fno_fit(model(), loader(), normalizer, options, probe_steps, None)
        per_step = cpu_per_step(trace)
        total, seconds = steps_for_budget(budget.value, per_step), budget.value
        info["probe"] = {"steps": len(trace), "cpu_s_per_step": per_step, "planned_steps": total}
    net = model()
    t0 = time.perf_counter()
    steps, cpu, _, loss = _fno_fit(net, loader(), normalizer, options, total, seconds)
    info.update(
        steps=steps,
        cpu_s=cpu,
        wall_s=time.perf_counter() - t0,
        max_steps=total,
        params=sum(p.numel() for p in net.parameters()),
        final_loss=loss,
        n_steps_input=n_steps_input,
        batch_size=batch_size,
    )
    ds.close()
    return Trained(Forecaster(net.eval(), normalizer, True), info)


# ---------------------------------------------------------------------------------------------
# Evaluation


def _num(x: float) -> float | None:
    """A JSON-safe float: NaN and Inf (a diverged rollout) become ``None``."""
    x = float(x)
    return x if math.isfinite(x) else None


def _summary(one_step: Tensor, per_step: Tensor, names: Sequence[str]) -> dict[str, Any]:
    """JSON summary of one-step ``(C,)`` and per-step ``(S, C)`` VRMSE."""
    windows = metrics.window_means(per_step)  # {label: (C,)}
    mean_windows = metrics.window_means(per_step.mean(dim=1))  # {label: ()}
    bad = (~torch.isfinite(per_step)).any(dim=1).nonzero()
    return {
        "one_step": {
            "per_field": {n: _num(v) for n, v in zip(names, one_step)},
            "mean": _num(one_step.mean()),
        },
        "rollout": {
            "per_field": {
                n: {w: _num(v[c]) for w, v in windows.items()} for c, n in enumerate(names)
            },
            "mean": {w: _num(v) for w, v in mean_windows.items()},
            "per_step_mean": [_num(v) for v in per_step.mean(dim=1)],
            "diverged_at_step": int(bad[0]) + 1 if len(bad) else None,
        },
    }


@torch.no_grad()
def evaluate(
    ref: DatasetRef,
    forecasters: Mapping[str, Forecaster],
    *,
    n_steps_input: int,
    time_stride: int | Sequence[int] = 1,
    vocab: FieldVocabulary | None = None,
    batch_size: int = 8,
) -> dict[str, Any]:
    """Score ``forecasters`` and persistence on the test split of ``ref``.

    One-step VRMSE is averaged over every window of the test split (true context frames); the
    rollout starts from the first ``n_steps_input`` frames of every test trajectory and runs to
    its last frame, averaging per-step VRMSE over trajectories.

    Args:
        ref: the dataset.
        forecasters: name -> forecaster (``"persistence"`` is added).
        n_steps_input: context frames.
        time_stride: the data's time stride (a range uses its lower end).
        vocab: field vocabulary giving the field ids our model expects.
        batch_size: windows or trajectories per model call.

    Returns:
        ``{"fields", "grid", "test_windows", "test_trajectories", "rollout_steps", "windows",
        "models": {name: {"one_step": ..., "rollout": ...}}}``.
    """
    stride = time_stride if isinstance(time_stride, int) else int(time_stride[0])
    ds = WellDataset(ref.root, ref.name, "test", n_steps_input, 1, stride, vocab=vocab)
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
    roll = {s: torch.zeros(steps, len(names), dtype=torch.float64) for s in sources}
    count = torch.zeros(steps, dtype=torch.float64)
    by_length: dict[int, list[Batch]] = {}
    for t in trajs:
        by_length.setdefault(t.output_fields.shape[1], []).append(t)
    for n_out, group in by_length.items():
        for lo in range(0, len(group), batch_size):
            batch = collate(group[lo : lo + batch_size])
            truth = batch.output_fields  # (B, n_out, C, *S)
            count[:n_out] += batch.batch_size
            for s in sources:
                if s == "persistence":
                    preds: Iterator[Tensor] = iter([batch.input_fields[:, -1]] * n_out)
                else:
                    preds = forecasters[s].rollout(batch, n_out)
                for k, pred in enumerate(preds):
                    err = metrics.vrmse(pred, truth[:, k], n_spatial=n_sp)  # (B, C)
                    roll[s][k] += err.double().sum(dim=0)
    ds.close()

    per_step = {s: roll[s] / count[:, None] for s in sources}  # (S, C)
    models = {s: _summary(one[s] / len(ds), per_step[s], names) for s in sources}
    return {
        "fields": names,
        "grid": list(ds.spatial_shape),
        "test_windows": len(ds),
        "test_trajectories": ds.n_trajectories,
        "rollout_steps": steps,
        "windows": list(metrics.window_means(torch.zeros(steps)).keys()),
        "models": models,
    }


# ---------------------------------------------------------------------------------------------
# Report


def all_windows() -> list[str]:
    """Labels of every rollout window of ``walrus.metrics`` (``"1"``, ``"2-10"``, ...)."""
    longest = max(start for start, _ in metrics.WINDOWS)
    return list(metrics.window_means(torch.zeros(longest)).keys())


def table_rows(runs: Sequence[Mapping[str, Any]], per_field: bool = False) -> list[dict[str, Any]]:
    """Rows (budget x system x model [x field]) of one-step and windowed rollout VRMSE.

    With both ``ours`` and ``fno`` present, an ``ours/fno`` row gives their ratio (below 1:
    ours is better).
    """
    rows: list[dict[str, Any]] = []
    for run in runs:
        windows = run["windows"]
        models = run["models"]
        fields = [*run["fields"], "mean"] if per_field else ["mean"]
        for f in fields:
            values: dict[str, list[float | None]] = {}
            for m, res in models.items():
                one = res["one_step"]["mean" if f == "mean" else "per_field"]
                win = res["rollout"]["mean" if f == "mean" else "per_field"]
                if f != "mean":
                    one, win = one[f], win[f]
                values[m] = [one, *(win.get(w) for w in windows)]
            if "ours" in values and "fno" in values:
                values["ours/fno"] = [
                    a / b if a is not None and b else None
                    for a, b in zip(values["ours"], values["fno"])
                ]
            for m, vals in values.items():
                row = {"budget": run["budget"]["label"], "system": run["system"], "model": m}
                if per_field:
                    row["field"] = f
                row.update(zip(["one-step", *windows], vals))
                rows.append(row)
    return rows


def versions() -> dict[str, str | None]:
    """Installed versions of the packages behind the figures, and the repository commit."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    try:
        out["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["git_commit"] = None
    return out


def run_system(
    ref: DatasetRef,
    budget: Budget,
    work_dir: str | os.PathLike,
    *,
    ours_overrides: Sequence[str] = (),
    ours_weights: str = "last",
    jitter_seed: int | None = None,
    ensemble: int = 1,
    fno: FNOOptions | None = None,
    probe_steps: int = 10,
    eval_batch_size: int = 8,
    seed: int = 0,
    log: Any = print,
) -> dict[str, Any]:
    """Train ours (and the FNO when ``fno`` options are given) on ``ref`` at ``budget``; score them.

    Returns:
        One entry of the JSON's ``runs``: ``evaluate``'s result, each model's ``train`` facts,
        the budget, the evaluation wall time and the load average before and after.
    """
    load_before = os.getloadavg()
    out = Path(work_dir) / budget.label.replace(" ", "_") / ref.name
    log(f"[{budget.label}] {ref.name}: training ours")
    ours, cfg, vocab = train_ours(
        ref, budget, out, ours_overrides, probe_steps, ours_weights, jitter_seed, ensemble
    )
    trained = {"ours": ours}
    log(f"  ours: {ours.info['steps']} steps, {ours.info['cpu_s']:.1f} cpu-s")
    time_stride = OmegaConf.to_container(cfg.data, resolve=True)["time_stride"]
    if fno is not None:
        log(f"[{budget.label}] {ref.name}: training the FNO")
        trained["fno"] = train_fno(
            ref,
            budget,
            n_steps_input=int(cfg.data.n_steps_input),
            batch_size=int(cfg.data.batch_size),
            time_stride=time_stride,
            normalizer=ours.forecaster.normalizer,
            options=fno,
            probe_steps=probe_steps,
            seed=seed,
        )
        log(
            f"  fno: {trained['fno'].info['steps']} steps, {trained['fno'].info['cpu_s']:.1f} cpu-s"
        )
    log(f"[{budget.label}] {ref.name}: evaluating")
    t0 = time.perf_counter()
    result = evaluate(
        ref,
        {k: v.forecaster for k, v in trained.items()},
        n_steps_input=int(cfg.data.n_steps_input),
        time_stride=time_stride,
        vocab=vocab,
        batch_size=eval_batch_size,
    )
    for name, t in trained.items():
        result["models"][name]["train"] = t.info
    return {
        "system": ref.name,
        "dataset": str(ref.path),
        "budget": {"kind": budget.kind, "value": budget.value, "label": budget.label},
        **result,
        "eval_wall_s": time.perf_counter() - t0,
        "loadavg": {"before": list(load_before), "after": list(os.getloadavg())},
    }


# ---------------------------------------------------------------------------------------------
# CLI


def _n_traj(text: str) -> int | tuple[int, ...]:
    parts = [int(p) for p in text.split(",")]
    if len(parts) not in (1, 3):
        raise argparse.ArgumentTypeError("--n-traj takes N (train) or TRAIN,VALID,TEST")
    return parts[0] if len(parts) == 1 else tuple(parts)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.quality",
        description="Ours vs an FNO vs persistence: one-step and windowed rollout VRMSE.",
    )
    p.add_argument("--steps", type=int, help="budget: optimiser steps")
    p.add_argument("--cpu-seconds", type=float, help="budget: CPU seconds of training")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated built-in systems, or 'none' (default: all four)",
    )
    p.add_argument(
        "--dataset", action="append", default=[], help="extra Well dataset dir (repeatable)"
    )
    p.add_argument(
        "--data-root",
        default=os.environ.get("WALRUS_DATA_DIR", "data"),
        help="where built-in systems live or are generated ($WALRUS_DATA_DIR or data)",
    )
    p.add_argument("--n-traj", type=_n_traj, help="new built-in data: N or TRAIN,VALID,TEST")
    p.add_argument("--resolution", type=int, help="new built-in data: grid points per axis")
    p.add_argument("--frames", type=int, help="new built-in data: frames per trajectory")
    p.add_argument(
        "--ours-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Hydra override for our model's training (repeatable)",
    )
    p.add_argument("--ours-weights", choices=("last", "best"), default="last")
    p.add_argument("--ours-jitter-seed", type=int, help="inference jitter seed for our model")
    p.add_argument("--ours-ensemble", type=int, default=1, help="jittered rollouts averaged")
    p.add_argument("--no-fno", action="store_true", help="skip the FNO baseline")
    p.add_argument("--fno-modes", type=int, default=FNOOptions.modes, help="per axis, 2D")
    p.add_argument("--fno-modes-3d", type=int, default=FNOOptions.modes_3d, help="per axis, 3D")
    p.add_argument("--fno-hidden", type=int, default=FNOOptions.hidden, help="2D")
    p.add_argument("--fno-hidden-3d", type=int, default=FNOOptions.hidden_3d, help="3D")
    p.add_argument("--fno-layers", type=int, default=FNOOptions.layers)
    p.add_argument("--fno-lr", type=float, default=FNOOptions.lr)
    p.add_argument("--fno-weight-decay", type=float, default=FNOOptions.weight_decay)
    p.add_argument("--fno-loss", choices=("mse", "mae"), default=FNOOptions.loss)
    p.add_argument("--probe-steps", type=int, default=10, help="CPU-budget probe steps")
    p.add_argument("--eval-batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="data generation and FNO seed")
    p.add_argument("--per-field", action="store_true", help="also print per-field rows")
    p.add_argument("--work-dir", help="training runs go here (default: outputs/quality/<UTC time>)")
    p.add_argument("--results-dir", default=None, help="default: benchmarks/results")
    p.add_argument("--name", default="quality", help="results file stem")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark as the parsed CLI ``args`` describe; prints tables, writes the JSON."""
    budgets = []
    if args.steps is not None:
        budgets.append(Budget("steps", args.steps))
    if args.cpu_seconds is not None:
        budgets.append(Budget("cpu_seconds", args.cpu_seconds))
    if not budgets:
        raise BenchmarkError("give a budget: --steps N and/or --cpu-seconds S")
    if args.ours_ensemble < 1 or (args.ours_ensemble > 1 and args.ours_jitter_seed is None):
        raise BenchmarkError("--ours-ensemble M needs M >= 1, and --ours-jitter-seed when M > 1")
    if not args.no_fno and not fno_available():
        raise BenchmarkError(FNO_MISSING)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    systems = [] if args.systems == "none" else [s for s in args.systems.split(",") if s]
    refs = [
        builtin_dataset(s, args.data_root, args.n_traj, args.resolution, args.frames, args.seed)
        for s in systems
    ]
    refs += [external_dataset(p) for p in args.dataset]
    if not refs:
        raise BenchmarkError("nothing to run: no --systems and no --dataset")
    labels = [r.name for r in refs]
    if len(set(labels)) != len(labels):
        raise BenchmarkError(f"two datasets share a name: {labels}")
    fno = None
    if not args.no_fno:
        fno = FNOOptions(
            args.fno_modes,
            args.fno_modes_3d,
            args.fno_hidden,
            args.fno_hidden_3d,
            args.fno_layers,
            args.fno_lr,
            args.fno_weight_decay,
            args.fno_loss,
        )

    if args.work_dir is None:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d_%H-%M-%S")
        args.work_dir = str(Path("outputs") / "quality" / stamp)
    load_before, t0, cpu0 = os.getloadavg(), time.perf_counter(), time.process_time()
    runs = [
        run_system(
            ref,
            budget,
            args.work_dir,
            ours_overrides=args.ours_override,
            ours_weights=args.ours_weights,
            jitter_seed=args.ours_jitter_seed,
            ensemble=args.ours_ensemble,
            fno=fno,
            probe_steps=args.probe_steps,
            eval_batch_size=args.eval_batch_size,
            seed=args.seed,
        )
        for budget in budgets
        for ref in refs
    ]
    data = {
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
        "budgets": [{"kind": b.kind, "value": b.value, "label": b.label} for b in budgets],
        "models": [m for m in MODELS if m != "fno" or fno is not None],
        "windows": all_windows(),
        "torch_threads": torch.get_num_threads(),
        "loadavg": {"before": list(load_before), "after": list(os.getloadavg())},
        "wall_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - cpu0,
        "versions": versions(),
        "runs": runs,
    }
    print_table(table_rows(runs))
    if args.per_field:
        print()
        print_table(table_rows(runs, per_field=True))
    path = save_json(args.name, data, args.results_dir)
    print(f"wrote {path}")
    return data


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except BenchmarkError as e:
        print(f"benchmarks.quality: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
