"""The FNO baseline: neuraloperator's ``FNO`` behind our model interface, trained at a budget.

Choices (all options of :class:`FNOOptions`): 4 layers, neuraloperator's default grid positional
embedding, no domain padding; in 2D 16 Fourier modes per axis (as The Well's FNO) and a width of
64 or 128 hidden channels (The Well's FNO config uses 128; the benchmark trains both and keeps
the one that scores better on the validation split); in 3D 8 modes and 20 channels, the FNO-3D
size of Li et al. (2021) (at 32^3 and batch 8 a 64-channel 3D FNO costs about 9 CPU-seconds per
step, the 20-channel one about 1). Input: the ``T_in`` frames of our window stacked as channels,
normalised with our model's per-sample normaliser; output: the next frame's normalised delta,
trained with MSE (The Well's training loss) by AdamW (lr 1e-3, weight decay 1e-4) under the same
warmup + cosine schedule as ours (5 % warmup, floor 1 %; at a CPU budget it follows the share of
CPU used), gradient clipping at 1.0, and the same
batch size as ours.

Input noise (``noise``, ``noise_units``) means what ``module.input_noise`` and
``module.noise_units`` mean for our model: Gaussian noise on the input window of ``noise``
times, per sample and field, the window's RMS (``input_rms``), its RMS about its mean
(``input_std``) or the RMS of its frame-to-frame changes (``delta_rms``); fields that do not
change within the window get none; the target leads from the noisy last frame to the clean next
one.

Install: ``make baseline`` (neuraloperator and py-pde, torch pinned).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from benchmarks.harness import (
    BenchmarkError,
    Budget,
    DatasetRef,
    Forecaster,
    Trained,
    cpu_per_step,
    step_ceiling,
    steps_for_budget,
)
from walrus.data.batch import collate
from walrus.data.normalization import RMSNormalizer
from walrus.data.well_dataset import WellDataset
from walrus.training.augment import input_noise as window_noise
from walrus.training.module import NOISE_UNITS
from walrus.training.optim import WarmupCosine

FNO_MISSING = "the FNO baseline needs neuraloperator: run make baseline (or pass --no-fno)"


@dataclass(frozen=True)
class FNOOptions:
    """The FNO baseline's size and training recipe (see the module docstring).

    ``hidden`` is the 2D width, ``hidden_3d`` the 3D one; ``noise`` is in ``noise_units``.
    """

    modes: int = 16
    modes_3d: int = 8
    hidden: int = 64
    hidden_3d: int = 20
    layers: int = 4
    lr: float = 1e-3
    weight_decay: float = 1e-4
    loss: str = "mse"
    grad_clip: float = 1.0
    noise: float = 0.0
    noise_units: str = "input_rms"

    def __post_init__(self) -> None:
        if self.loss not in ("mse", "mae"):
            raise BenchmarkError(f"--fno-loss must be 'mse' or 'mae', got {self.loss!r}")
        if self.noise_units not in NOISE_UNITS:
            raise BenchmarkError(
                f"--fno-noise-units must be one of {NOISE_UNITS}, got {self.noise_units!r}"
            )
        if not self.noise >= 0:
            raise BenchmarkError(f"--fno-noise must be >= 0, got {self.noise}")
        if min(self.modes, self.modes_3d, self.hidden, self.hidden_3d, self.layers) < 1:
            raise BenchmarkError(f"FNO modes, widths and layers must be >= 1: {self}")

    def width(self, n_spatial: int) -> int:
        """Hidden channels for data with ``n_spatial`` axes."""
        return self.hidden_3d if n_spatial == 3 else self.hidden


def input_noise(x: Tensor, scale: Tensor, options: FNOOptions) -> Tensor:
    """Noise for a window ``x (B, T, C, *S)`` as ``module.input_noise`` makes it for ours.

    ``scale (B, 1, C, 1, ...)`` is the normaliser's input RMS; the unit is that or, for
    ``delta_rms``, the window's change RMS. Fields that do not change within the window get
    none. Returns a tensor shaped like ``x``.
    """
    return window_noise(x, scale, options.noise, options.noise_units)


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
            hidden_channels=options.width(len(spatial)),
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
    """Train ``total_steps`` steps (or until ``seconds`` of CPU); returns steps, CPU, trace, loss.

    With ``seconds`` the schedule follows the share of CPU used as well (whichever is further
    along), as our model's does under :class:`~benchmarks.budgets.CPUBudget`.
    """
    start, steps, trace, loss = time.process_time(), 0, [], float("nan")

    def cpu_fraction() -> float:
        return min((time.process_time() - start) / seconds, 1.0)

    opt = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=options.weight_decay)
    sched = WarmupCosine(
        opt,
        total_steps,
        warmup_steps=0.05,
        min_ratio=0.01,
        time_fraction=None if seconds is None else cpu_fraction,
    )
    model.train()
    while steps < total_steps:
        for batch in loader:
            x, y = batch.input_fields, batch.output_fields[:, 0]  # (B, T, C, *S), (B, C, *S)
            stats = normalizer.fit(x, batch.metadata.get("field_names"))
            if options.noise > 0:
                x = x + input_noise(x, stats.scale, options)  # (B, T, C, *S)
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

    info: dict[str, Any] = {"options": dataclasses.asdict(options)}
    seconds = None
    if budget.kind == "steps":
        total = int(budget.value)
    else:
        _, _, trace, _ = _fno_fit(model(), loader(), normalizer, options, probe_steps, None)
        per_step = cpu_per_step(trace)
        planned, seconds = steps_for_budget(budget.value, per_step), budget.value
        total = step_ceiling(planned)
        info["probe"] = {"steps": len(trace), "cpu_s_per_step": per_step, "planned_steps": planned}
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
