"""Pieces shared by the built-in solvers: the result type, spectral grids, an IF-RK4 step."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

Progress = Callable[[int], None]


@dataclass
class Simulation:
    """The output of one solver run over ``n`` trajectories, ready for ``write_well_file``.

    Attributes:
        time: ``(n_time,)`` saved times.
        coords: ordered axis name -> ``(N_axis,)`` coordinates.
        fields: scalar fields ``(n, n_time, *spatial)``.
        vector_fields: vector fields ``(n, n_time, *spatial, D)`` (or without the time axis when
            listed in ``varying`` as not time-varying).
        bcs: axis name -> boundary type name.
        varying: field name -> ``(time_varying, sample_varying)`` for broadcast fields.
    """

    time: np.ndarray
    coords: dict[str, np.ndarray]
    fields: dict[str, np.ndarray]
    vector_fields: dict[str, np.ndarray] = field(default_factory=dict)
    bcs: dict[str, str] = field(default_factory=dict)
    varying: dict[str, tuple[bool, bool]] = field(default_factory=dict)


@dataclass(frozen=True)
class System:
    """A built-in PDE system.

    Attributes:
        name: dataset name, also the folder name under the data root.
        n_spatial: number of spatial axes.
        resolution: default grid points per axis.
        steps: default number of saved time steps.
        regimes: regime name -> parameters; each regime is written to its own file.
        simulate: ``simulate(params, resolution, steps, rng, progress) -> Simulation`` where
            ``params`` maps each parameter name to a ``(n,)`` array, one value per trajectory.
        description: one line for the CLI help.
    """

    name: str
    n_spatial: int
    resolution: int
    steps: int
    regimes: Mapping[str, Mapping[str, float]]
    simulate: Callable[..., Simulation]
    description: str


def wavenumbers(n: int, length: float, n_spatial: int) -> list[np.ndarray]:
    """Angular wavenumbers of an ``rfftn`` grid, each broadcastable to ``(n,) * (S-1) + (n//2+1,)``."""
    k_full = 2 * np.pi / length * np.fft.fftfreq(n, 1.0 / n)
    k_half = 2 * np.pi / length * np.fft.rfftfreq(n, 1.0 / n)
    out = []
    for ax in range(n_spatial):
        k = k_half if ax == n_spatial - 1 else k_full
        shape = [1] * n_spatial
        shape[ax] = k.size
        out.append(k.reshape(shape))
    return out


def dealias_mask(n: int, n_spatial: int) -> np.ndarray:
    """2/3-rule mask on an ``rfftn`` grid: keep integer wavenumbers with ``|k| < n/3`` on every axis."""
    cut = n / 3.0
    mask = np.ones([1] * n_spatial, dtype=bool)
    for k in wavenumbers(n, 2 * np.pi, n_spatial):
        mask = mask & (np.abs(k) < cut)
    return mask


def smooth_noise(
    rng: np.random.Generator, shape: tuple[int, ...], n_spatial: int, k0: float
) -> np.ndarray:
    """Random fields with a Gaussian spectrum of width ``k0`` (integer wavenumbers), zero mean, unit std.

    Args:
        shape: ``(n, *spatial)``, the last ``n_spatial`` axes periodic grids of equal size.

    Returns:
        ``shape`` float64.
    """
    axes = tuple(range(-n_spatial, 0))
    noise = rng.standard_normal(shape)
    ks = wavenumbers(shape[-1], 2 * np.pi, n_spatial)
    k2 = sum(k**2 for k in ks)
    spec = np.fft.rfftn(noise, axes=axes) * np.exp(-k2 / (2 * k0**2))
    spec[(...,) + (0,) * n_spatial] = 0.0
    out = np.fft.irfftn(spec, s=shape[-n_spatial:], axes=axes)
    return out / out.std(axis=axes, keepdims=True)


def if_rk4_step(
    u_hat: np.ndarray,
    nonlinear: Callable[[np.ndarray], np.ndarray],
    e_full: np.ndarray,
    e_half: np.ndarray,
    dt: float,
) -> np.ndarray:
    """One integrating-factor RK4 step of ``du/dt = L u + N(u)`` in Fourier space.

    Args:
        u_hat: spectral state.
        nonlinear: ``N`` evaluated on a spectral state, returning a spectral tendency.
        e_full: ``exp(L dt)``; e_half: ``exp(L dt / 2)`` (``L`` diagonal).
        dt: time step.
    """
    k1 = nonlinear(u_hat)
    k2 = nonlinear(e_half * (u_hat + 0.5 * dt * k1))
    k3 = nonlinear(e_half * u_hat + 0.5 * dt * k2)
    k4 = nonlinear(e_full * u_hat + dt * e_half * k3)
    return e_full * u_hat + dt / 6.0 * (e_full * k1 + 2.0 * e_half * (k2 + k3) + k4)


def fill_if_rk4_frames(
    out: np.ndarray,
    u_hat: np.ndarray,
    nonlinear: Callable[[np.ndarray], np.ndarray],
    e_full: np.ndarray,
    e_half: np.ndarray,
    dt: float,
    n_sub: int,
    to_real: Callable[[np.ndarray], np.ndarray],
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write saved frames ``1 ..`` of ``out`` ``(B, steps, ...)``: ``n_sub`` IF-RK4 steps apart.

    Frame 0 is the caller's. ``to_real`` maps the spectral state to one saved frame.
    """
    for t in range(1, out.shape[1]):
        for _ in range(n_sub):
            u_hat = if_rk4_step(u_hat, nonlinear, e_full, e_half, dt)
        out[:, t] = to_real(u_hat)
        if progress:
            progress(1)
