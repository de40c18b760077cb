"""The Well's baselines, its FNO and its UNetConvNext, behind our model interface and trained
at a budget in our harness.

The networks are The Well's own classes (``the_well.benchmark.models.FNO`` and
``UNetConvNext``, the-well 1.2.0); only what goes in and out is ours. Input: the ``T_in`` frames
of our window stacked as ``T_in * C`` channels, normalised with our model's per-sample
normaliser; output: the next frame's normalised delta. Training: MSE (The Well's loss), AdamW,
the same warmup + cosine schedule as ours (5 % warmup, floor 1 %; at a CPU budget it follows
the share of CPU used), gradient clipping at 1.0, and the same data, windows and batch size.

Each run's recipe is a :class:`BaselineOptions`; ``benchmarks/quality_candidates.yaml`` lists
the candidates the quality benchmark trains and chooses among on the validation split. The
levers ours uses are options here too and mean the same:

- ``augment: d4`` turns each training sample, inputs and target alike, by a random grid
  symmetry (:class:`walrus.training.augment.SymmetryAugment`, as ``module.augment_symmetry=d4``);
- ``noise`` / ``noise_units``: Gaussian noise on the input window of ``noise`` times, per
  sample and field, the window's RMS (``input_rms``), its RMS about its mean (``input_std``) or
  the RMS of its frame-to-frame changes (``delta_rms``), as ``module.input_noise`` and
  ``module.noise_units``; fields that do not change within the window get none; the target
  leads from the noisy last frame to the clean next one.

``width`` is the FNO's hidden channels or the UNetConvNext's ``init_features`` (2D;
``width_3d`` in 3D); in 3D the FNO keeps ``modes_3d`` Fourier modes per axis. A UNetConvNext
halves the grid ``stages`` times, so every axis must divide by ``2 ** stages``.

Install: ``make baseline`` (neuraloperator 0.3.0, the version The Well pins, with what it
imports; timm; py-pde). timm's package ``__init__`` imports torchvision, whose wheels are CUDA
builds that do not load against the CPU torch, and the-well's ``models/__init__`` imports all
eight of its models: :func:`well_model_classes` therefore imports the two model modules, and
timm's ``DropPath`` (the one name they take from timm), without those package ``__init__``
files.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import sys
import time
import types
from collections.abc import Mapping, Sequence
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
from walrus.training.augment import PSEUDO_FIELDS, SYMMETRIES, build_symmetry
from walrus.training.augment import input_noise as window_noise
from walrus.training.module import NOISE_UNITS
from walrus.training.optim import WarmupCosine

KINDS = ("fno", "unet_convnext")
BASELINE_MISSING = (
    "The Well's baselines need neuraloperator, torch_harmonics and timm: run make baseline "
    "(or pass --baselines none)"
)


@dataclass(frozen=True)
class BaselineOptions:
    """One baseline's size and training recipe (see the module docstring)."""

    kind: str = "fno"
    width: int = 128
    width_3d: int = 20
    modes: int = 16
    modes_3d: int = 8
    stages: int = 4
    blocks_per_stage: int = 1
    blocks_at_neck: int = 1
    lr: float = 1e-3
    weight_decay: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    noise: float = 0.0
    noise_units: str = "input_std"
    augment: str = "none"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BenchmarkError(f"baseline kind must be one of {KINDS}, got {self.kind!r}")
        if self.noise_units not in NOISE_UNITS:
            raise BenchmarkError(
                f"noise_units must be one of {NOISE_UNITS}, got {self.noise_units!r}"
            )
        if self.augment not in SYMMETRIES:
            raise BenchmarkError(f"augment must be one of {SYMMETRIES}, got {self.augment!r}")
        sizes = (self.width, self.width_3d, self.modes, self.modes_3d, self.stages)
        if min(sizes) < 1 or min(self.blocks_per_stage, self.blocks_at_neck) < 0:
            raise BenchmarkError(f"widths, modes and stages must be >= 1: {self}")
        numbers = (self.lr, self.weight_decay, self.grad_clip, self.noise, *self.betas)
        if not all(math.isfinite(v) and v >= 0 for v in numbers) or not self.lr > 0:
            raise BenchmarkError(f"lr must be > 0, and decay, betas, clip and noise >= 0: {self}")
        if len(self.betas) != 2 or not all(b < 1 for b in self.betas):
            raise BenchmarkError(f"betas must be two numbers in [0, 1), got {self.betas}")

    @classmethod
    def from_mapping(cls, kind: str, fields: Mapping[str, Any], where: str) -> BaselineOptions:
        """Options from a candidate file's ``{field: value}``; a bad field is a one-line error
        naming ``where`` (file and candidate)."""
        if not isinstance(fields, Mapping):
            raise BenchmarkError(f"{where}: expected a mapping of options, got {fields!r}")
        known = {f.name for f in dataclasses.fields(cls)} - {"kind"}
        unknown = sorted(set(map(str, fields)) - known)
        if unknown:
            raise BenchmarkError(f"{where}: unknown option(s) {unknown}; known: {sorted(known)}")
        values = dict(fields)
        try:
            if "betas" in values:
                values["betas"] = tuple(float(b) for b in values["betas"])
            for key in ("lr", "weight_decay", "grad_clip", "noise"):
                if key in values:
                    values[key] = float(values[key])
            for key in ("width", "width_3d", "modes", "modes_3d", "stages"):
                if key in values:
                    values[key] = _int(values[key])
            for key in ("blocks_per_stage", "blocks_at_neck"):
                if key in values:
                    values[key] = _int(values[key])
        except (TypeError, ValueError) as e:
            raise BenchmarkError(f"{where}: {e}") from None
        try:
            return cls(kind=kind, **values)
        except BenchmarkError as e:
            raise BenchmarkError(f"{where}: {e}") from None

    def hidden(self, n_spatial: int) -> int:
        """Width for data with ``n_spatial`` axes."""
        return self.width_3d if n_spatial == 3 else self.width


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def input_noise(x: Tensor, scale: Tensor, options: BaselineOptions) -> Tensor:
    """Noise for a window ``x (B, T, C, *S)`` as ``module.input_noise`` makes it for ours.

    ``scale (B, 1, C, 1, ...)`` is the normaliser's input RMS. Returns a tensor shaped like ``x``.
    """
    return window_noise(x, scale, options.noise, options.noise_units)


def _bare_package(name: str, added: list[str]) -> None:
    """Registers package ``name`` in ``sys.modules`` without running its ``__init__``."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"no package {name}")
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    sys.modules[name] = module
    added.append(name)


def well_model_classes() -> dict[str, type[nn.Module]]:
    """The Well's ``FNO`` and ``UNetConvNext`` classes by kind (see the module docstring).

    Raises:
        BenchmarkError: the ``baseline`` extra is not installed.
    """
    added: list[str] = []
    try:
        importlib.import_module("the_well.benchmark")
        _bare_package("the_well.benchmark.models", added)
        if "timm.models.layers" not in sys.modules:
            for name in ("timm", "timm.layers", "timm.models"):
                _bare_package(name, added)
            layers = types.ModuleType("timm.models.layers")
            layers.DropPath = importlib.import_module("timm.layers.drop").DropPath
            sys.modules["timm.models.layers"] = layers
            added += ["timm.models.layers", "timm.layers.drop"]
        fno = importlib.import_module("the_well.benchmark.models.fno")
        unet = importlib.import_module("the_well.benchmark.models.unet_convnext")
    except ImportError:
        raise BenchmarkError(BASELINE_MISSING) from None
    finally:
        for name in added:  # a later import of these packages runs their own __init__
            sys.modules.pop(name, None)
    return {"fno": fno.FNO, "unet_convnext": unet.UNetConvNext}


def baselines_available() -> bool:
    """Whether The Well's baseline classes can be imported."""
    try:
        well_model_classes()
    except BenchmarkError:
        return False
    return True


class WellBaseline(nn.Module):
    """A model of The Well's behind our model interface.

    ``forward(x (B, T, C, *S), fields, bcs, *, jitter_seed=None) -> (B, 1, C, *S)``: the ``T``
    normalised frames stacked as ``T * C`` channels in, the normalised next-frame delta out.
    ``fields``, ``bcs`` and ``jitter_seed`` are ignored. ``self.net`` is The Well's module.
    """

    def __init__(
        self, n_steps_input: int, n_fields: int, spatial: Sequence[int], options: BaselineOptions
    ) -> None:
        super().__init__()
        cls = well_model_classes()[options.kind]
        n = len(spatial)
        self.n_steps_input, self.n_fields = n_steps_input, n_fields
        common = {
            "dim_in": n_steps_input * n_fields,
            "dim_out": n_fields,
            "n_spatial_dims": n,
            "spatial_resolution": tuple(spatial),
        }
        if n not in (2, 3):
            raise BenchmarkError(f"The Well's {options.kind} takes 2D or 3D data, got {n}D")
        if options.kind == "fno":
            modes = [min(options.modes_3d if n == 3 else options.modes, s) for s in spatial]
            self.net = cls(
                **common,
                modes1=modes[0],
                modes2=modes[1],
                modes3=modes[2] if n == 3 else options.modes_3d,
                hidden_channels=options.hidden(n),
            )
        else:
            step = 2**options.stages
            if any(s % step for s in spatial):
                raise BenchmarkError(
                    f"unet_convnext with {options.stages} stages needs every grid axis divisible "
                    f"by {step}, got {tuple(spatial)}"
                )
            self.net = cls(
                **common,
                stages=options.stages,
                blocks_per_stage=options.blocks_per_stage,
                blocks_at_neck=options.blocks_at_neck,
                init_features=options.hidden(n),
            )

    def forward(
        self, x: Tensor, fields: Tensor, bcs: Tensor, *, jitter_seed: int | None = None
    ) -> Tensor:
        b, t, c = x.shape[:3]
        if (t, c) != (self.n_steps_input, self.n_fields):
            raise ValueError(
                f"baseline built for {self.n_steps_input} frames of {self.n_fields} fields, "
                f"got input {tuple(x.shape)}"
            )
        y = self.net(x.reshape(b, t * c, *x.shape[3:]))  # (B, C, *S)
        return y.unsqueeze(1)  # (B, 1, C, *S)


def _fit(
    model: WellBaseline,
    loader: DataLoader,
    normalizer: Any,
    options: BaselineOptions,
    total_steps: int,
    seconds: float | None,
    seed: int,
) -> tuple[int, float, list[float], float]:
    """Train ``total_steps`` steps (or until ``seconds`` of CPU); returns steps, CPU, trace, loss.

    With ``seconds`` the schedule follows the share of CPU used as well (whichever is further
    along), as our model's does under :class:`~benchmarks.budgets.CPUBudget`.
    """
    start, steps, trace, loss = time.process_time(), 0, [], float("nan")

    def cpu_fraction() -> float:
        return min((time.process_time() - start) / seconds, 1.0)

    opt = torch.optim.AdamW(
        model.parameters(), lr=options.lr, betas=options.betas, weight_decay=options.weight_decay
    )
    sched = WarmupCosine(
        opt,
        total_steps,
        warmup_steps=0.05,
        min_ratio=0.01,
        time_fraction=None if seconds is None else cpu_fraction,
    )
    symmetry = build_symmetry(options.augment, PSEUDO_FIELDS)
    sym_gen = torch.Generator().manual_seed(seed)
    model.train()
    while steps < total_steps:
        for batch in loader:
            if symmetry is not None:
                batch = symmetry(batch, sym_gen)  # one grid symmetry per sample, targets alike
            x, y = batch.input_fields, batch.output_fields[:, 0]  # (B, T, C, *S), (B, C, *S)
            stats = normalizer.fit(x, batch.metadata.get("field_names"))
            if options.noise > 0:
                x = x + input_noise(x, stats.scale, options)  # (B, T, C, *S)
            target = stats.normalize_delta((y - x[:, -1]).unsqueeze(1))[:, 0]  # (B, C, *S)
            pred = model(stats.normalize(x), batch.field_ids, batch.bcs)[:, 0]  # (B, C, *S)
            value = (pred - target).square().mean()
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


def train_baseline(
    ref: DatasetRef,
    budget: Budget,
    *,
    n_steps_input: int,
    batch_size: int,
    time_stride: int | Sequence[int] = 1,
    normalizer: Any = None,
    options: BaselineOptions | None = None,
    probe_steps: int = 10,
    seed: int = 0,
) -> Trained:
    """Train one baseline on the train split of ``ref`` within ``budget``.

    Args:
        ref: the dataset.
        budget: steps, or CPU seconds (probed first on a throw-away model).
        n_steps_input, batch_size, time_stride: as our model's data config.
        normalizer: our model's normaliser (``RMSNormalizer()`` by default).
        options: kind, size and recipe (``BaselineOptions()``, The Well's FNO, by default).
        probe_steps: steps of the CPU probe.
        seed: model init, batch order and symmetry draws.
    """
    options = BaselineOptions() if options is None else options
    normalizer = RMSNormalizer() if normalizer is None else normalizer
    ds = WellDataset(ref.root, ref.name, "train", n_steps_input, 1, time_stride, train=True)
    if len(ds) < batch_size:
        raise BenchmarkError(f"{ref.path}: {len(ds)} training windows, fewer than one batch")

    def loader() -> DataLoader:
        gen = torch.Generator().manual_seed(seed)
        return DataLoader(
            ds, batch_size, shuffle=True, drop_last=True, collate_fn=collate, generator=gen
        )

    def model() -> WellBaseline:
        torch.manual_seed(seed)
        return WellBaseline(n_steps_input, len(ds.field_names), ds.spatial_shape, options)

    info: dict[str, Any] = {"options": dataclasses.asdict(options), "seed": seed}
    seconds = None
    if budget.kind == "steps":
        total = int(budget.value)
    else:
        probe = _fit(model(), loader(), normalizer, options, probe_steps, None, seed)
        per_step = cpu_per_step(probe[2])
        planned, seconds = steps_for_budget(budget.value, per_step), budget.value
        total = step_ceiling(planned)
        info["probe"] = {"steps": probe[0], "cpu_s_per_step": per_step, "planned_steps": planned}
    net = model()
    t0 = time.perf_counter()
    steps, cpu, _, loss = _fit(net, loader(), normalizer, options, total, seconds, seed)
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
