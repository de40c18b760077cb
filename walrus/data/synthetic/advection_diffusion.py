"""3D advection-diffusion of a passive scalar in a steady ABC flow, periodic, pseudo-spectral.

    dc/dt + u . grad(c) = kappa lap(c)
    u = U + (A sin z + C cos y,  B sin x + A cos z,  C sin y + B cos x)

on ``[0, 2pi)^3``: a uniform drift ``U`` plus an Arnold-Beltrami-Childress cellular flow
(divergence-free, so the total amount of ``c`` is conserved). Integrating-factor RK4, diffusion
exact. With ``A = B = C = 0`` the exact solution is ``c_hat(k, t) = c_hat(k, 0) exp(-(i U.k +
kappa |k|^2) t)``. The velocity is written as a field constant in time.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from walrus.data.synthetic.common import (
    Progress,
    Simulation,
    fill_if_rk4_frames,
    smooth_noise,
    wavenumbers,
)


def abc_velocity(n: int, drift: np.ndarray, abc: np.ndarray) -> np.ndarray:
    """Velocity on an ``n^3`` grid of ``[0, 2pi)^3``.

    Args:
        drift: ``(b, 3)`` uniform drift ``U``.
        abc: ``(b, 3)`` amplitudes ``A, B, C``.

    Returns:
        ``(b, n, n, n, 3)`` float64.
    """
    x = np.arange(n) * 2 * np.pi / n
    X, Y, Z = np.meshgrid(x, x, x, indexing="ij")
    a, b, c = (abc[:, i, None, None, None] for i in range(3))
    u = a * np.sin(Z) + c * np.cos(Y) + drift[:, 0, None, None, None]
    v = b * np.sin(X) + a * np.cos(Z) + drift[:, 1, None, None, None]
    w = c * np.sin(Y) + b * np.cos(X) + drift[:, 2, None, None, None]
    return np.stack([u, v, w], axis=-1)


def solve(
    c0: np.ndarray,
    drift: np.ndarray,
    abc: np.ndarray,
    kappa: np.ndarray | float,
    save_dt: float,
    steps: int,
    cfl: float = 1.0,
    progress: Progress | None = None,
) -> np.ndarray:
    """Integrate ``c`` from ``c0`` ``(b, N, N, N)`` in the steady flow of ``abc_velocity``.

    The drift and diffusion are in the integrating factor (exact); the ABC part is explicit.

    Args:
        drift, abc: ``(b, 3)`` drift ``U`` and amplitudes ``A, B, C``.
        kappa: diffusivity, scalar or ``(b,)``.

    Returns:
        ``(b, steps, N, N, N)`` float32, the first frame being ``c0``.
    """
    b, n = c0.shape[0], c0.shape[-1]
    ks = wavenumbers(n, 2 * np.pi, 3)
    k2 = sum(k**2 for k in ks)
    kap = np.broadcast_to(np.asarray(kappa, dtype=np.float64), (b,)).reshape(b, 1, 1, 1)
    vel = abc_velocity(n, np.zeros_like(drift), abc)  # (b, N, N, N, 3) without the drift
    umax = max(np.abs(vel).sum(-1).max(), 1e-3)
    n_sub = max(1, int(np.ceil(save_dt / (cfl * 2 * np.pi / n / umax))))
    dt = save_dt / n_sub
    u_dot_k = sum(drift[:, i, None, None, None] * ks[i] for i in range(3))  # (b, N, N, N//2+1)
    lin = -1j * u_dot_k - kap * k2
    e_full, e_half = np.exp(lin * dt), np.exp(lin * dt / 2)
    comps = [vel[..., i] for i in range(3)]
    shape = (n, n, n)

    def nonlinear(ch: np.ndarray) -> np.ndarray:
        adv = sum(
            comps[i] * np.fft.irfftn(1j * ks[i] * ch, s=shape, axes=(1, 2, 3)) for i in range(3)
        )
        return -np.fft.rfftn(adv, axes=(1, 2, 3))

    c_hat = np.fft.rfftn(c0, axes=(1, 2, 3))
    out = np.empty((b, steps, n, n, n), dtype=np.float32)
    out[:, 0] = c0
    if progress:
        progress(1)
    to_real = partial(np.fft.irfftn, s=shape, axes=(1, 2, 3))
    fill_if_rk4_frames(out, c_hat, nonlinear, e_full, e_half, dt, n_sub, to_real, progress)
    return out


def simulate(
    params: dict[str, np.ndarray],
    resolution: int,
    steps: int,
    rng: np.random.Generator,
    progress: Progress | None = None,
) -> Simulation:
    """``params``: ``kappa``, ``drift`` (max drift speed), ``abc`` (max ABC amplitude),
    ``save_dt``, each ``(n_traj,)``. Drift direction and ABC amplitudes are drawn per trajectory."""
    b, n = params["kappa"].shape[0], resolution
    c0 = 1.0 + 0.5 * smooth_noise(rng, (b, n, n, n), 3, 3.0)  # (b, N, N, N)
    drift = rng.uniform(-1, 1, size=(b, 3)) * params["drift"][:, None]
    abc = rng.uniform(0.3, 1.0, size=(b, 3)) * params["abc"][:, None]
    vel = abc_velocity(n, drift, abc)  # (b, N, N, N, 3)
    save_dt = float(params["save_dt"][0])
    c = solve(c0, drift, abc, params["kappa"], save_dt, steps, progress=progress)
    x = np.arange(n) * 2 * np.pi / n
    return Simulation(
        time=np.arange(steps) * save_dt,
        coords={"x": x, "y": x.copy(), "z": x.copy()},
        fields={"concentration": c},
        vector_fields={"velocity": vel},
        bcs={"x": "periodic", "y": "periodic", "z": "periodic"},
        varying={"velocity": (False, True)},
    )


REGIMES = {"abc": {"kappa": 0.02, "drift": 0.5, "abc": 1.0, "save_dt": 0.05}}
