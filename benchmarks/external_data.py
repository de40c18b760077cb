"""A Well-format dataset that none of this project's code simulated or wrote.

Gray-Scott reaction-diffusion on a periodic square grid, solved with the third-party package
py-pde (explicit Euler, numba-compiled) and written with plain h5py in The Well's HDF5 layout:

    A_t = Du lap(A) - A B^2 + F (1 - A)
    B_t = Dv lap(B) + A B^2 - (F + k) B

in grid units (cell size 1, Du = 0.16, Dv = 0.08, time step 1). Each trajectory starts from
A = 1, B = 0 with a few random square seeds (A = 0.5, B = 0.25) plus 2 % noise, runs a burn-in
of ``BURN_IN`` time units, then saves a frame every ``INTERVAL`` time units; a trajectory that
dies out (B flat at the end) is redrawn. Two regimes that keep moving for the whole trajectory
(one file per regime and split, as The Well does): ``waves`` (F = 0.026, k = 0.055) and
``spirals`` (F = 0.022, k = 0.051). Persistence VRMSE over the first test frames is about 0.2
(waves) and 0.4 (spirals) one frame ahead, and above 1 after ten frames (moving fronts).

Run from the repository root (needs ``make baseline``)::

    python -m benchmarks.external_data --out data          # writes data/gray_scott_pypde
    python -m benchmarks.quality --dataset data/gray_scott_pypde --cpu-seconds 150 --seeds 0,1,2

Defaults: 48x48, 80 frames, 24/8/8 trajectories (train/valid/test, ``--n-traj``; at least 8
test trajectories so that the benchmark's test figures are not read off a handful), shared
out between the two regimes. Rerunning replaces the files of an existing
``OUT/gray_scott_pypde`` (each atomically), e.g. one written with the earlier 24/4/4 counts.
About a minute on 2 cores, most of it numba compiling one stepper per regime. The directory
gets ``stats.yaml`` from
``walrus.data.stats`` (the HDF5 files themselves are written here, not by walrus).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import h5py
import numpy as np

from walrus.atomic import atomic_path
from walrus.data.well_file import SPLITS

NAME = "gray_scott_pypde"
DIFFUSION = {"Du": 0.16, "Dv": 0.08}
REGIMES: dict[str, dict[str, float]] = {
    "waves": {"F": 0.026, "k": 0.055},
    "spirals": {"F": 0.022, "k": 0.051},
}
BURN_IN = 400.0
INTERVAL = 20.0
# A trajectory whose B field ends flatter than this died out; it is redrawn.
DEAD_STD = 1e-3
MAX_DRAWS = 5
DT = 1.0
# trajectories per split (train, valid, test)
N_TRAJ = (24, 8, 8)


def initial_state(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random seeds on a resting state: ``(A (n, n), B (n, n))`` float64."""
    a, b = np.ones((n, n)), np.zeros((n, n))
    idx = np.arange(n)
    for _ in range(int(rng.integers(4, 9))):
        cx, cy = rng.integers(0, n, 2)
        half = int(rng.integers(2, 5))
        dx = np.abs((idx - cx + n // 2) % n - n // 2)  # periodic distance to the seed centre
        dy = np.abs((idx - cy + n // 2) % n - n // 2)
        mask = (dx[:, None] <= half) & (dy[None, :] <= half)  # (n, n)
        a[mask], b[mask] = 0.5, 0.25
    a += 0.02 * rng.standard_normal((n, n))
    b += 0.02 * rng.standard_normal((n, n))
    return a, b


def simulate(
    params: Mapping[str, float],
    n_traj: int,
    resolution: int,
    frames: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Solve Gray-Scott with py-pde for ``n_traj`` random initial states.

    Returns:
        ``(n_traj, frames, resolution, resolution, 2)`` float32, channels ``(A, B)``.
    """
    import pde

    n = resolution
    grid = pde.CartesianGrid([[0, n], [0, n]], [n, n], periodic=[True, True])
    eq = pde.PDE(
        {
            "A": "Du * laplace(A) - A * B**2 + F * (1 - A)",
            "B": "Dv * laplace(B) + A * B**2 - (F + k) * B",
        },
        consts={**DIFFUSION, **params},
    )

    def state(a: np.ndarray, b: np.ndarray) -> pde.FieldCollection:
        return pde.FieldCollection(
            [pde.ScalarField(grid, a, label="A"), pde.ScalarField(grid, b, label="B")]
        )

    # One compiled stepper serves every trajectory (compiling per solve would dominate).
    stepper = pde.solvers.EulerSolver(eq, backend="numba").make_stepper(
        state(*initial_state(n, rng)), dt=DT
    )
    out = np.empty((n_traj, frames, n, n, 2), dtype=np.float32)
    for i in range(n_traj):
        for _ in range(MAX_DRAWS):
            s = state(*initial_state(n, rng))
            t = stepper(s, 0.0, BURN_IN)
            for f in range(frames):
                if f:
                    t = stepper(s, t, t + INTERVAL)
                out[i, f] = np.moveaxis(s.data, 0, -1)  # (n, n, 2)
            if not np.isfinite(out[i]).all():
                raise RuntimeError(f"py-pde Gray-Scott {dict(params)} blew up in trajectory {i}")
            if out[i, -1, ..., 1].std() > DEAD_STD:
                break
        else:
            raise RuntimeError(
                f"py-pde Gray-Scott {dict(params)}: {MAX_DRAWS} draws of trajectory {i} died out"
            )
    return out


def _strings(values: Sequence[str]) -> np.ndarray:
    return np.array(list(values), dtype=h5py.string_dtype())


def write_well_hdf5(
    path: str | os.PathLike,
    fields: Mapping[str, np.ndarray],
    time_points: np.ndarray,
    params: Mapping[str, float],
    dataset_name: str = NAME,
) -> Path:
    """Write periodic 2D scalar fields as one Well HDF5 file, with h5py only (atomically).

    Args:
        path: destination ``.hdf5``.
        fields: name -> ``(n_traj, n_time, nx, ny)`` scalar field (t0).
        time_points: ``(n_time,)`` sample times.
        params: simulation parameters (root attributes and constant scalars).
        dataset_name: the ``dataset_name`` root attribute.
    """
    arrays = {k: np.asarray(v, dtype=np.float32) for k, v in fields.items()}
    shapes = {a.shape for a in arrays.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 4:
        raise ValueError(f"{path}: fields must share one (n_traj, n_time, nx, ny) shape: {shapes}")
    n_traj, n_time, nx, ny = next(iter(shapes))
    if np.shape(time_points) != (n_time,):
        raise ValueError(f"{path}: time has shape {np.shape(time_points)}, expected ({n_time},)")
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["dataset_name"] = dataset_name
        f.attrs["n_spatial_dims"] = 2
        f.attrs["n_trajectories"] = n_traj
        f.attrs["grid_type"] = "cartesian"
        f.attrs["simulation_parameters"] = _strings(params)
        for key, value in params.items():
            f.attrs[key] = float(value)

        dims = f.create_group("dimensions")
        dims.attrs["spatial_dims"] = _strings(["x", "y"])
        for key, values, time_varying in (
            ("time", np.asarray(time_points), True),
            ("x", np.arange(nx) + 0.5, False),
            ("y", np.arange(ny) + 0.5, False),
        ):
            ds = dims.create_dataset(key, data=values.astype(np.float32))
            ds.attrs["sample_varying"] = False
            ds.attrs["time_varying"] = time_varying

        bcs = f.create_group("boundary_conditions")
        for axis, size in (("x", nx), ("y", ny)):
            g = bcs.create_group(f"{axis}_periodic")
            g.attrs["bc_type"] = "PERIODIC"
            g.attrs["associated_dims"] = _strings([axis])
            g.attrs["associated_fields"] = _strings([])
            g.attrs["sample_varying"] = False
            g.attrs["time_varying"] = False
            mask = np.zeros(size, dtype=bool)
            mask[[0, -1]] = True
            g.create_dataset("mask", data=mask)
            g.create_dataset("values", data=np.zeros(0, dtype=np.float32))

        scalars = f.create_group("scalars")
        scalars.attrs["field_names"] = _strings(params)
        for key, value in params.items():
            ds = scalars.create_dataset(key, data=np.float32(value))
            ds.attrs["sample_varying"] = False
            ds.attrs["time_varying"] = False

        t0 = f.create_group("t0_fields")
        t0.attrs["field_names"] = _strings(arrays)
        for key, arr in arrays.items():
            ds = t0.create_dataset(key, data=arr, chunks=(1, 1, nx, ny))
            ds.attrs["dim_varying"] = np.array([True, True])
            ds.attrs["sample_varying"] = True
            ds.attrs["time_varying"] = True
        for group in ("t1_fields", "t2_fields"):
            f.create_group(group).attrs["field_names"] = _strings([])
    return Path(path)


def generate(
    out: str | os.PathLike,
    n_traj: Sequence[int] = N_TRAJ,
    resolution: int = 48,
    frames: int = 80,
    seed: int = 0,
    stats: bool = True,
    log: Callable[[str], None] = print,
) -> Path:
    """Simulate every regime and split and write ``out/gray_scott_pypde``.

    Args:
        out: data root.
        n_traj: trajectories per split ``(train, valid, test)``, shared out between regimes.
        resolution: grid points per axis.
        frames: saved frames per trajectory.
        seed: base seed (same seed, same data).
        stats: also write ``stats.yaml`` with ``walrus.data.stats``.
        log: progress messages.

    Returns:
        The dataset directory.
    """
    counts = [int(c) for c in n_traj]
    if len(counts) != 3 or min(counts) < 1:
        raise ValueError(f"n_traj must be three positive counts (train, valid, test), got {n_traj}")
    if resolution < 8 or frames < 2:
        raise ValueError(f"need resolution >= 8 and frames >= 2, got {resolution}, {frames}")
    root = Path(out) / NAME
    time_points = BURN_IN + INTERVAL * np.arange(frames)
    # Simulate per regime, then cut each regime's trajectories into the splits.
    for ri, (regime, params) in enumerate(REGIMES.items()):
        per_split = [c // len(REGIMES) + (ri < c % len(REGIMES)) for c in counts]
        t0 = time.perf_counter()
        data = simulate(
            params, sum(per_split), resolution, frames, np.random.default_rng([seed, ri])
        )
        start = 0
        for split, n in zip(SPLITS, per_split):
            if n == 0:
                continue
            chunk = data[start : start + n]  # (n, frames, nx, ny, 2)
            start += n
            write_well_hdf5(
                root / "data" / split / f"{NAME}_{regime}.hdf5",
                {"A": chunk[..., 0], "B": chunk[..., 1]},
                time_points,
                params,
            )
        log(f"{regime}: {sum(per_split)} trajectories in {time.perf_counter() - t0:.1f} s")
    if stats:
        from walrus.data.stats import write_stats

        write_stats(root)
    return root


def _counts(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.split(",")]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError("--n-traj takes TRAIN,VALID,TEST")
    return parts[0], parts[1], parts[2]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.external_data",
        description="Simulate Gray-Scott with py-pde and write it in The Well's HDF5 layout.",
    )
    parser.add_argument("--out", required=True, help=f"data root; writes OUT/{NAME}")
    parser.add_argument("--n-traj", type=_counts, default=N_TRAJ, help="TRAIN,VALID,TEST")
    parser.add_argument("--resolution", type=int, default=48)
    parser.add_argument("--frames", type=int, default=80, help="saved frames per trajectory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        import pde  # noqa: F401
    except ImportError:
        parser.exit(
            2,
            "benchmarks.external_data needs py-pde: run make baseline\n",
        )
    t0 = time.perf_counter()
    try:
        root = generate(args.out, args.n_traj, args.resolution, args.frames, args.seed)
    except ValueError as e:
        parser.exit(2, f"benchmarks.external_data: {e}\n")
    print(f"wrote {root} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
