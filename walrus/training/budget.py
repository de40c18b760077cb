"""A wall-clock training budget (``trainer.max_time``) that the learning-rate schedule follows.

The budget covers training *and* the validation that Lightning runs when training stops: the
callback measures how long a validation batch of each dataset takes (the sanity check gives the
first estimate) and ends training as soon as one more training step plus a full validation would
no longer fit. On multi-dataset data the reserve is the sum over datasets of their batch count
times their own batch time; a dataset not yet validated is estimated from its training steps.
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


class BudgetCallback(pl.Callback):
    """A training budget that learning-rate schedules follow.

    :meth:`fraction` is the share of the budget used once the coming optimizer step ends, in
    ``[0, 1]``; ``WalrusModule`` hands the largest fraction over all budget callbacks to a
    scheduler that takes ``time_fraction``, so the learning rate reaches its floor when the first
    budget runs out.
    """

    def fraction(self) -> float:
        raise NotImplementedError


class TimeBudget(BudgetCallback):
    """Stops training so that the run, its final validation included, ends within ``duration``.

    The clock starts when fitting starts (data preparation before it is not counted) and carries
    over a resume, with the measured step and validation times (a resume mid-epoch skips the
    sanity check, and may validate only when it stops). Training stops after the step at which ``fraction()`` reaches 1:

        fraction = (elapsed + next step's duration) / (duration - validation reserve)

    i.e. when the next step (the slowest dataset's mean step) would end past the time left after
    a full validation. Learning-rate
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
        self._val_mark = 0.0  # end of the last validation batch (or validation start)
        self._val_s: dict[str | None, list[float]] = {}  # dataset -> [seconds, batches]
        self._train_s: dict[str | None, list[float]] = {}  # dataset -> [seconds, steps]
        self._full_val_batches: dict[str | None, float] = {}  # dataset -> batches per validation
        self._fraction = 0.0  # rank 0's measure before the last optimizer step

    def elapsed(self) -> float:
        """Seconds of the budget used so far."""
        return self._offset + (self.clock() - self._start if self._start is not None else 0.0)

    def remaining(self) -> float:
        return max(self.duration - self.elapsed(), 0.0)

    def val_batch_seconds(self, dataset: str | None) -> float | None:
        """Seconds per validation batch of ``dataset``: measured, else scaled from a measured
        dataset by the ratio of their training-step times, else the slowest measured one."""
        mean = {d: t / n for d, (t, n) in self._val_s.items() if n}
        if not mean:
            return None
        if dataset in mean:
            return mean[dataset]
        train = {d: t / n for d, (t, n) in self._train_s.items() if n}
        ratios = [mean[d] / train[d] for d in mean if train.get(d)]
        if dataset in train and ratios:
            return max(ratios) * train[dataset]
        return max(mean.values())

    def reserve(self) -> float:
        """Seconds kept back for the validation that runs when training stops."""
        total = 0.0
        for dataset, batches in self._full_val_batches.items():
            per_batch = self.val_batch_seconds(dataset)
            if per_batch is None or not math.isfinite(batches):
                return 0.0
            total += per_batch * batches
        return total

    def measure(self) -> float:
        """Share of the training time used once the next step ends, in ``[0, 1]``, on this rank's clock."""
        if self.stopped:
            return 1.0
        train_time = max(self.duration - self.reserve(), 1e-9)
        return min((self.elapsed() + self.next_step_seconds()) / train_time, 1.0)

    def next_step_seconds(self) -> float:
        """Expected length of the next training step: the mean step of the slowest dataset
        seen (the next batch may come from any), else the last step's."""
        means = [t / n for t, n in self._train_s.values() if n]
        return max(means) if means else self._step_s

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
        spent = self._train_s.setdefault(_dataset(batch), [0.0, 0])
        spent[0] += self._step_s
        spent[1] += 1
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
        self._val_mark = self.clock()
        self._full_val_batches = val_batches_per_dataset(trainer)

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        now = self.clock()
        spent = self._val_s.setdefault(_dataset(batch), [0.0, 0])
        spent[0] += now - self._val_mark  # loading included
        spent[1] += 1
        self._val_mark = now

    def state_dict(self) -> dict[str, Any]:
        """The clock and the step and validation timings, so that a resume that validates only
        at its end (one skipping the sanity check) still keeps room for that validation."""
        return {
            "elapsed": self.elapsed(),
            "val_s": [[d, *v] for d, v in self._val_s.items()],
            "train_s": [[d, *v] for d, v in self._train_s.items()],
            "val_batches": [[d, n] for d, n in self._full_val_batches.items()],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; timings that are not ``[dataset, seconds, count]`` rows
        of finite non-negative numbers (a checkpoint is data) are dropped."""
        self._offset = float(state_dict.get("elapsed", 0.0))
        self._val_s = _timings(state_dict.get("val_s"), 3)
        self._train_s = _timings(state_dict.get("train_s"), 3)
        self._full_val_batches = {
            d: v[0] for d, v in _timings(state_dict.get("val_batches"), 2).items()
        }


def _timings(rows: Any, width: int) -> dict[str | None, list[float]]:
    """``{dataset: [numbers]}`` from ``[[dataset, number, ...], ...]`` rows of ``width``."""
    out: dict[str | None, list[float]] = {}
    for row in rows if isinstance(rows, list) else ():
        if not (isinstance(row, list) and len(row) == width):
            continue
        name, values = row[0], row[1:]
        if (name is None or isinstance(name, str)) and all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            for v in values
        ):
            out[name] = [float(v) for v in values]
    return out


def _dataset(batch: Any) -> str | None:
    meta = getattr(batch, "metadata", None)
    name = meta.get("dataset") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else None


def val_batches_per_dataset(trainer: pl.Trainer) -> dict[str | None, float]:
    """Batches of each dataset in one full validation (``{None: n}`` when the loader does not
    say how its batches split over datasets)."""
    total = float(sum(trainer.num_val_batches))
    loaders = trainer.val_dataloaders
    sampler = getattr(loaders, "batch_sampler", None)
    names = getattr(trainer.datamodule, "dataset_names", None) if trainer.datamodule else None
    sizes = getattr(sampler, "sizes", None)
    if not math.isfinite(total) or not names or not sizes or len(names) != len(sizes):
        return {None: total}
    counts = [float(sampler._n_batches(n)) for n in sizes]
    if sum(counts) <= total:
        return dict(zip(names, counts))
    if trainer.world_size > 1:  # each rank serves a share of every dataset
        scale = total / sum(counts)
        return {n: c * scale for n, c in zip(names, counts)}
    out, left = {}, total  # limit_val_batches: the first batches, in dataset order
    for name, count in zip(names, counts):
        out[name] = min(count, left)
        left -= out[name]
    return out
