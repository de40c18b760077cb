"""``LastCheckpoint``: keeps ``last.ckpt`` current so that a stopped run loses little work.

It saves the full training state (weights, optimizer, scheduler, step, RNG) to
``<dirpath>/last.ckpt``:

* every ``every_n_steps`` optimizer steps and/or every ``every_minutes`` minutes, whether or
  not validation ran (a kill in the first epoch of a long run keeps most of it);
* at the end of every training epoch, and when training ends for any reason Lightning stops
  cleanly (``trainer.max_steps`` mid-epoch, ``trainer.max_time``, early stopping);
* on SIGTERM (preemption, ``timeout``): Lightning stops at the end of the current step, this
  callback saves, and ``train()`` raises :class:`~walrus.errors.TrainingInterrupted` (exit
  status 143 from ``train.py``).

Best-by-metric checkpoints stay with Lightning's ``ModelCheckpoint`` (``save_last: false``),
through :class:`BestCheckpoint`, which does not trust the file paths a checkpoint stores.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

LAST_NAME = "last.ckpt"
# With several ranks, they agree on the wall clock (a collective) every this many steps only.
TIME_CHECK_EVERY = 20


class LastCheckpoint(pl.Callback):
    """Saves ``<dirpath>/last.ckpt`` on a step/time interval, at epoch/training end and on SIGTERM.

    Args:
        dirpath: checkpoint directory.
        every_n_steps: save every this many optimizer steps (``None``: no step interval).
        every_minutes: save when this many minutes passed since the last save (``None``: no
            time interval). Rank 0's clock decides for every rank.
    """

    def __init__(
        self,
        dirpath: str | Path,
        every_n_steps: int | None = 1000,
        every_minutes: float | None = 30.0,
    ) -> None:
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool)
            or not isinstance(every_n_steps, int)
            or every_n_steps < 1
        ):
            raise ValueError(
                f"callbacks.last_checkpoint.every_n_steps must be an int >= 1 or null, "
                f"got {every_n_steps!r}"
            )
        if every_minutes is not None and (
            isinstance(every_minutes, bool)
            or not isinstance(every_minutes, int | float)
            or every_minutes <= 0
        ):
            raise ValueError(
                f"callbacks.last_checkpoint.every_minutes must be a number > 0 or null, "
                f"got {every_minutes!r}"
            )
        self.path = Path(dirpath) / LAST_NAME
        self.every_n_steps = every_n_steps
        self.every_minutes = every_minutes
        self.saved_step: int | None = None
        self.interrupted_by_sigterm = False
        self._last_time = time.monotonic()

    def _save(self, trainer: pl.Trainer) -> None:
        if trainer.fast_dev_run or trainer.sanity_checking:
            return
        if self.saved_step == trainer.global_step:
            return
        trainer.save_checkpoint(self.path)
        self.saved_step = trainer.global_step
        self._last_time = time.monotonic()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_time = time.monotonic()
        self.saved_step = trainer.global_step  # a resumed run's file already holds this step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object
    ) -> None:
        step = trainer.global_step
        due = bool(self.every_n_steps) and step % self.every_n_steps == 0
        check_time = trainer.world_size == 1 or step % TIME_CHECK_EVERY == 0
        if self.every_minutes is not None and check_time:
            elapsed = time.monotonic() - self._last_time >= 60 * self.every_minutes
            due = due or trainer.strategy.broadcast(elapsed)
        if due:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Lightning raises SIGTERMException between steps, so the state is consistent; other
        # exceptions (NaN loss, Ctrl+C) keep the last good checkpoint.
        if isinstance(exception, SIGTERMException):
            self.interrupted_by_sigterm = True
            self._save(trainer)


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` that keeps only file paths inside its own ``dirpath``.

    On resume, ``ModelCheckpoint`` restores the paths of the best checkpoints from the file and
    later deletes the worst of them. A checkpoint is data: a stored path outside ``dirpath`` (or
    one that is not a string) is dropped with a warning instead of ever being deleted.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.dirpath is None:
            return
        root = Path(self.dirpath).resolve()

        def inside(path: object) -> bool:
            if not isinstance(path, str) or not path:
                return False
            return Path(path).resolve().parent == root

        dropped = [p for p in self.best_k_models if not inside(p)]
        self.best_k_models = {p: v for p, v in self.best_k_models.items() if inside(p)}
        for attr in ("kth_best_model_path", "best_model_path", "last_model_path"):
            value = getattr(self, attr)
            if value and not inside(value):
                dropped.append(value)
                setattr(self, attr, "")
        if dropped:
            warnings.warn(
                f"checkpoint state named {len(dropped)} file(s) outside {root}; ignored them",
                stacklevel=2,
            )
        if self.kth_best_model_path not in self.best_k_models:
            self.kth_best_model_path = ""
