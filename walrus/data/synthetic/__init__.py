"""Built-in PDE datasets: our own vectorised solvers, written as Well files.

``generate(system, out)`` writes ``out/{system}/data/{train,valid,test}/{system}_{regime}.hdf5``
and ``out/{system}/stats.yaml``. The same seed gives byte-identical arrays.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from walrus.data.synthetic import (
    acoustics,
    advection_diffusion,
    burgers,
    cahn_hilliard,
    euler,
    gray_scott,
    kuramoto_sivashinsky,
    navier_stokes,
    shallow_water,
)
from walrus.data.synthetic.common import Simulation, System
from walrus.data.well_file import SPLITS
from walrus.data.writer import write_well_file
from walrus.safe_paths import make_dirs, plain_name, refuse_symlinks

SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System(
            "navier_stokes_2d",
            2,
            64,
            80,
            {"decaying": navier_stokes.REGIMES["decaying"]},
            navier_stokes.simulate,
            "2D incompressible Navier-Stokes (vorticity, periodic, pseudo-spectral)",
        ),
        System(
            "gray_scott_2d",
            2,
            64,
            80,
            gray_scott.REGIMES,
            gray_scott.simulate,
            "Gray-Scott reaction-diffusion (periodic, two (F, k) regimes)",
        ),
        System(
            "shallow_water_2d",
            2,
            64,
            80,
            shallow_water.REGIMES,
            shallow_water.simulate,
            "2D shallow water in a box with reflecting walls (finite volume)",
        ),
        System(
            "advection_diffusion_3d",
            3,
            32,
            40,
            advection_diffusion.REGIMES,
            advection_diffusion.simulate,
            "3D advection-diffusion in an ABC flow (periodic, pseudo-spectral)",
        ),
        System(
            "burgers_1d",
            1,
            256,
            80,
            burgers.REGIMES,
            burgers.simulate,
            "1D viscous Burgers with steep fronts (periodic, pseudo-spectral)",
        ),
        System(
            "kuramoto_sivashinsky_1d",
            1,
            128,
            80,
            kuramoto_sivashinsky.REGIMES,
            kuramoto_sivashinsky.simulate,
            "1D Kuramoto-Sivashinsky chaos (periodic, ETDRK4)",
        ),
        System(
            "cahn_hilliard_2d",
            2,
            64,
            80,
            cahn_hilliard.REGIMES,
            cahn_hilliard.simulate,
            "Cahn-Hilliard phase separation (periodic, semi-implicit spectral)",
        ),
        System(
            "euler_riemann_2d",
            2,
            64,
            50,
            euler.REGIMES,
            euler.simulate,
            "2D compressible Euler, four-quadrant Riemann problems (open boundaries, HLL)",
        ),
        System(
            "acoustic_scattering_2d",
            2,
            64,
            80,
            acoustics.REGIMES,
            acoustics.simulate,
            "2D acoustics in a heterogeneous medium between rigid walls (staggered grid)",
        ),
    )
}
# extra regimes a user can ask for by name
EXTRA_REGIMES = {"navier_stokes_2d": {"kolmogorov": navier_stokes.REGIMES["kolmogorov"]}}


def split_counts(n_traj: int | Sequence[int]) -> dict[str, int]:
    """Trajectories per split: an int is the train count (valid/test get ``max(1, n // 6)``)."""
    if isinstance(n_traj, int):
        if n_traj < 1:
            raise ValueError(f"n_traj must be >= 1, got {n_traj}")
        other = max(1, n_traj // 6)
        return {"train": n_traj, "valid": other, "test": other}
    counts = [int(c) for c in n_traj]
    if len(counts) != 3 or min(counts) < 1:
        raise ValueError(
            f"n_traj must be an int or three positive counts (train, valid, test), got {n_traj!r}"
        )
    return dict(zip(SPLITS, counts))


def _regime_counts(n: int, regimes: Sequence[str]) -> list[int]:
    base, extra = divmod(n, len(regimes))
    return [base + (i < extra) for i in range(len(regimes))]


def generate(
    system: str,
    out: str | os.PathLike,
    n_traj: int | Sequence[int] = (24, 4, 4),
    resolution: int | None = None,
    steps: int | None = None,
    seed: int = 0,
    regimes: Sequence[str] | None = None,
    progress: bool = True,
    stats: bool = True,
    overwrite: bool = False,
) -> Path:
    """Simulate a built-in system and write it as a Well dataset.

    Args:
        system: a key of ``SYSTEMS``.
        out: data root; files go to ``out/{system}/data/{split}/``.
        n_traj: train trajectories (valid/test get a sixth each), or ``(train, valid, test)``.
            Each split's trajectories are shared out between the regimes, one file per regime.
        resolution: grid points per axis (default: the system's).
        steps: saved time steps per trajectory (default: the system's).
        seed: base seed; the same seed gives byte-identical arrays.
        regimes: regime names (default: the system's defaults).
        progress: show a Rich progress bar.
        stats: also write ``stats.yaml`` from the train split.
        overwrite: replace a dataset already in ``out/{system}`` (its ``stats.yaml`` and the
            generator's ``{system}_{regime}.hdf5`` files; other files are kept). Without it,
            an existing dataset is refused before anything is simulated.

    Returns:
        The dataset directory ``out/{system}``.

    Raises:
        ValueError: bad arguments, or ``out/{system}`` holds a dataset and not ``overwrite``,
            or a folder there is a symlink (nothing is written through one).
    """
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; built-in systems: {', '.join(SYSTEMS)}")
    spec = SYSTEMS[system]
    available = {**spec.regimes, **EXTRA_REGIMES.get(system, {})}
    regimes = list(regimes or spec.regimes)
    unknown = [r for r in regimes if r not in available]
    if unknown:
        raise ValueError(f"{system}: unknown regimes {unknown}; available: {list(available)}")
    resolution = resolution or spec.resolution
    steps = steps or spec.steps
    if resolution < 8 or steps < 2:
        raise ValueError(
            f"{system}: need resolution >= 8 and steps >= 2, got {resolution}, {steps}"
        )
    counts = split_counts(n_traj)
    root = Path(out) / plain_name(system, "system")
    refuse_symlinks(root, ("data", "stats.yaml"), what=str(root))
    for split in SPLITS:
        refuse_symlinks(root / "data", (split,), what=str(root / "data"))
    existing = sorted(
        str(p.relative_to(root))
        for p in [root / "stats.yaml", *root.glob("data/*/*.hdf5")]
        if os.path.lexists(p)
    )
    if existing and not overwrite:
        shown = ", ".join(existing[:3]) + (", ..." if len(existing) > 3 else "")
        raise ValueError(
            f"{root} already holds a dataset ({shown}); pass --overwrite (overwrite=True) to "
            "replace it, or another --out"
        )

    jobs = []
    for si, split in enumerate(SPLITS):
        for ri, (regime, n) in enumerate(zip(regimes, _regime_counts(counts[split], regimes))):
            if n > 0:
                jobs.append((si, split, ri, regime, n))

    bar = _progress_bar() if progress else None
    with bar or nullcontext():
        for si, split, ri, regime, n in jobs:
            advance = None
            if bar is not None:
                task = bar.add_task(f"{system} {split}/{regime} ({n} traj)", total=steps)
                advance = partial(bar.advance, task)
            rng = np.random.default_rng([seed, si, ri])
            params = {k: np.full(n, float(v)) for k, v in available[regime].items()}
            sim: Simulation = spec.simulate(params, resolution, steps, rng, advance)
            write_well_file(
                make_dirs(Path(out), system, "data", split) / f"{system}_{regime}.hdf5",
                system,
                coords=sim.coords,
                time=sim.time,
                n_trajectories=n,
                fields=sim.fields,
                vector_fields=sim.vector_fields,
                varying=sim.varying,
                bcs=sim.bcs,
                params=available[regime],
            )
    written = {(split, regime) for _, split, _, regime, _ in jobs}
    for split in SPLITS:  # an earlier run's regimes that this one did not write
        for regime in set(available) - {r for s, r in written if s == split}:
            (root / "data" / split / f"{system}_{regime}.hdf5").unlink(missing_ok=True)
    if stats:
        from walrus.data.stats import write_stats

        write_stats(root)
    else:  # an earlier stats.yaml describes other data
        (root / "stats.yaml").unlink(missing_ok=True)
    return root


def _progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TimeElapsedColumn(),
    )


__all__ = ["SYSTEMS", "System", "Simulation", "generate", "split_counts"]
