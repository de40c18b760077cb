"""Stochastic perturbation of each rollout step's change, for ensemble members.

Every step's predicted change (next frame minus last frame) is multiplied by ``1 + amplitude *
r``, with ``r`` a smooth Gaussian random field of unit variance per sample and field: white
noise low-passed with a Gaussian of ``length`` grid cells, drawn afresh every step and kept
correlated in time as an AR(1) process (``r_t = memory * r_{t-1} + sqrt(1 - memory**2) * e_t``,
``r_0 = 0``, so the perturbation ramps up over the first steps). This is the "stochastically
perturbed tendencies" scheme of weather ensembles: members that a deterministic model would
keep together drift apart at the pace of the dynamics they perturb, so their spread can grow
with the error. The draws are seeded, so every member is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# the perturbation of a member with jitter seed s is drawn from seed s ^ this
PERTURBATION_SALT = 0x7E_57_0B


@dataclass(frozen=True)
class Perturbation:
    """Settings of the perturbation.

    Attributes:
        amplitude: standard deviation of the relative change of each step's change (> 0).
        length: correlation length of the random field, in grid cells (> 0).
        memory: AR(1) coefficient between consecutive steps, in ``[0, 1)`` (0: independent).
    """

    amplitude: float
    length: float = 8.0
    memory: float = 0.8

    def __post_init__(self) -> None:
        checks = (
            ("amplitude", self.amplitude, self.amplitude > 0),
            ("length", self.length, self.length > 0),
            ("memory", self.memory, 0 <= self.memory < 1),
        )
        for name, value, ok in checks:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok:
                bound = "in [0, 1)" if name == "memory" else "> 0"
                raise ValueError(f"perturbation {name} must be a number {bound}, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"perturbation {name} must be finite, got {value!r}")


def smooth_noise(
    shape: Sequence[int],
    length: float,
    generator: torch.Generator,
    periodic: Sequence[bool] | None = None,
) -> Tensor:
    """Gaussian random field ``(N, C, *sp)`` of unit variance per sample and field (CPU, float32).

    White noise filtered by a Gaussian kernel of standard deviation ``length`` cells. Periodic
    axes wrap around; a non-periodic axis is drawn twice as long and cut, so its ends are not
    correlated.
    """
    n, c, *sp = shape
    periodic = [True] * len(sp) if periodic is None else list(periodic)
    grid = [s if wrap or s == 1 else 2 * s for s, wrap in zip(sp, periodic)]
    axes = [2 + i for i, s in enumerate(grid) if s > 1]
    white = torch.randn(n, c, *grid, generator=generator)  # (N, C, *grid)
    if not axes:
        return white
    freqs = [torch.fft.fftfreq(grid[ax - 2]) for ax in axes[:-1]]
    freqs.append(torch.fft.rfftfreq(grid[axes[-1] - 2]))
    f2 = sum(g.square() for g in torch.meshgrid(*freqs, indexing="ij"))
    kernel = torch.exp(-2 * (math.pi * length) ** 2 * f2)  # Gaussian of std `length` cells
    shape_k = [1] * len(grid)
    for ax, m in zip(axes, kernel.shape):
        shape_k[ax - 2] = m
    spec = torch.fft.rfftn(white, dim=axes) * kernel.reshape(shape_k)
    field = torch.fft.irfftn(spec, s=[grid[ax - 2] for ax in axes], dim=axes)
    for i, s in enumerate(sp):
        field = field.narrow(2 + i, 0, s)
    std = field.flatten(2).std(dim=-1).clamp(min=1e-12)  # (N, C)
    return field / std.view(n, c, *[1] * len(sp))


# Perturbation of a loaded checkpoint's ensemble members by default (infer.py perturbation=null
# with ensemble >= 2, walrus.ensemble_rollout): chosen on validation (docs/studies.md,
# "Perturbed ensemble members").
DEFAULT_PERTURBATION = Perturbation(0.15, 8.0, 0.8)


class PerturbedSteps:
    """The AR(1) perturbation of one member's rollout: call it on each step's frames in turn.

    Args:
        settings: the perturbation's settings.
        seed: the member's jitter seed (the draws come from ``seed ^ PERTURBATION_SALT``).
        periodic: per spatial axis, whether it wraps around.
    """

    def __init__(self, settings: Perturbation, seed: int, periodic: Sequence[bool]):
        self.settings = settings
        self.periodic = list(periodic)
        self.generator = torch.Generator().manual_seed(seed ^ PERTURBATION_SALT)
        self.state: Tensor | None = None

    def __call__(self, last: Tensor, nxt: Tensor) -> Tensor:
        """``last + (nxt - last) * (1 + amplitude * r_t)``, both ``(N, C, *sp)``."""
        s = self.settings
        e = smooth_noise(nxt.shape, s.length, self.generator, self.periodic)
        r = math.sqrt(1 - s.memory**2) * e
        if self.state is not None:
            r = r + s.memory * self.state
        self.state = r
        gain = 1 + s.amplitude * r.to(device=nxt.device, dtype=nxt.dtype)
        return last + (nxt - last) * gain
