"""A wall-clock training budget (``trainer.max_time``) that the learning-rate schedule follows.

The budget covers training *and* the validation that Lightning runs when training stops: the
callback measures how long a validation batch takes (the sanity check gives the first estimate)
and ends training as soon as one more training step plus a full validation would no longer fit.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

_DURATION = re.compile(r"(\d+):(\d\d):(\d\d):(\d\d)")


def parse_duration(value: str | float | timedelta) -> float:
    """Seconds in ``value``: ``"DD:HH:MM:SS"``, a number of seconds or a ``timedelta``."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.fullmatch(str(value).strip())
        if not match:
            raise ValueError(
                f"trainer.max_time must be DD:HH:MM:SS (e.g. 00:00:05:00 for five minutes) or "
                f"a number of seconds, got {value!r}"
            )
        d, h, m, s = (int(g) for g in match.groups())
        seconds = float(timedelta(days=d, hours=h, minutes=m, seconds=s).total_seconds())
    if not seconds > 0:
        raise ValueError(f"trainer.max_time must be positive, got {value!r}")
    return seconds


class TimeBudget(pl.Callback):
    """Stops training so that the run, its final validation included, ends within ``duration``.

    The clock starts when fitting starts (data preparation before it is not counted) and carries
    over a resume. Training stops after the step at which ``fraction()`` reaches 1:

        fraction = (elapsed + last step's duration) / (duration - validation reserve)

    i.e. when the next step would end past the time left after a full validation. Learning-rate
    schedules read ``fraction()`` to reach their floor at that step. Rank 0 measures it before each
    optimizer step and every rank uses that value, so the ranks of a distributed run agree on the
    learning rate and on when to stop.

    Args:
        duration: ``"DD:HH:MM:SS"``, seconds, or a ``timedelta``.
        clock: seconds from a monotonic clock (injectable for tests).
    """

    def __init__(
        self, duration: str | float | timedelta, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.duration = parse_duration(duration)
        self.clock = clock
        self.stopped = False
        self._offset = 0.0  # elapsed before a resume
        self._start: float | None = None
        self._batch_start = 0.0
        self._step_s = 0.0
        self._val_start = 0.0
        self._val_batches = 0
        self._val_batch_s: float | None = None  # mean seconds per validation batch, measured
        self._full_val_batches = 0.0
        self._fraction = 0.0  # rank 0's measure before the last optimizer step

    def elapsed(self) -> float:
        """Seconds of the budget used so far."""
        return self._offset + (self.clock() - self._start if self._start is not None else 0.0)

    def remaining(self) -> float:
        return max(self.duration - self.elapsed(), 0.0)

    def reserve(self) -> float:
        """Seconds kept back for the validation that runs when training stops."""
        if self._val_batch_s is None or not math.isfinite(self._full_val_batches):
            return 0.0
        return self._val_batch_s * self._full_val_batches

    def measure(self) -> float:
        """Share of the training time used once the next step ends, in ``[0, 1]``, on this rank's clock."""
        if self.stopped:
            return 1.0
        train_time = max(self.duration - self.reserve(), 1e-9)
        return min((self.elapsed() + self._step_s) / train_time, 1.0)

    def fraction(self) -> float:
        """:meth:`measure` as rank 0 took it before the last optimizer step (1 once stopped)."""
        return 1.0 if self.stopped else self._fraction

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = self.clock()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start = self.clock()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # before the scheduler reads it (Lightning steps step-interval schedulers after this
        # optimizer step and before ``on_train_batch_end``)
        self._fraction = float(trainer.strategy.broadcast(self.measure()))

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._step_s = self.clock() - self._batch_start
        if self._fraction >= 1.0 and not self.stopped:
            self.stopped = True
            trainer.should_stop = True
            rank_zero_info(
                f"Time budget: stopping after step {trainer.global_step} "
                f"({timedelta(seconds=int(self.elapsed()))} of "
                f"{timedelta(seconds=int(self.duration))}; "
                f"{self.reserve():.0f} s kept for the final validation)."
            )

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_start = self.clock()
        self._val_batches = 0
        self._full_val_batches = float(sum(trainer.num_val_batches))

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._val_batches += 1

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_batches:
            self._val_batch_s = (self.clock() - self._val_start) / self._val_batches

    def state_dict(self) -> dict[str, Any]:
        return {"elapsed": self.elapsed()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._offset = float(state_dict.get("elapsed", 0.0))
