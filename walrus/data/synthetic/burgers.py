"""1D viscous Burgers, periodic, pseudo-spectral.

    du/dt + u du/dx = nu d2u/dx2

on ``[0, 2pi)``, 2/3-rule dealiasing, integrating-factor RK4 (viscosity exact), the sub-step set
by an advective CFL number (``max |u|`` never grows, so the first frame's bound holds throughout).
Starts from smooth random data with a random mean drift; steep fronts (viscous shocks) form and
decay. The mean of ``u`` is conserved.
"""

from __future__ import annotations

import numpy as np

from walrus.data.synthetic.common import (
    Progress,
    Simulation,
    dealias_mask,
    fill_if_rk4_frames,
    smooth_noise,
    wavenumbers,
)


def solve(
    u0: np.ndarray,
    nu: float,
    save_dt: float,
    steps: int,
    cfl: float = 0.5,
    progress: Progress | None = None,
) -> np.ndarray:
    """Integrate ``u`` from ``u0`` ``(n_traj, N)`` on ``[0, 2pi)``.

    Returns:
        ``(n_traj, steps, N)`` float64, the first frame being ``u0`` (dealiased).
    """
    n = u0.shape[-1]
    (k,) = wavenumbers(n, 2 * np.pi, 1)  # (N//2+1,)
    mask = dealias_mask(n, 1)
    umax = max(float(np.abs(u0).max()), 1e-3)
    n_sub = max(1, int(np.ceil(save_dt / (cfl * 2 * np.pi / n / umax))))
    dt = save_dt / n_sub
    lin = -nu * k**2
    e_full, e_half = np.exp(lin * dt), np.exp(lin * dt / 2)

    def nonlinear(uh: np.ndarray) -> np.ndarray:
        u = np.fft.irfft(uh, n=n)  # (b, N)
        return -0.5j * k * mask * np.fft.rfft(u * u)

    u_hat = np.fft.rfft(u0) * mask  # (b, N//2+1)
    out = np.empty((u0.shape[0], steps, n))
    out[:, 0] = np.fft.irfft(u_hat, n=n)
    if progress:
        progress(1)
    fill_if_rk4_frames(
        out, u_hat, nonlinear, e_full, e_half, dt, n_sub, lambda h: np.fft.irfft(h, n=n), progress
    )
    return out


def simulate(
    params: dict[str, np.ndarray],
    resolution: int,
    steps: int,
    rng: np.random.Generator,
    progress: Progress | None = None,
) -> Simulation:
    """``params``: ``nu``, ``amp`` (RMS of the initial fluctuation), ``drift`` (largest mean
    velocity; each trajectory draws its mean in ``[-drift, drift]``), ``save_dt``, each ``(n_traj,)``."""
    b, n = params["nu"].shape[0], resolution
    fluct = smooth_noise(rng, (b, n), 1, 4.0) * params["amp"][:, None]
    u0 = fluct + rng.uniform(-1, 1, size=(b, 1)) * params["drift"][:, None]  # (b, N)
    save_dt = float(params["save_dt"][0])
    u = solve(u0, float(params["nu"][0]), save_dt, steps, progress=progress)  # (b, T, N)
    return Simulation(
        time=np.arange(steps) * save_dt,
        coords={"x": np.arange(n) * 2 * np.pi / n},
        fields={},
        vector_fields={"velocity": u[..., None]},  # (b, T, N, 1)
        bcs={"x": "periodic"},
    )


REGIMES = {"shocks": {"nu": 0.02, "amp": 0.5, "drift": 0.5, "save_dt": 0.05}}
