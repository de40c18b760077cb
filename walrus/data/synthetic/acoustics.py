"""2D linear acoustics in a heterogeneous medium, in a closed box with rigid walls.

    dp/dt = -K div(u),    rho du/dt = -grad(p),    K = rho c^2

on ``[0, 1]^2``: staggered grid (pressure at cell centres, each velocity component on the faces
normal to it), second-order differences, Stormer-Verlet in time (half kick, drift, half kick), so
pressure and velocity are saved at the same instants. Rigid walls: the normal velocity is zero on
the boundary faces, so ``sum(p / K)`` is conserved exactly. The medium is a background
(``rho = c = 1``) with random scatterers (disks, or horizontal layers); pulses start at rest.
Like The Well's ``acoustic_scattering``, density and sound speed are written as fields constant in
time.
"""

from __future__ import annotations

import numpy as np

from walrus.data.synthetic.common import Progress, Simulation


def _face_inverse_density(rho: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``1 / rho`` on interior faces: ``(b, N-1, N)`` (x-faces) and ``(b, N, N-1)`` (y-faces)."""
    return 2 / (rho[:, 1:] + rho[:, :-1]), 2 / (rho[:, :, 1:] + rho[:, :, :-1])


def solve(
    p0: np.ndarray,
    rho: np.ndarray,
    c: np.ndarray,
    save_dt: float,
    steps: int,
    cfl: float = 0.5,
    progress: Progress | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Integrate from pressure ``p0`` ``(b, N, N)`` at rest, in the medium ``rho, c`` ``(b, N, N)``.

    Returns:
        pressure ``(b, steps, N, N)`` and cell-centred velocity ``(b, steps, N, N, 2)``, float64.
    """
    b, n = p0.shape[0], p0.shape[-1]
    dx = 1.0 / n
    n_sub = max(1, int(np.ceil(save_dt / (cfl * dx / float(c.max())))))
    dt = save_dt / n_sub
    bulk = rho * c * c  # (b, N, N)
    ix, iy = _face_inverse_density(rho)
    p = p0.astype(np.float64).copy()
    ux = np.zeros((b, n + 1, n))  # x-faces; rows 0 and N are the walls and stay 0
    uy = np.zeros((b, n, n + 1))

    def kick(h: float) -> None:
        ux[:, 1:-1] -= h / dx * ix * (p[:, 1:] - p[:, :-1])
        uy[:, :, 1:-1] -= h / dx * iy * (p[:, :, 1:] - p[:, :, :-1])

    def centred() -> np.ndarray:
        return np.stack([0.5 * (ux[:, 1:] + ux[:, :-1]), 0.5 * (uy[:, :, 1:] + uy[:, :, :-1])], -1)

    pressure = np.empty((b, steps, n, n))
    velocity = np.empty((b, steps, n, n, 2))
    pressure[:, 0], velocity[:, 0] = p, centred()
    if progress:
        progress(1)
    for t in range(1, steps):
        for _ in range(n_sub):
            kick(dt / 2)
            p -= dt / dx * bulk * (ux[:, 1:] - ux[:, :-1] + uy[:, :, 1:] - uy[:, :, :-1])
            kick(dt / 2)
        pressure[:, t], velocity[:, t] = p, centred()
        if progress:
            progress(1)
    return pressure, velocity


def medium(
    rng: np.random.Generator, n_traj: int, n: int, layered: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Density and sound speed ``(b, N, N)``: background 1 with 2-4 random layers or 1-4 disks.

    Each scatterer has density in ``[0.5, 3]`` and sound speed in ``[0.5, 2]``.
    """
    x = (np.arange(n) + 0.5) / n
    xx, yy = np.meshgrid(x, x, indexing="ij")
    rho, c = np.ones((n_traj, n, n)), np.ones((n_traj, n, n))
    for i in range(n_traj):
        if layered:
            edges = np.sort(rng.uniform(0.1, 0.9, size=int(rng.integers(2, 5))))
            shapes = [yy >= e for e in edges]  # each layer overrides the ones below it
        else:
            shapes = []
            for _ in range(int(rng.integers(1, 5))):
                cx, cy = rng.uniform(0.15, 0.85, size=2)
                shapes.append((xx - cx) ** 2 + (yy - cy) ** 2 < rng.uniform(0.05, 0.2) ** 2)
        for inside in shapes:
            rho[i][inside] = rng.uniform(0.5, 3.0)
            c[i][inside] = rng.uniform(0.5, 2.0)
    return rho, c


def initial_pressure(rng: np.random.Generator, n_traj: int, n: int) -> np.ndarray:
    """1-3 Gaussian pulses of width 0.03-0.06 and amplitude +-[0.5, 1], ``(b, N, N)``."""
    x = (np.arange(n) + 0.5) / n
    xx, yy = np.meshgrid(x, x, indexing="ij")
    p = np.zeros((n_traj, n, n))
    for i in range(n_traj):
        for _ in range(int(rng.integers(1, 4))):
            cx, cy = rng.uniform(0.15, 0.85, size=2)
            width = rng.uniform(0.03, 0.06)
            amp = rng.uniform(0.5, 1.0) * rng.choice([-1.0, 1.0])
            p[i] += amp * np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * width**2))
    return p


def simulate(
    params: dict[str, np.ndarray],
    resolution: int,
    steps: int,
    rng: np.random.Generator,
    progress: Progress | None = None,
) -> Simulation:
    """``params``: ``layered`` (1: horizontal layers, 0: disks), ``save_dt``, each ``(n_traj,)``."""
    b, n = params["save_dt"].shape[0], resolution
    rho, c = medium(rng, b, n, bool(params["layered"][0]))
    p0 = initial_pressure(rng, b, n)
    save_dt = float(params["save_dt"][0])
    p, u = solve(p0, rho, c, save_dt, steps, progress=progress)
    x = (np.arange(n) + 0.5) / n
    return Simulation(
        time=np.arange(steps) * save_dt,
        coords={"x": x, "y": x.copy()},
        fields={"pressure": p, "density": rho, "speed_of_sound": c},
        vector_fields={"velocity": u},
        bcs={"x": "wall", "y": "wall"},
        varying={"density": (False, True), "speed_of_sound": (False, True)},
    )


REGIMES = {
    "inclusions": {"layered": 0.0, "save_dt": 0.01},
    "layers": {"layered": 1.0, "save_dt": 0.01},
}
