"""2D incompressible Navier-Stokes in vorticity form, periodic, pseudo-spectral.

    dw/dt + u . grad(w) = nu lap(w) - mu w + f,    u = (d psi/dy, -d psi/dx),  -lap(psi) = w

on ``[0, 2pi)^2``, 2/3-rule dealiasing, integrating-factor RK4 (viscosity and drag exact).
Forcing ``f = amp * k_f * cos(k_f y)`` (Kolmogorov) when ``forcing_amp > 0``.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from walrus.data.synthetic.common import (
    Progress,
    Simulation,
    dealias_mask,
    fill_if_rk4_frames,
    smooth_noise,
    wavenumbers,
)


def velocity_from_vorticity(w_hat: np.ndarray, n: int) -> np.ndarray:
    """Velocity of a spectral vorticity ``(..., n, n//2+1)`` -> ``(..., n, n, 2)`` real."""
    kx, ky = wavenumbers(n, 2 * np.pi, 2)
    k2 = kx**2 + ky**2
    psi_hat = np.where(k2 > 0, w_hat / np.where(k2 > 0, k2, 1.0), 0.0)
    u = np.fft.irfft2(1j * ky * psi_hat, s=(n, n))
    v = np.fft.irfft2(-1j * kx * psi_hat, s=(n, n))
    return np.stack([u, v], axis=-1)


def solve_vorticity(
    w0: np.ndarray,
    nu: np.ndarray | float,
    save_dt: float,
    steps: int,
    drag: np.ndarray | float = 0.0,
    forcing_amp: np.ndarray | float = 0.0,
    forcing_k: int = 4,
    cfl: float = 1.0,
    progress: Progress | None = None,
) -> np.ndarray:
    """Integrate vorticity from ``w0`` and return ``steps`` saved frames (the first is ``w0``).

    Args:
        w0: ``(n_traj, N, N)`` initial vorticity on ``[0, 2pi)^2`` (axis 0 is x).
        nu, drag, forcing_amp: scalars or ``(n_traj,)`` per trajectory.
        save_dt: time between saved frames.
        steps: number of saved frames.
        cfl: advective Courant number used to pick the sub-step.

    Returns:
        ``(n_traj, steps, N, N)`` float64 vorticity.
    """
    b, n = w0.shape[0], w0.shape[-1]
    kx, ky = wavenumbers(n, 2 * np.pi, 2)
    k2 = kx**2 + ky**2
    keep = dealias_mask(n, 2)

    def per_traj(v: np.ndarray | float) -> np.ndarray:
        return np.broadcast_to(np.asarray(v, dtype=np.float64), (b,)).reshape(b, 1, 1)

    nu_, drag_, amp = per_traj(nu), per_traj(drag), per_traj(forcing_amp)
    y = np.arange(n) * 2 * np.pi / n
    f_real = amp * forcing_k * np.cos(forcing_k * y)[None, None, :]  # (b, 1, N)
    f_hat = np.fft.rfft2(np.broadcast_to(f_real, (b, n, n)))

    w_hat = np.fft.rfft2(w0) * keep
    umax = max(np.abs(velocity_from_vorticity(w_hat, n)).max(), 1e-3)
    n_sub = max(1, int(np.ceil(save_dt / (cfl * 2 * np.pi / n / (1.5 * umax)))))
    dt = save_dt / n_sub
    lin = -nu_ * k2 - drag_  # (b, N, N//2+1)
    e_full, e_half = np.exp(lin * dt), np.exp(lin * dt / 2)

    def nonlinear(wh: np.ndarray) -> np.ndarray:
        psi = np.where(k2 > 0, wh / np.where(k2 > 0, k2, 1.0), 0.0)
        u = np.fft.irfft2(1j * ky * psi, s=(n, n))
        v = np.fft.irfft2(-1j * kx * psi, s=(n, n))
        wx = np.fft.irfft2(1j * kx * wh, s=(n, n))
        wy = np.fft.irfft2(1j * ky * wh, s=(n, n))
        return keep * (f_hat - np.fft.rfft2(u * wx + v * wy))

    out = np.empty((b, steps, n, n))
    out[:, 0] = np.fft.irfft2(w_hat, s=(n, n))
    if progress:
        progress(1)
    to_real = partial(np.fft.irfft2, s=(n, n))
    fill_if_rk4_frames(out, w_hat, nonlinear, e_full, e_half, dt, n_sub, to_real, progress)
    return out


def simulate(
    params: dict[str, np.ndarray],
    resolution: int,
    steps: int,
    rng: np.random.Generator,
    progress: Progress | None = None,
) -> Simulation:
    """Random decaying or Kolmogorov-forced turbulence; see the module docstring.

    ``params``: ``nu``, ``drag``, ``forcing_amp``, ``k0`` (peak wavenumber of the initial
    spectrum), ``u_rms`` (initial velocity RMS), ``save_dt``, each ``(n_traj,)``.
    """
    n = resolution
    w0 = np.stack(
        [smooth_noise(rng, (1, n, n), 2, float(k0))[0] for k0 in params["k0"]]
    )  # (n_traj, N, N) unit-std vorticity
    w0_hat = np.fft.rfft2(w0) * dealias_mask(n, 2)
    u0 = velocity_from_vorticity(w0_hat, n)
    scale = params["u_rms"] / np.sqrt((u0**2).sum(-1).mean(axis=(1, 2)))
    w0 = np.fft.irfft2(w0_hat, s=(n, n)) * scale[:, None, None]
    save_dt = float(params["save_dt"][0])
    w = solve_vorticity(
        w0, params["nu"], save_dt, steps, params["drag"], params["forcing_amp"], progress=progress
    )  # (n_traj, T, N, N)
    vel = velocity_from_vorticity(np.fft.rfft2(w), n)  # (n_traj, T, N, N, 2)
    x = np.arange(n) * 2 * np.pi / n
    return Simulation(
        time=np.arange(steps) * save_dt,
        coords={"x": x, "y": x.copy()},
        fields={"vorticity": w},
        vector_fields={"velocity": vel},
        bcs={"x": "periodic", "y": "periodic"},
    )


REGIMES = {
    "decaying": {
        "nu": 5e-3,
        "drag": 0.0,
        "forcing_amp": 0.0,
        "k0": 3.0,
        "u_rms": 1.0,
        "save_dt": 0.1,
    },
    "kolmogorov": {
        "nu": 5e-3,
        "drag": 0.1,
        "forcing_amp": 0.1,
        "k0": 3.0,
        "u_rms": 1.0,
        "save_dt": 0.1,
    },
}
