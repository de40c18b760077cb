"""1D Kuramoto-Sivashinsky, periodic, pseudo-spectral ETDRK4.

    du/dt + u du/dx + d2u/dx2 + d4u/dx4 = 0

on ``[0, L)``, 2/3-rule dealiasing, exponential time differencing RK4 (Cox-Matthews, with the
phi-function coefficients evaluated by a complex contour mean, after Kassam and Trefethen), so the
stiff linear part ``q^2 - q^4`` is exact. Modes with ``0 < q < 1`` grow; the nonlinearity moves
energy to damped modes, giving spatio-temporal chaos. Each trajectory starts from small noise and is
run for a burn-in time (not saved) to reach the chaotic attractor. The mean of ``u`` is conserved;
``u`` plays the role of a velocity (the equation is Burgers' with anti-diffusion and hyper-diffusion).
"""

from __future__ import annotations

import numpy as np

from walrus.data.synthetic.common import Progress, Simulation, dealias_mask


def etdrk4_coefficients(lin: np.ndarray, dt: float, n_contour: int = 32) -> tuple[np.ndarray, ...]:
    """ETDRK4 coefficients of a diagonal real linear operator ``lin`` (any shape).

    Returns:
        ``(E, E2, Q, f1, f2, f3)``, each shaped like ``lin``: ``E = exp(L dt)``,
        ``E2 = exp(L dt / 2)`` and the weights of the four stages.
    """
    r = np.exp(1j * np.pi * (np.arange(1, n_contour + 1) - 0.5) / n_contour)  # (M,)
    lr = dt * lin[..., None] + r  # (..., M)
    q = dt * np.mean((np.exp(lr / 2) - 1) / lr, axis=-1).real
    f1 = dt * np.mean((-4 - lr + np.exp(lr) * (4 - 3 * lr + lr**2)) / lr**3, axis=-1).real
    f2 = dt * np.mean((2 + lr + np.exp(lr) * (lr - 2)) / lr**3, axis=-1).real
    f3 = dt * np.mean((-4 - 3 * lr - lr**2 + np.exp(lr) * (4 - lr)) / lr**3, axis=-1).real
    return np.exp(lin * dt), np.exp(lin * dt / 2), q, f1, f2, f3


def solve(
    u0: np.ndarray,
    length: float,
    save_dt: float,
    steps: int,
    dt: float = 0.25,
    burn_in: float = 0.0,
    progress: Progress | None = None,
) -> np.ndarray:
    """Integrate ``u`` from ``u0`` ``(n_traj, N)`` on ``[0, length)``.

    Args:
        save_dt: time between saved frames (``dt`` shrinks to divide it).
        burn_in: time integrated before the first saved frame.

    Returns:
        ``(n_traj, steps, N)`` float64.
    """
    n = u0.shape[-1]
    q = 2 * np.pi / length * np.fft.rfftfreq(n, 1.0 / n)  # (N//2+1,)
    mask = dealias_mask(n, 1)
    n_sub = max(1, int(np.ceil(save_dt / dt - 1e-9)))
    h = save_dt / n_sub
    e, e2, qc, f1, f2, f3 = etdrk4_coefficients(q**2 - q**4, h)
    g = -0.5j * q * mask

    def nonlinear(vh: np.ndarray) -> np.ndarray:
        u = np.fft.irfft(vh, n=n)  # (b, N)
        return g * np.fft.rfft(u * u)

    def step(v: np.ndarray) -> np.ndarray:
        nv = nonlinear(v)
        a = e2 * v + qc * nv
        na = nonlinear(a)
        b = e2 * v + qc * na
        nb = nonlinear(b)
        c = e2 * a + qc * (2 * nb - nv)
        nc = nonlinear(c)
        return e * v + f1 * nv + 2 * f2 * (na + nb) + f3 * nc

    v = np.fft.rfft(u0) * mask  # (b, N//2+1)
    for _ in range(int(round(burn_in / h))):
        v = step(v)
    out = np.empty((u0.shape[0], steps, n))
    out[:, 0] = np.fft.irfft(v, n=n)
    if progress:
        progress(1)
    for t in range(1, steps):
        for _ in range(n_sub):
            v = step(v)
        out[:, t] = np.fft.irfft(v, n=n)
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
    """``params``: ``length`` (domain size ``L``), ``burn_in``, ``save_dt``, each ``(n_traj,)``."""
    b, n = params["length"].shape[0], resolution
    length = float(params["length"][0])
    u0 = 0.1 * rng.standard_normal((b, n))
    u0 -= u0.mean(axis=-1, keepdims=True)
    save_dt = float(params["save_dt"][0])
    u = solve(
        u0, length, save_dt, steps, burn_in=float(params["burn_in"][0]), progress=progress
    )  # (b, T, N)
    return Simulation(
        time=np.arange(steps) * save_dt,
        coords={"x": np.arange(n) * length / n},
        fields={},
        vector_fields={"velocity": u[..., None]},  # (b, T, N, 1)
        bcs={"x": "periodic"},
    )


REGIMES = {"chaotic": {"length": 32 * np.pi, "burn_in": 100.0, "save_dt": 1.0}}
