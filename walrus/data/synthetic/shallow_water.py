"""2D shallow water in a closed box with reflecting walls, finite volume.

    dh/dt + d(hu)/dx + d(hv)/dy = 0
    d(hu)/dt + d(hu^2 + g h^2 / 2)/dx + d(huv)/dy = 0
    d(hv)/dt + d(huv)/dx + d(hv^2 + g h^2 / 2)/dy = 0

on ``[0, 1]^2`` (cell centres), MUSCL reconstruction with minmod slopes, Rusanov fluxes,
SSP-RK2 in time, reflecting walls through mirrored ghost cells (the normal momentum flips
sign), so no mass crosses a wall and total mass is conserved to round-off. Starts at rest
from a flat surface with 1-3 Gaussian bumps.
"""

from __future__ import annotations

import numpy as np

from walrus.data.synthetic.common import Progress, Simulation


def _minmod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(a * b > 0, np.sign(a) * np.minimum(np.abs(a), np.abs(b)), 0.0)


def _flux(q: np.ndarray, normal: int, g: float) -> np.ndarray:
    """Physical flux of ``q`` ``(b, 3, ...)`` = (h, hu, hv) across faces normal to axis ``normal``."""
    h, hu, hv = q[:, 0], q[:, 1], q[:, 2]
    un = (hu if normal == 0 else hv) / h
    f = np.stack([h * un, hu * un, hv * un], axis=1)
    f[:, 1 + normal] += 0.5 * g * h * h
    return f


def _tendency(q: np.ndarray, dx: float, g: float) -> np.ndarray:
    """``dq/dt`` of ``q`` ``(b, 3, N, N)``."""
    p = np.pad(q, ((0, 0), (0, 0), (2, 2), (2, 2)), mode="symmetric")  # (b, 3, N+4, N+4)
    p[:, 1, :2] *= -1.0
    p[:, 1, -2:] *= -1.0
    p[:, 2, :, :2] *= -1.0
    p[:, 2, :, -2:] *= -1.0
    out = np.zeros_like(q)
    for normal in (0, 1):
        # sweep axis last: (b, 3, N, N+4)
        line = p[:, :, :, 2:-2] if normal == 0 else p[:, :, 2:-2, :]
        if normal == 0:
            line = np.swapaxes(line, 2, 3)
        d = line[..., 1:] - line[..., :-1]  # (b, 3, N, N+3)
        slope = _minmod(d[..., :-1], d[..., 1:])  # cells 1 .. N+2
        cells = line[..., 1:-1]
        left = (cells + 0.5 * slope)[..., :-1]  # faces between cells j, j+1: (b, 3, N, N+1)
        right = (cells - 0.5 * slope)[..., 1:]
        c_l = np.abs(left[:, 1 + normal] / left[:, 0]) + np.sqrt(g * left[:, 0])
        c_r = np.abs(right[:, 1 + normal] / right[:, 0]) + np.sqrt(g * right[:, 0])
        a = np.maximum(c_l, c_r)[:, None]
        flux = 0.5 * (_flux(left, normal, g) + _flux(right, normal, g)) - 0.5 * a * (right - left)
        div = (flux[..., 1:] - flux[..., :-1]) / dx  # (b, 3, N, N)
        out -= np.swapaxes(div, 2, 3) if normal == 0 else div
    return out


def solve(
    h0: np.ndarray,
    save_dt: float,
    steps: int,
    g: float = 1.0,
    cfl: float = 0.4,
    progress: Progress | None = None,
) -> np.ndarray:
    """Integrate from rest with height ``h0`` ``(n_traj, N, N)`` on ``[0, 1]^2``.

    Returns:
        ``(n_traj, steps, 3, N, N)`` float64 conserved variables ``(h, hu, hv)``.
    """
    b, n = h0.shape[0], h0.shape[-1]
    dx = 1.0 / n
    q = np.stack([h0, np.zeros_like(h0), np.zeros_like(h0)], axis=1)  # (b, 3, N, N)
    out = np.empty((b, steps, 3, n, n))
    out[:, 0] = q
    if progress:
        progress(1)
    for t in range(1, steps):
        speed = (np.sqrt(q[:, 1] ** 2 + q[:, 2] ** 2) / q[:, 0] + np.sqrt(g * q[:, 0])).max()
        n_sub = max(1, int(np.ceil(save_dt / (cfl * dx / speed))))
        dt = save_dt / n_sub
        for _ in range(n_sub):
            q1 = q + dt * _tendency(q, dx, g)
            q = 0.5 * (q + q1 + dt * _tendency(q1, dx, g))
        if not (q[:, 0] > 0).all():
            raise FloatingPointError(
                "shallow water: height became non-positive; lower the bump amplitude"
            )
        out[:, t] = q
        if progress:
            progress(1)
    return out


def initial_height(rng: np.random.Generator, n_traj: int, n: int, amp: np.ndarray) -> np.ndarray:
    """``1 + sum of 1-3 Gaussian bumps`` of height up to ``amp`` (per trajectory), ``(n_traj, N, N)``."""
    x = (np.arange(n) + 0.5) / n
    xx, yy = np.meshgrid(x, x, indexing="ij")
    h = np.ones((n_traj, n, n))
    for i in range(n_traj):
        for _ in range(int(rng.integers(1, 4))):
            cx, cy = rng.uniform(0.2, 0.8, size=2)
            width = rng.uniform(0.05, 0.12)
            height = rng.uniform(0.3, 1.0) * amp[i]
            h[i] += height * np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * width**2))
    return h


def simulate(
    params: dict[str, np.ndarray],
    resolution: int,
    steps: int,
    rng: np.random.Generator,
    progress: Progress | None = None,
) -> Simulation:
    """``params``: ``g``, ``amp`` (bump height), ``save_dt``, each ``(n_traj,)``."""
    n_traj, n = params["amp"].shape[0], resolution
    h0 = initial_height(rng, n_traj, n, params["amp"])
    save_dt = float(params["save_dt"][0])
    q = solve(h0, save_dt, steps, g=float(params["g"][0]), progress=progress)  # (b, T, 3, N, N)
    h = q[:, :, 0]
    vel = np.stack([q[:, :, 1] / h, q[:, :, 2] / h], axis=-1)  # (b, T, N, N, 2)
    x = (np.arange(n) + 0.5) / n
    return Simulation(
        time=np.arange(steps) * save_dt,
        coords={"x": x, "y": x.copy()},
        fields={"height": h},
        vector_fields={"velocity": vel},
        bcs={"x": "wall", "y": "wall"},
    )


REGIMES = {"bumps": {"g": 1.0, "amp": 0.5, "save_dt": 0.02}}
