"""Training and scoring runs of the transfer benchmark (:mod:`benchmarks.transfer`), shared by
its leave-one-out mode and its sample-efficiency mode
(:mod:`benchmarks.transfer_sample_efficiency`): the held-out data sets, ``train.py`` and
``infer.py rollout`` in this process, and the leave-one-out pretraining.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.budgets import BenchmarkError, CPUBudget
from benchmarks.transfer_table import MEASURES
from walrus.data.synthetic import SYSTEMS, generate
from walrus.data.well_dataset import WellDataset
from walrus.pretrained import infer

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class DataSet:
    """A Well dataset ``root/name``."""

    root: Path
    name: str

    @property
    def path(self) -> Path:
        return self.root / self.name


def rel(path: str | os.PathLike) -> str:
    """``path`` relative to the current folder (no machine's layout in the JSON)."""
    return os.path.relpath(Path(path).resolve())


def count_trajectories(ref: DataSet, split: str = "test") -> int:
    """Trajectories in ``split`` of ``ref``."""
    ds = WellDataset(ref.root, ref.name, split, 1, 1)
    n = ds.n_trajectories
    ds.close()
    return n


def builtin_set(
    system: str, root: str | os.PathLike, n_traj: Sequence[int], seed: int = 0
) -> DataSet:
    """Built-in ``system`` under ``root``, generated there (``n_traj`` per split) when missing."""
    if system not in SYSTEMS:
        raise BenchmarkError(f"unknown system {system!r}; built-in systems: {', '.join(SYSTEMS)}")
    ref = DataSet(Path(root).resolve(), system)
    if not (ref.path / "data").is_dir():
        generate(system, ref.root, n_traj=tuple(n_traj), seed=seed, progress=False)
    return ref


def external_set(path: str | os.PathLike) -> DataSet:
    """A Well dataset folder (``data/{train,valid,test}``) given with ``--dataset``."""
    path = Path(path).resolve()
    missing = [s for s in ("train", "valid", "test") if not (path / "data" / s).is_dir()]
    if missing:
        raise BenchmarkError(f"--dataset {path}: not a Well dataset folder (no data/{missing[0]})")
    return DataSet(path.parent, path.name)


def fit(overrides: Sequence[str], out: Path, cpu_seconds: float | None = None) -> dict[str, Any]:
    """``train.py`` with ``overrides`` into ``out`` (in this process); steps, CPU and wall
    seconds, final validation metrics, the last checkpoint and ``best``: the best-validation
    checkpoint by the run's checkpoint monitor, with its score and step (``None`` when no
    validation gave a finite score)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from walrus.training.train import train

    extra = [
        f"paths.output_dir={out.resolve()}",
        "callbacks.progress_bar=null",
        f"+callbacks.cpu_time._target_={CPUBudget.__module__}.{CPUBudget.__qualname__}",
        f"+callbacks.cpu_time.seconds={'null' if cpu_seconds is None else cpu_seconds}",
    ]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            cfg = compose(config_name="train", overrides=[*overrides, *extra])
    except (HydraException, OmegaConfBaseException) as e:
        raise BenchmarkError(f"overrides {list(overrides)}: {str(e).splitlines()[0]}") from None
    finally:
        GlobalHydra.instance().clear()
    t0 = time.perf_counter()
    metrics, objects = train(cfg)
    cpu = next(c for c in objects["trainer"].callbacks if isinstance(c, CPUBudget))
    watcher = objects["trainer"].checkpoint_callback
    best = None
    if watcher is not None and watcher.best_model_path:
        step = re.search(r"step(\d+)", Path(watcher.best_model_path).name)
        best = {
            "checkpoint": rel(watcher.best_model_path),
            "val": float(watcher.best_model_score),
            "step": int(step.group(1)) if step else None,
            "monitor": watcher.monitor,
        }
    return {
        "best": best,
        "checkpoint": out / "checkpoints" / "last.ckpt",
        "steps": objects["trainer"].global_step,
        "cpu_s": cpu.used,
        "wall_s": time.perf_counter() - t0,
        "val": {k: v for k, v in metrics.items() if k in ("val/vrmse", "val/rollout_vrmse")},
    }


def evaluate(ckpt: Path, ref: DataSet, out: Path, batch_size: int = 4) -> dict[str, Any]:
    """``infer.py rollout`` of ``ckpt`` on the test split of ``ref``: per source (model,
    persistence) and measure, the mean over fields in each rollout window."""
    result = infer(
        "rollout",
        f"ckpt_path={ckpt}",
        "split=test",
        f"paths.data_dir={ref.root}",
        f"data.datasets=[{ref.name}]",
        f"out={out}",
        f"batch_size={batch_size}",
        "overwrite=true",
        "plots=false",
        "save_predictions=false",
        "progress=false",
    )["metrics"]["datasets"][ref.name]
    m = result["metrics"]
    return {
        "trajectories": len(result["trajectories"]),
        "steps": result["steps"],
        **{
            s: {k: dict(m[s][k]["mean_over_fields"]["windows"]) for k in MEASURES}
            for s in ("model", "persistence")
        },
    }


def _datasets_override(names: Sequence[str]) -> str:
    return "data.datasets=[" + ",".join(f"{{name:{n},weight:1.0}}" for n in names) + "]"


def held_overrides(held: DataSet, seed: int) -> list[str]:
    """``experiment=finetune`` on ``held`` alone with ``seed`` (add ``init_from=`` to fine-tune,
    ``finetune.enabled=false`` to train from scratch)."""
    return [
        "experiment=finetune",
        f"paths.data_dir={held.root}",
        f"data.datasets=[{held.name}]",
        f"seed={seed}",
        "data.generate_if_missing=false",
    ]


def check_pool(held: DataSet, pool: Sequence[DataSet]) -> None:
    """Refuse an empty pretraining pool, or one spread over several data roots."""
    if not pool:
        raise BenchmarkError(f"nothing to pretrain on without {held.name}: widen --systems")
    if len({p.root for p in pool}) != 1:
        raise BenchmarkError("the pretraining systems must share one --data-root")


def pretrain(pool: Sequence[DataSet], seed: int, args: argparse.Namespace, out: Path) -> dict:
    """``experiment=pretrain`` on ``pool`` for ``--pretrain-time`` (see :func:`fit`)."""
    return fit(
        [
            "experiment=pretrain",
            f"paths.data_dir={pool[0].root}",
            _datasets_override([p.name for p in pool]),
            f"trainer.max_time={args.pretrain_time}",
            f"seed={seed}",
            "data.generate_if_missing=false",
            *args.override,
        ],
        out,
    )


def score_zero_shot(ckpt: Path, held: DataSet, out: Path, log: Any = print) -> dict[str, Any]:
    """The pretrained checkpoint rolled out on ``held``'s test split with no fine-tuning:
    ``{"test": ...}`` as :func:`evaluate` scores it, or ``{"skipped": reason}`` when the
    held-out set has fields the checkpoint was never trained on."""
    try:
        return {"test": evaluate(ckpt, held, out)}
    except ValueError as e:
        if "never trained on" not in str(e):
            raise
        log(f"[{held.name}] no zero-shot score: {e}")
        return {"skipped": "the held-out set has fields the pretrained checkpoint never saw"}
