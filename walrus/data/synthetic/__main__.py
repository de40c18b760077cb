"""CLI: ``python -m walrus.data.synthetic SYSTEM --out ROOT [--n-traj N --resolution R --steps T --seed S] [--overwrite]``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from walrus.cli import run_cli
from walrus.data.synthetic import EXTRA_REGIMES, SYSTEMS, generate, split_counts
from walrus.memory import available_memory, gib

# bytes per grid point and saved step held while simulating: up to 5 float64 channels
BYTES_PER_POINT = 5 * 8


def _n_traj(text: str) -> int | tuple[int, ...]:
    parts = [int(p) for p in text.split(",")]
    if len(parts) == 1:
        return parts[0]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError("--n-traj takes N (train) or TRAIN,VALID,TEST")
    return tuple(parts)


def _check_sizes(args: argparse.Namespace) -> str | None:
    """Why ``--resolution``, ``--steps`` and ``--n-traj`` cannot run here, or ``None``: each at
    least its minimum, and one split's trajectories (simulated together) within the memory
    available."""
    spec = SYSTEMS[args.system]
    resolution = spec.resolution if args.resolution is None else args.resolution
    steps = spec.steps if args.steps is None else args.steps
    if resolution < 8:
        return f"--resolution must be at least 8, got {resolution}"
    if steps < 2:
        return f"--steps must be at least 2, got {steps}"
    try:
        n = max(split_counts(args.n_traj).values())
    except ValueError as e:
        return f"--n-traj: {e}"
    need = n * steps * resolution**spec.n_spatial * BYTES_PER_POINT
    room = available_memory()
    if need > room:
        grid = "x".join([str(resolution)] * spec.n_spatial)
        return (
            f"--resolution {resolution} --steps {steps} with {n} trajectories per split need "
            f"about {gib(need)} ({grid} grid, {steps} steps), more than the {gib(room)} "
            "available; lower them"
        )
    return None


def main(argv: Sequence[str] | None = None) -> None:
    lines = [f"  {name}: {s.description}" for name, s in SYSTEMS.items()]
    parser = argparse.ArgumentParser(
        prog="python -m walrus.data.synthetic",
        description="Simulate a built-in PDE system and write it as a Well dataset.\n"
        + "\n".join(lines),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("system", choices=sorted(SYSTEMS))
    parser.add_argument(
        "--out", required=True, help="data root; writes OUT/SYSTEM/data/{train,valid,test}"
    )
    parser.add_argument(
        "--n-traj",
        type=_n_traj,
        default=(24, 4, 4),
        help="train trajectories, or TRAIN,VALID,TEST (24,4,4)",
    )
    parser.add_argument("--resolution", type=int, default=None, help="grid points per axis")
    parser.add_argument("--steps", type=int, default=None, help="saved time steps per trajectory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--regimes",
        default=None,
        help="comma-separated regimes (extra: "
        + ", ".join(f"{k}: {'/'.join(v)}" for k, v in EXTRA_REGIMES.items())
        + ")",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a dataset already in OUT/SYSTEM (its stats.yaml and generated files)",
    )
    args = parser.parse_args(argv)
    problem = _check_sizes(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    t0 = time.perf_counter()
    root = run_cli(
        lambda: generate(
            args.system,
            args.out,
            n_traj=args.n_traj,
            resolution=args.resolution,
            steps=args.steps,
            seed=args.seed,
            regimes=args.regimes.split(",") if args.regimes else None,
            overwrite=args.overwrite,
        )
    )
    print(f"wrote {root} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
