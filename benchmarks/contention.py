"""Quickstart training throughput alone and beside a competitor, per OpenMP wait policy.

Trains ``experiment=quickstart`` for ``--steps`` steps (``python train.py`` in a subprocess, as a
user runs it) on the built-in Navier–Stokes data, and times the whole command:

* ``alone``: nothing else runs;
* ``torch_loop``: beside a loop of short torch processes, each importing torch and then running
  300 matmuls of 512² on 2 threads (a neighbour running quick scripts);
* ``training``: beside a second, identical training run started in a loop.

Each condition runs under several OpenMP settings, interleaved round by round:

* ``default``: no variable set, so ``train.py``'s choice applies: ``GOMP_SPINCOUNT=10000`` (a
  short spin before sleeping) and the thread tuner (``callbacks.thread_tuner``), which keeps
  the faster of all cores and one thread as the run goes;
* ``passive``: ``OMP_WAIT_POLICY=PASSIVE``, tuner off (the default before the tuner);
* ``spin``: ``GOMP_SPINCOUNT=300000``, libgomp's own default when no policy is set: an idle
  OpenMP thread spins for ~300k iterations before it sleeps (what every run did before the
  entry points chose a policy), tuner off;
* ``short``: ``GOMP_SPINCOUNT=10000``, tuner off.

``--policies`` picks which run (default: ``default`` and ``passive``).

The figure is each condition's wall time over ``alone`` in the same policy (``x_alone``; the
target is at most 2.5x) and over the fastest ``alone`` of any policy (``x_best_alone``), with the
thread tuner's decisions as the run logged them. Competitors run with the user's environment
as it was (the torch loop spins; a competing training run gets ``train.py``'s defaults). The
machine's load average before and after each run is stored with the figures.

Run from the repository root (about 6 minutes on 2 quiet cores with the defaults; ``spin``
beside a competitor adds about 12 minutes a run)::

    python -m benchmarks.contention                # 150 steps, 1 round
    python -m benchmarks.contention --steps 40     # a quicker look
    python -m benchmarks.contention --policies default passive short --name contention_tuner
    python -m benchmarks.contention --render contention_tuner contention_tuner_round2
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR as RESULTS
from benchmarks.common import print_table
from benchmarks.pages import DOCS, write_between
from benchmarks.record import finish_record, run_record, save_result

REPO = Path(__file__).resolve().parents[1]
PAGE = DOCS / "performance.md"
NO_TUNER = ("callbacks.thread_tuner=null",)
# name -> (environment, train.py overrides)
POLICIES: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "default": ({}, ()),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, NO_TUNER),
    "spin": ({"GOMP_SPINCOUNT": "300000"}, NO_TUNER),
    "short": ({"GOMP_SPINCOUNT": "10000"}, NO_TUNER),
}
CONDITIONS = ("alone", "torch_loop", "training")
TORCH_LOOP = (
    "import torch\n"
    "torch.set_num_threads(2)\n"
    "a = torch.randn(512, 512)\n"
    "for _ in range(300):\n"
    "    a @ a\n"
)
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


def _env(policy: dict[str, str]) -> dict[str, str]:
    """The environment without any OpenMP variable, plus ``policy``."""
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARIABLES}
    return {**env, **policy}


def _train_command(
    data: Path, run_dir: Path, steps: int, overrides: tuple[str, ...] = ()
) -> list[str]:
    return [
        sys.executable,
        "train.py",
        "experiment=quickstart",
        f"paths.data_dir={data}",
        f"hydra.run.dir={run_dir}",
        f"trainer.max_steps={steps}",
        "trainer.num_sanity_val_steps=0",
        "trainer.limit_val_batches=0",
        *overrides,
    ]


def python_c(source: str) -> str:
    """A shell command running the (multi-line) Python ``source`` with this interpreter."""
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(source)}"


def _competitor(kind: str, data: Path, scratch: Path, steps: int) -> subprocess.Popen | None:
    """Start ``kind``'s endless loop in its own process group (``None`` for ``alone``)."""
    if kind == "alone":
        return None
    if kind == "torch_loop":
        one = python_c(TORCH_LOOP)
    else:
        cmd = " ".join(_train_command(data, scratch / "competitor", steps))
        one = f"rm -rf {scratch / 'competitor'}; {cmd}"
    return subprocess.Popen(
        ["bash", "-c", f"while true; do {one} >/dev/null 2>&1; done"],
        cwd=REPO,
        env=_env({}),
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    os.killpg(proc.pid, 15)
    proc.wait()


def time_run(policy: str, kind: str, data: Path, scratch: Path, steps: int) -> dict[str, Any]:
    """Wall seconds of one training command under ``policy`` beside ``kind``."""
    run_dir = scratch / f"run-{policy}-{kind}"
    competitor = _competitor(kind, data, scratch, steps)
    try:
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        env, overrides = POLICIES[policy]
        done = subprocess.run(
            _train_command(data, run_dir, steps, overrides),
            cwd=REPO,
            env=_env(env),
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t0
    finally:
        _stop(competitor)
    if done.returncode != 0:
        raise SystemExit(f"training ({policy}, {kind}) failed:\n{done.stderr[-2000:]}")
    log = run_dir / "train.log"  # the tuner logs each change of thread count there
    output = log.read_text() if log.is_file() else ""
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    return {
        "policy": policy,
        "condition": kind,
        "wall_s": wall,
        "tuner": [line.strip() for line in output.splitlines() if "threads: " in line],
        "load1_before": load_before,
        "load1_after": os.getloadavg()[0],
    }


LABELS = {
    "default": "default (`train.py`: short spin + thread tuner)",
    "passive": "passive (`OMP_WAIT_POLICY=PASSIVE`, no tuner)",
    "short": "short spin (`GOMP_SPINCOUNT=10000`, no tuner)",
    "spin": "spinning (`GOMP_SPINCOUNT=300000`, no tuner)",
}
CONDITION_LABELS = {
    "alone": "alone",
    "torch_loop": "beside the torch loop",
    "training": "beside a second training run",
}


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: per setting and condition, each result's wall seconds (and x its own quiet
    run), results in the given order separated by ``/``."""
    policies = [p for r in results for p in r["policies"]]
    policies = list(dict.fromkeys(policies))
    kinds = [k for k in CONDITION_LABELS if any(s["condition"] == k for r in results
                                                for s in r["summary"])]  # fmt: skip
    lines = [
        "| setting | " + " | ".join(CONDITION_LABELS[k] for k in kinds) + " |",
        "|---|" + "---:|" * len(kinds),
    ]
    for policy in policies:
        cells = []
        for kind in kinds:
            rows = [
                s
                for r in results
                for s in r["summary"]
                if s["policy"] == policy and s["condition"] == kind
            ]
            walls = " / ".join(f"{s['wall_s']:.1f}" for s in rows)
            times = " / ".join(f"{s['x_alone']:.2f}×" for s in rows)
            cells.append(f"{walls} s" if kind == "alone" else f"{walls} s ({times})")
        lines.append(f"| {LABELS.get(policy, policy)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(names: list[str], results_dir: Path = RESULTS) -> Path:
    """Write :func:`table` of the saved results ``names`` into :data:`PAGE`.

    Raises:
        FileNotFoundError: a named result is not saved.
    """
    results = []
    for name in names:
        path = results_dir / f"{name}.json"
        if not path.is_file():
            raise FileNotFoundError(f"no {path}: run python -m benchmarks.contention --name {name}")
        results.append(json.loads(path.read_text()))
    return write_between(PAGE, "contention-table", table(results))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="training steps per run")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds")
    parser.add_argument("--name", default="contention", help="result name under benchmarks/results")
    parser.add_argument(
        "--conditions",
        nargs="+",
        default=list(CONDITIONS),
        choices=CONDITIONS,
        help="competitors to time beside (alone is always timed)",
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["default", "passive"],
        choices=list(POLICIES),
        help="OpenMP wait policies to compare",
    )
    parser.add_argument(
        "--render",
        nargs="+",
        metavar="NAME",
        default=None,
        help="only write the saved results NAME... as the table on docs/performance.md",
    )
    args = parser.parse_args(argv)
    if args.render:
        print(f"wrote {render(args.render)}")
        return {}
    record = run_record(sys.argv if argv is None else argv)
    kinds = ["alone", *(k for k in args.conditions if k != "alone")]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="walrus-contention-") as tmp:
        scratch = Path(tmp)
        data = scratch / "data"
        subprocess.run(
            [sys.executable, "-m", "walrus.data.synthetic", "navier_stokes_2d", "--out", str(data)],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        for _ in range(args.rounds):
            for kind in kinds:
                for policy in args.policies:
                    runs.append(time_run(policy, kind, data, scratch, args.steps))
                    print(runs[-1], flush=True)
    rows = []
    best_alone = min(r["wall_s"] for r in runs if r["condition"] == "alone")
    for policy in args.policies:
        alone = statistics.median(
            r["wall_s"] for r in runs if r["policy"] == policy and r["condition"] == "alone"
        )
        for kind in kinds:
            walls = [r["wall_s"] for r in runs if r["policy"] == policy and r["condition"] == kind]
            wall = statistics.median(walls)
            rows.append(
                {
                    "policy": policy,
                    "condition": kind,
                    "wall_s": wall,
                    "x_alone": wall / alone,
                    "x_best_alone": wall / best_alone,
                }
            )
    print_table(rows)
    result = {"steps": args.steps, "rounds": args.rounds, "policies": args.policies, "runs": runs,
              "summary": rows}  # fmt: skip
    result["record"] = finish_record(record)
    path = save_result(args.name, result)
    print(f"saved {path}")
    return result


if __name__ == "__main__":
    main()
