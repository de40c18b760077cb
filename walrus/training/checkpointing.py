"""``LastCheckpoint``: keeps ``last.ckpt`` current so that a stopped run loses little work.

It saves the full training state (weights, optimizer, scheduler, step, RNG) to
``<dirpath>/last.ckpt``:

* every ``every_n_steps`` optimizer steps and/or every ``every_minutes`` minutes, whether or
  not validation ran (a kill in the first epoch of a long run keeps most of it);
* at the end of every training epoch, and when training ends for any reason Lightning stops
  cleanly (``trainer.max_steps`` mid-epoch, ``trainer.max_time``, early stopping);
* on SIGTERM (preemption, ``timeout``): Lightning stops at the end of the current step, this
  callback saves, and ``train()`` raises :class:`~walrus.errors.TrainingInterrupted` (exit
  status 143 from ``train.py``);
* on Ctrl-C (SIGINT) during training: the same, at the end of the current step (and of a
  validation under way), with exit status 130. A second Ctrl-C quits at once, keeping the last
  saved checkpoint.

Best-by-metric checkpoints stay with Lightning's ``ModelCheckpoint`` (``save_last: false``),
through :class:`BestCheckpoint`, which does not trust the file paths a checkpoint stores.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from walrus.training.optim import param_groups

LAST_NAME = "last.ckpt"
# With several ranks, they agree on the wall clock (a collective) every this many steps only.
TIME_CHECK_EVERY = 20
_CTRL_C_NOTE = (
    b"\nCtrl-C: stopping after this step to save last.ckpt "
    b"(press Ctrl-C again to quit at once without saving)\n"
)


class CtrlCStop(SIGTERMException):
    """Raised between training steps after Ctrl-C (SIGINT), so that the run stops as on
    SIGTERM: ``last.ckpt`` is saved and ``train()`` raises
    :class:`~walrus.errors.TrainingInterrupted`."""


class LastCheckpoint(pl.Callback):
    """Saves ``<dirpath>/last.ckpt`` on a step/time interval, at epoch/training end, on SIGTERM
    and on Ctrl-C (SIGINT).

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
        self.interrupted_by_sigint = False
        self._sigterm = False
        self._sigint = False
        self._previous_sigint: Any = None
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
        self._sigterm = self._sigint = False
        if threading.current_thread() is not threading.main_thread():
            return
        if trainer.world_size > 1:
            # Lightning's handler runs a collective inside the signal handler, on the signalled
            # rank only, so the ranks' collectives no longer pair up and the stop is lost. This
            # one only notes the signal; the ranks agree on it after each step.
            signal.signal(signal.SIGTERM, self._note_sigterm)
        # Python's default raises KeyboardInterrupt wherever the step is (mid-backward, inside
        # the optimizer); Lightning then exits 1 and saves nothing. This one only notes it.
        self._previous_sigint = signal.signal(signal.SIGINT, self._note_sigint)

    def _note_sigterm(self, signum: int, frame: object) -> None:
        self._sigterm = True

    def _note_sigint(self, signum: int, frame: object) -> None:
        self._sigint = True
        self._restore_sigint()  # a second Ctrl-C interrupts at once
        os.write(2, _CTRL_C_NOTE)  # not print(): a handler may run inside another print

    def _restore_sigint(self) -> None:
        if self._previous_sigint is not None:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def _stop_on_signal(self, trainer: pl.Trainer) -> None:
        """Raise the stop after a SIGTERM or Ctrl-C; with several ranks, any rank's signal
        stops every rank after the same step."""
        sigterm, sigint = self._sigterm, self._sigint
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            flags = torch.tensor(
                [float(sigterm), float(sigint)], device=trainer.strategy.root_device
            )
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            sigterm, sigint = (bool(v > 0) for v in flags.tolist())
        if sigterm:
            raise SIGTERMException()
        if sigint:
            raise CtrlCStop()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object
    ) -> None:
        self._stop_on_signal(trainer)
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
        self._restore_sigint()
        self._save(trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore_sigint()
        # SIGTERMException and CtrlCStop come between steps, so the state is consistent; other
        # exceptions (NaN loss, a second Ctrl-C) keep the last good checkpoint.
        if isinstance(exception, SIGTERMException):
            self.interrupted_by_sigint = isinstance(exception, CtrlCStop)
            self.interrupted_by_sigterm = not self.interrupted_by_sigint
            self._save(trainer)


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` that keeps only file paths inside its own ``dirpath``.

    It saves when validation ends (so ``last.ckpt``, saved at the epoch's end, records the newest
    best file). A resume does not warn that the checkpoint folder is not empty (it holds the
    run's own files).
    On resume, ``ModelCheckpoint`` restores the paths of the best checkpoints from the file and
    later deletes the worst of them. A checkpoint is data: a stored path outside ``dirpath`` (or
    one that is not a string) is dropped with a warning instead of ever being deleted. A
    non-finite score (NaN/Inf) never becomes a best checkpoint.
    """

    resuming = False  # set by ``train()``: the run continues in its own folder

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Save at validation end, before LastCheckpoint saves at the epoch's end: last.ckpt then
        # knows the newest best file, and a resume replaces it instead of keeping it forever.
        kwargs.setdefault("save_on_train_epoch_end", False)
        super().__init__(*args, **kwargs)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():
            if self.resuming:  # the checkpoints there are this run's own: nothing to warn of
                warnings.filterwarnings(
                    "ignore", message=r"Checkpoint directory .* exists and is not empty"
                )
            super().setup(trainer, pl_module, stage)

    def check_monitor_top_k(self, trainer: pl.Trainer, current: torch.Tensor | None = None) -> bool:
        if current is not None and not bool(torch.isfinite(torch.as_tensor(current)).all()):
            return False
        return super().check_monitor_top_k(trainer, current)

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


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_loops(loops: Any, path: str) -> None:
    """Lightning's loop states: mappings whose progress counters are counts or flags."""
    if not isinstance(loops, dict) or not all(isinstance(v, dict) for v in loops.values()):
        raise ValueError(f"checkpoint {path}: its loops entry is not a mapping of loop states")
    stack: list[tuple[str, Any]] = [
        (f"loops/{name}/{key}", value)
        for name, loop in loops.items()
        for key, value in loop.items()
        if str(key).endswith(("progress", "_batches_that_stepped"))
        or str(key).endswith("state_dict")
        and not isinstance(value, dict)
    ]
    while stack:
        where, value = stack.pop()
        if where.endswith("state_dict"):
            raise ValueError(f"checkpoint {path}: {where} must be a mapping")
        if isinstance(value, dict):
            stack.extend((f"{where}/{k}", v) for k, v in value.items())
        elif not (_count(value) or isinstance(value, bool) or value is None):
            raise ValueError(
                f"checkpoint {path}: {where} must be a step count, got a {type(value).__name__}"
            )


def _check_schedulers(schedulers: Any, path: str) -> None:
    """Learning-rate scheduler states: counters are ints, learning rates finite numbers."""
    if not isinstance(schedulers, list) or not all(isinstance(s, dict) for s in schedulers):
        raise ValueError(f"checkpoint {path}: lr_schedulers must be a list of mappings")
    for i, state in enumerate(schedulers):
        for key in ("last_epoch", "_step_count"):
            if key in state and (isinstance(state[key], bool) or not isinstance(state[key], int)):
                raise ValueError(
                    f"checkpoint {path}: lr_schedulers/{i}/{key} must be an int, got a "
                    f"{type(state[key]).__name__}"
                )
        for key in ("base_lrs", "_last_lr"):
            lrs = state.get(key, [])
            if not isinstance(lrs, list) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                for v in lrs
            ):
                raise ValueError(
                    f"checkpoint {path}: lr_schedulers/{i}/{key} must be a list of finite numbers"
                )


def _check_optimizer(states: Any, path: str, shapes: list[list[tuple[int, ...]]]) -> None:
    """One optimizer state whose groups and per-parameter tensors fit ``shapes`` (per group)."""
    if not isinstance(states, list) or len(states) != 1 or not isinstance(states[0], dict):
        raise ValueError(f"checkpoint {path}: optimizer_states must be a list of one mapping")
    groups, per_param = states[0].get("param_groups"), states[0].get("state")
    if (
        not isinstance(groups, list)
        or not isinstance(per_param, dict)
        or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    ):
        raise ValueError(
            f"checkpoint {path}: optimizer_states/0 lacks its param_groups / state mappings"
        )
    if not all(isinstance(i, int) for g in groups for i in g["params"]):
        return  # keyed by parameter name (a sharded strategy's full state): Lightning maps it
    if [len(g["params"]) for g in groups] != [len(s) for s in shapes]:
        raise ValueError(
            f"checkpoint {path}: its optimizer state covers {[len(g['params']) for g in groups]} "
            f"parameters per group; this model has {[len(s) for s in shapes]}"
        )
    for group, group_shapes in zip(groups, shapes, strict=True):
        for pid, shape in zip(group["params"], group_shapes, strict=True):
            entry = per_param.get(pid, {})
            if not isinstance(entry, dict):
                raise ValueError(f"checkpoint {path}: optimizer state of parameter {pid} is odd")
            for name, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"checkpoint {path}: optimizer state {pid}/{name} is not a tensor"
                    )
                if value.ndim and tuple(value.shape) != shape:
                    raise ValueError(
                        f"checkpoint {path}: optimizer state {pid}/{name} has shape "
                        f"{tuple(value.shape)}, its parameter {shape}"
                    )


def check_resume_state(ckpt: dict[str, Any], path: str, module: pl.LightningModule) -> None:
    """Check what Lightning reads when resuming from ``ckpt`` before handing the file to it.

    Args:
        ckpt: the loaded checkpoint.
        path: its file, for messages.
        module: the module being resumed (its optimizer parameter groups give the shapes).

    Raises:
        ValueError: one line naming ``path`` and the entry that is malformed: counters that are
            not counts, a garbage ``loops`` entry, scheduler or optimizer states that do not fit.
    """
    for key in ("epoch", "global_step"):
        if not _count(ckpt.get(key, 0)):
            raise ValueError(
                f"checkpoint {path}: {key} must be a count, got a {type(ckpt[key]).__name__}"
            )
    _check_loops(ckpt.get("loops", {}), path)
    _check_schedulers(ckpt.get("lr_schedulers", []), path)
    if "optimizer_states" in ckpt:
        groups = param_groups(
            module.model,
            getattr(module, "weight_decay", 0.0),
            lr_scales=getattr(module, "lr_scales", None),
        )
        shapes = [[tuple(p.shape) for p in g["params"]] for g in groups]
        _check_optimizer(ckpt["optimizer_states"], path, shapes)


_COUNTERS = ("ready", "started", "processed", "completed")


def settle_epoch_progress(ckpt: dict[str, Any]) -> None:
    """Rewrite, in place, the loop state of a checkpoint saved at the end of a training epoch
    so that Lightning resumes it where an uninterrupted run would be.

    ``last.ckpt`` is saved in ``on_train_epoch_end``: the epoch counts as processed but not yet
    completed. Lightning 2.6 resumes such a file by replaying the epoch's end whenever
    ``trainer.max_steps`` is set, which counts the epoch twice (a run that stopped at
    ``trainer.max_epochs`` then trains nothing when resumed with a larger one), and without
    ``max_steps`` it drops the rest of an epoch that a stop cut short. After this rewrite:

    * an epoch whose batches all ran is completed, and the resume starts the next epoch;
    * an epoch cut short (``max_steps``, ``max_time``, a budget) is in progress, and the resume
      finishes it from the saved data position.

    Any other loop state (saved mid-epoch, on SIGTERM, by validation) is left as it is.
    """
    loops = ckpt.get("loops")
    fit = loops.get("fit_loop") if isinstance(loops, dict) else None
    epochs = fit.get("epoch_progress") if isinstance(fit, dict) else None
    batches = fit.get("epoch_loop.batch_progress") if isinstance(fit, dict) else None
    if not (isinstance(epochs, dict) and isinstance(batches, dict)):
        return
    total, current = epochs.get("total"), epochs.get("current")
    if not (
        isinstance(total, dict)
        and isinstance(current, dict)
        and all(
            isinstance(total.get(k), int) and isinstance(current.get(k), int) for k in _COUNTERS
        )
    ):
        return
    for tracker in (total, current):
        ready, started, processed, completed = (tracker[k] for k in _COUNTERS)
        if not (ready == started == processed >= 1 and completed in (processed - 1, processed)):
            return
    if batches.get("is_last_batch"):
        for tracker in (total, current):
            tracker["completed"] = tracker["processed"]
        batches["current"] = dict.fromkeys(_COUNTERS, 0)
        batches["is_last_batch"] = False
    else:
        for tracker in (total, current):
            tracker["processed"] = tracker["completed"] = tracker["started"] - 1
