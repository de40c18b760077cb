"""Gray-Scott reaction-diffusion, periodic, pseudo-spectral.

    dA/dt = D_A lap(A) - A B^2 + F (1 - A)
    dB/dt = D_B lap(B) + A B^2 - (F + k) B

on ``[0, N)^2`` with unit grid spacing (patterns keep their size in pixels at any resolution),
integrating-factor RK4 (diffusion exact). Starts from ``A = 1, B = 0`` with random square
seeds of ``A = 0.5, B = 0.25`` plus noise.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from walrus.data.synthetic.common import Progress, Simulation, fill_if_rk4_frames, wavenumbers


def solve(
    a0: np.ndarray,
    b0: np.ndarray,
    feed: np.ndarray | float,
    kill: np.ndarray | float,
    save_dt: float,
    steps: int,
    dt: float = 2.5,
    d_a: float = 0.2,
    d_b: float = 0.1,
    progress: Progress | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Integrate from ``(a0, b0)``, each ``(n_traj, N, N)`` with unit spacing.

    Args:
        feed, kill: ``F`` and ``k``, scalars or ``(n_traj,)``.
        save_dt: time between saved frames (a multiple of ``dt`` is exact; else ``dt`` shrinks).
        steps: saved frames, the first being the initial state.

    Returns:
        ``A, B`` each ``(n_traj, steps, N, N)`` float64.
    """
    b, n = a0.shape[0], a0.shape[-1]
    kx, ky = wavenumbers(n, float(n), 2)
    k2 = kx**2 + ky**2  # (N, N//2+1)
    f_ = np.broadcast_to(np.asarray(feed, dtype=np.float64), (b,)).reshape(b, 1, 1, 1)
    k_ = np.broadcast_to(np.asarray(kill, dtype=np.float64), (b,)).reshape(b, 1, 1, 1)
    n_sub = max(1, int(np.ceil(save_dt / dt - 1e-9)))
    h = save_dt / n_sub
    lin = -np.stack([d_a * k2, d_b * k2])[None]  # (1, 2, N, N//2+1)
    e_full, e_half = np.exp(lin * h), np.exp(lin * h / 2)
    # reaction: rates of the two fields, a (b, 2, N, N) real state
    sel_a = np.array([1.0, 0.0]).reshape(1, 2, 1, 1)

    def nonlinear(sh: np.ndarray) -> np.ndarray:
        s = np.fft.irfft2(sh, s=(n, n))  # (b, 2, N, N)
        a, bb = s[:, :1], s[:, 1:]
        r = a * bb * bb
        da = -r + f_ * (1.0 - a)
        db = r - (f_ + k_) * bb
        return np.fft.rfft2(sel_a * da + (1 - sel_a) * db)

    s_hat = np.fft.rfft2(np.stack([a0, b0], axis=1))  # (b, 2, N, N//2+1)
    out = np.empty((b, steps, 2, n, n))
    out[:, 0] = np.fft.irfft2(s_hat, s=(n, n))
    if progress:
        progress(1)
    to_real = partial(np.fft.irfft2, s=(n, n))
    fill_if_rk4_frames(out, s_hat, nonlinear, e_full, e_half, h, n_sub, to_real, progress)
    return out[:, :, 0], out[:, :, 1]


def initial_state(rng: np.random.Generator, n_traj: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``A = 1, B = 0`` with 2-5 random square seeds of side ~n/6, plus 1 % noise; each ``(n_traj, N, N)``."""
    a = np.ones((n_traj, n, n))
    b = np.zeros((n_traj, n, n))
    side = max(2, n // 6)
    for i in range(n_traj):
        for _ in range(int(rng.integers(2, 6))):
            cx, cy = rng.integers(0, n, size=2)
            xs = (cx + np.arange(side)) % n
            ys = (cy + np.arange(side)) % n
            a[i][np.ix_(xs, ys)] = 0.5
            b[i][np.ix_(xs, ys)] = 0.25
    a += 0.01 * rng.standard_normal(a.shape)
    b += 0.01 * rng.standard_normal(b.shape)
    return a, np.clip(b, 0.0, None)


def simulate(
    params: dict[str, np.ndarray],
    resolution: int,
    steps: int,
    rng: np.random.Generator,
    progress: Progress | None = None,
) -> Simulation:
    """``params``: ``F``, ``k``, ``save_dt``, each ``(n_traj,)``."""
    n_traj, n = params["F"].shape[0], resolution
    a0, b0 = initial_state(rng, n_traj, n)
    a, b = solve(
        a0, b0, params["F"], params["k"], float(params["save_dt"][0]), steps, progress=progress
    )
    x = np.arange(n, dtype=np.float64)
    return Simulation(
        time=np.arange(steps) * float(params["save_dt"][0]),
        coords={"x": x, "y": x.copy()},
        fields={"A": a, "B": b},
        bcs={"x": "periodic", "y": "periodic"},
    )


REGIMES = {
    "maze": {"F": 0.029, "k": 0.057, "save_dt": 25.0},
    "waves": {"F": 0.022, "k": 0.051, "save_dt": 25.0},
}
