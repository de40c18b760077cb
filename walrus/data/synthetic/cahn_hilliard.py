"""2D Cahn-Hilliard phase separation, periodic, semi-implicit spectral.

    dc/dt = lap(c^3 - c - eps^2 lap(c))

on ``[0, N)^2`` with unit grid spacing (interfaces keep their width in pixels at any resolution).
Linearly stabilised semi-implicit Euler: the ``eps^2`` term and a stabiliser ``s lap(c)`` are
implicit, the rest explicit, so

    (1 + dt s k^2 + dt eps^2 k^4) c_hat' = (1 + dt s k^2) c_hat - dt k^2 FFT(c^3 - c),

which conserves the mean of ``c`` exactly and lowers the free energy
``F = sum (c^2 - 1)^2 / 4 + eps^2 |grad c|^2 / 2`` at every step. Starts from a uniform mixture
(mean ``c_mean``) plus small noise: spinodal decomposition, then coarsening.
"""

from __future__ import annotations

import numpy as np

from walrus.data.synthetic.common import Progress, Simulation, wavenumbers


def free_energy(c: np.ndarray, eps: float) -> np.ndarray:
    """Free energy per cell of ``c`` ``(..., N, N)`` (unit spacing, spectral gradient), ``(...)``."""
    n = c.shape[-1]
    kx, ky = wavenumbers(n, float(n), 2)
    c_hat = np.fft.rfft2(c)
    grad2 = sum(np.fft.irfft2(1j * k * c_hat, s=(n, n)) ** 2 for k in (kx, ky))
    return (0.25 * (c * c - 1) ** 2 + 0.5 * eps**2 * grad2).mean(axis=(-2, -1))


def solve(
    c0: np.ndarray,
    eps: float,
    save_dt: float,
    steps: int,
    dt: float = 0.5,
    stabiliser: float = 2.0,
    progress: Progress | None = None,
) -> np.ndarray:
    """Integrate ``c`` from ``c0`` ``(n_traj, N, N)``.

    Args:
        save_dt: time between saved frames (``dt`` shrinks to divide it).
        stabiliser: ``s``; ``s >= max |f''(c)| / 2 = 1`` for ``|c| <= 1`` keeps the energy falling.

    Returns:
        ``(n_traj, steps, N, N)`` float64, the first frame being ``c0``.
    """
    n = c0.shape[-1]
    kx, ky = wavenumbers(n, float(n), 2)
    k2 = kx**2 + ky**2  # (N, N//2+1)
    n_sub = max(1, int(np.ceil(save_dt / dt - 1e-9)))
    h = save_dt / n_sub
    explicit = 1 + h * stabiliser * k2
    inv = 1 / (explicit + h * eps**2 * k2**2)
    c_hat = np.fft.rfft2(c0)  # (b, N, N//2+1)
    out = np.empty((c0.shape[0], steps, n, n))
    out[:, 0] = c0
    if progress:
        progress(1)
    for t in range(1, steps):
        for _ in range(n_sub):
            c = np.fft.irfft2(c_hat, s=(n, n))
            c_hat = inv * (explicit * c_hat - h * k2 * np.fft.rfft2(c**3 - c))
        out[:, t] = np.fft.irfft2(c_hat, s=(n, n))
        if progress:
            progress(1)
    return out


def simulate(
    params: dict[str, np.ndarray],
    resolution: int,
    steps: int,
    rng: np.random.Generator,
    progress: Progress | None = None,
) -> Simulation:
    """``params``: ``c_mean`` (largest mean concentration; each trajectory draws its mean's size in
    ``[c_mean / 2, c_mean]`` and its sign at random), ``eps`` (interface width in pixels),
    ``save_dt``, each ``(n_traj,)``."""
    b, n = params["eps"].shape[0], resolution
    size = rng.uniform(0.5, 1.0, size=(b, 1, 1)) * params["c_mean"][:, None, None]
    mean = size * rng.choice([-1.0, 1.0], size=(b, 1, 1))
    c0 = mean + 0.05 * rng.standard_normal((b, n, n))  # (b, N, N)
    save_dt = float(params["save_dt"][0])
    c = solve(c0, float(params["eps"][0]), save_dt, steps, progress=progress)
    x = np.arange(n, dtype=np.float64)
    return Simulation(
        time=np.arange(steps) * save_dt,
        coords={"x": x, "y": x.copy()},
        fields={"concentration": c},
        bcs={"x": "periodic", "y": "periodic"},
    )


REGIMES = {
    "spinodal": {"c_mean": 0.1, "eps": 1.5, "save_dt": 4.0},
    "droplets": {"c_mean": 0.5, "eps": 1.5, "save_dt": 4.0},
}
