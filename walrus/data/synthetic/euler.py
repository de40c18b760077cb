"""2D compressible Euler equations (ideal gas), finite volume, four-quadrant Riemann problems.

    d(rho)/dt + div(rho u) = 0
    d(rho u)/dt + div(rho u u + p I) = 0
    dE/dt + div((E + p) u) = 0,        p = (gamma - 1) (E - rho |u|^2 / 2)

on ``[0, 1]^2`` (cell centres): MUSCL reconstruction of the primitive variables with minmod
slopes, HLL fluxes (Davis wave-speed bounds), SSP-RK2 in time at a fixed CFL number. Boundaries per
axis through two ghost cells: ``open`` copies the edge cell (zero-gradient outflow), ``periodic``
wraps, ``wall`` mirrors with the normal momentum negated. Each trajectory starts from four constant
states, one per quadrant around a random point, so shocks, rarefactions and contact lines
interact; the built-in dataset uses open boundaries, like The Well's ``euler_multi_quadrants``.
"""

from __future__ import annotations

import numpy as np

from walrus.data.synthetic.common import Progress, Simulation

_PAD_MODE = {"open": "edge", "periodic": "wrap", "wall": "symmetric"}


def _minmod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.maximum(np.minimum(a, b), 0.0) + np.minimum(np.maximum(a, b), 0.0)


def primitive(q: np.ndarray, gamma: float) -> np.ndarray:
    """``(rho, u, v, p)`` of conserved ``q`` ``(b, 4, ...)`` = ``(rho, rho u, rho v, E)``."""
    rho = q[:, 0]
    u, v = q[:, 1] / rho, q[:, 2] / rho
    p = (gamma - 1) * (q[:, 3] - 0.5 * rho * (u * u + v * v))
    return np.stack([rho, u, v, p], axis=1)


def conserved(w: np.ndarray, gamma: float) -> np.ndarray:
    """Inverse of ``primitive``."""
    rho, u, v, p = w[:, 0], w[:, 1], w[:, 2], w[:, 3]
    e = p / (gamma - 1) + 0.5 * rho * (u * u + v * v)
    return np.stack([rho, rho * u, rho * v, e], axis=1)


def _hll(left: np.ndarray, right: np.ndarray, gamma: float) -> np.ndarray:
    """HLL flux between primitive states ``(b, 4, ...)`` ``(rho, u_n, u_t, p)``, normal along u_n.

    Returns ``(b, 4, ...)`` fluxes of ``(rho, m_n, m_t, E)``.
    """
    rl, ul, tl, pl = left[:, 0], left[:, 1], left[:, 2], left[:, 3]
    rr, ur, tr, pr = right[:, 0], right[:, 1], right[:, 2], right[:, 3]
    el = pl / (gamma - 1) + 0.5 * rl * (ul * ul + tl * tl)
    er = pr / (gamma - 1) + 0.5 * rr * (ur * ur + tr * tr)
    cl, cr = np.sqrt(gamma * pl / rl), np.sqrt(gamma * pr / rr)
    # clipping the bounds at 0 folds the supersonic cases (flux f_l or f_r) into one formula:
    # F = (s_r f_l - s_l f_r + s_l s_r (q_r - q_l)) / (s_r - s_l) = a f_l + b f_r + ab (q_r - q_l)
    s_l = np.minimum(np.minimum(ul - cl, ur - cr), 0.0)
    s_r = np.maximum(np.maximum(ul + cl, ur + cr), 0.0)
    inv = 1.0 / (s_r - s_l)
    a, b, ab = s_r * inv, -s_l * inv, s_l * s_r * inv
    ml, mr = rl * ul, rr * ur  # mass fluxes
    f = np.empty_like(left)
    f[:, 0] = a * ml + b * mr + ab * (rr - rl)
    f[:, 1] = a * (ml * ul + pl) + b * (mr * ur + pr) + ab * (mr - ml)
    f[:, 2] = a * ml * tl + b * mr * tr + ab * (rr * tr - rl * tl)
    f[:, 3] = a * ul * (el + pl) + b * ur * (er + pr) + ab * (er - el)
    return f


def _tendency(
    q: np.ndarray, spacing: tuple[float, float], bcs: tuple[str, str], gamma: float
) -> np.ndarray:
    """``dq/dt`` of ``q`` ``(b, 4, Nx, Ny)``."""
    w = primitive(q, gamma)
    out = np.zeros_like(q)
    for normal in (0, 1):
        line = np.moveaxis(w, 2 + normal, -1)  # sweep axis last: (b, 4, M, N)
        if normal == 1:
            line = line[:, [0, 2, 1, 3]]  # (rho, u_n, u_t, p)
        pad = [(0, 0)] * (line.ndim - 1) + [(2, 2)]
        line = np.pad(line, pad, mode=_PAD_MODE[bcs[normal]])  # (b, 4, M, N+4)
        if bcs[normal] == "wall":
            line[:, 1, :, :2] *= -1.0
            line[:, 1, :, -2:] *= -1.0
        d = line[..., 1:] - line[..., :-1]  # (b, 4, M, N+3)
        slope = _minmod(d[..., :-1], d[..., 1:])  # cells 1 .. N+2
        cells = line[..., 1:-1]
        left = (cells + 0.5 * slope)[..., :-1]  # faces between cells j, j+1: (b, 4, M, N+1)
        right = (cells - 0.5 * slope)[..., 1:]
        f = _hll(left, right, gamma)  # (b, 4, M, N+1) in (rho, m_n, m_t, E)
        if normal == 1:
            f = f[:, [0, 2, 1, 3]]
        div = (f[..., 1:] - f[..., :-1]) / spacing[normal]  # (b, 4, M, N)
        out -= np.moveaxis(div, -1, 2 + normal)
    return out


def max_dt(q: np.ndarray, spacing: tuple[float, float], gamma: float, cfl: float) -> float:
    """Largest stable step of ``q`` ``(b, 4, Nx, Ny)`` at Courant number ``cfl``."""
    w = primitive(q, gamma)
    c = np.sqrt(gamma * w[:, 3] / w[:, 0])
    rate = (np.abs(w[:, 1]) + c) / spacing[0] + (np.abs(w[:, 2]) + c) / spacing[1]
    return cfl / float(rate.max())


def solve(
    w0: np.ndarray,
    save_dt: float,
    steps: int,
    gamma: float = 1.4,
    bcs: tuple[str, str] = ("open", "open"),
    cfl: float = 0.4,
    progress: Progress | None = None,
) -> np.ndarray:
    """Integrate from primitive ``w0`` ``(b, 4, Nx, Ny)`` = ``(rho, u, v, p)`` on ``[0, 1]^2``.

    Args:
        bcs: boundary type of the x and y axes, each ``open``, ``periodic`` or ``wall``.

    Returns:
        ``(b, steps, 4, Nx, Ny)`` conserved variables ``(rho, rho u, rho v, E)``, in ``w0``'s
        dtype (the built-in data is computed in float32, the precision it is stored in).
    """
    bad = [b for b in bcs if b not in _PAD_MODE]
    if bad:
        raise ValueError(f"euler: unknown boundary types {bad}; expected {list(_PAD_MODE)}")
    spacing = (1.0 / w0.shape[-2], 1.0 / w0.shape[-1])
    q = conserved(w0, gamma)
    out = np.empty((w0.shape[0], steps, *q.shape[1:]), dtype=q.dtype)
    out[:, 0] = q
    if progress:
        progress(1)
    for t in range(1, steps):
        elapsed = 0.0
        while elapsed < save_dt * (1 - 1e-12):
            dt = min(max_dt(q, spacing, gamma, cfl), save_dt - elapsed)
            q1 = q + dt * _tendency(q, spacing, bcs, gamma)
            q = 0.5 * (q + q1 + dt * _tendency(q1, spacing, bcs, gamma))
            elapsed += dt
        w = primitive(q, gamma)
        if not ((w[:, 0] > 0).all() and (w[:, 3] > 0).all()):
            raise FloatingPointError("euler: density or pressure became non-positive")
        out[:, t] = q
        if progress:
            progress(1)
    return out


def quadrant_states(
    rng: np.random.Generator, n_traj: int, n: int, max_speed: np.ndarray
) -> np.ndarray:
    """Four constant primitive states around a random point in ``[0.3, 0.7]^2``, ``(b, 4, N, N)``.

    Density and pressure are drawn in ``[0.1, 1]``, each velocity component in
    ``[-max_speed, max_speed]`` (per trajectory).
    """
    x = (np.arange(n) + 0.5) / n
    w = np.empty((n_traj, 4, n, n))
    for i in range(n_traj):
        cx, cy = rng.uniform(0.3, 0.7, size=2)
        states = np.concatenate(
            [
                rng.uniform(0.1, 1.0, size=(4, 1)),
                rng.uniform(-1, 1, size=(4, 2)) * max_speed[i],
                rng.uniform(0.1, 1.0, size=(4, 1)),
            ],
            axis=1,
        )  # (quadrant, 4)
        quadrant = (x[:, None] >= cx).astype(int) + 2 * (x[None, :] >= cy)  # (N, N)
        w[i] = np.moveaxis(states[quadrant], -1, 0)
    return w


def simulate(
    params: dict[str, np.ndarray],
    resolution: int,
    steps: int,
    rng: np.random.Generator,
    progress: Progress | None = None,
) -> Simulation:
    """``params``: ``gamma``, ``max_speed`` (initial velocity bound), ``save_dt``, each ``(n_traj,)``."""
    b, n = params["gamma"].shape[0], resolution
    gamma = float(params["gamma"][0])
    w0 = quadrant_states(rng, b, n, params["max_speed"]).astype(np.float32)
    save_dt = float(params["save_dt"][0])
    q = solve(w0, save_dt, steps, gamma=gamma, progress=progress)  # (b, T, 4, N, N)
    rho, mom, e = q[:, :, 0], np.moveaxis(q[:, :, 1:3], 2, -1), q[:, :, 3]
    pressure = (gamma - 1) * (e - 0.5 * (mom**2).sum(-1) / rho)
    x = (np.arange(n) + 0.5) / n
    return Simulation(
        time=np.arange(steps) * save_dt,
        coords={"x": x, "y": x.copy()},
        fields={"density": rho, "energy": e, "pressure": pressure},
        vector_fields={"momentum": mom},  # (b, T, N, N, 2)
        bcs={"x": "open", "y": "open"},
    )


REGIMES = {
    "air": {"gamma": 1.4, "max_speed": 0.5, "save_dt": 0.006},
    "monatomic": {"gamma": 5.0 / 3.0, "max_speed": 0.5, "save_dt": 0.006},
}
