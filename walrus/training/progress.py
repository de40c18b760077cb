"""Plain progress lines for runs whose output is not a terminal (nohup, batch queues, CI)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TextIO

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import RichProgressBar

from walrus.training.budget import TimeBudget


def _fmt_seconds(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class ProgressLine(pl.Callback):
    """Prints ``step 40/400  loss 0.1234  52.1 samples/s  ETA 0:03:10`` at intervals.

    Only when ``stream`` is not a TTY (a terminal already shows the progress bar). A line is
    printed every ``every_n_steps`` optimiser steps and/or every ``every_seconds`` seconds,
    whichever comes first, and once when training ends. The line shows the limit that will end
    the run: the step limit (``step 40/400``) or, when the time budget (``trainer.max_time``)
    runs out first at the recent step rate, the budget (``step 40  time 0:01:10/0:03:00``).
    The ETA is the sooner of the two.

    Args:
        every_n_steps: steps between lines (``None``: by time only).
        every_seconds: seconds between lines (``None``: by steps only).
        stream: where to print; defaults to ``sys.stdout`` at print time.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        every_seconds: float | None = 30.0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if every_n_steps is None and every_seconds is None:
            raise ValueError("ProgressLine: set every_n_steps or every_seconds")
        self.every_n_steps = every_n_steps
        self.every_seconds = every_seconds
        self.stream = stream
        self.clock = clock
        self._last_time = 0.0
        self._last_step = 0
        self._samples = 0
        self._rate = 0.0  # seconds per step, recent

    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stdout

    def enabled(self) -> bool:
        return not _is_terminal(self._out())

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_time = self.clock()
        self._last_step = trainer.global_step
        self._samples = 0

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        fields = getattr(batch, "input_fields", None)
        if isinstance(fields, torch.Tensor):
            self._samples += fields.shape[0] * trainer.world_size
        step, now = trainer.global_step, self.clock()
        due_steps = self.every_n_steps is not None and step % self.every_n_steps == 0
        due_time = self.every_seconds is not None and now - self._last_time >= self.every_seconds
        if step > self._last_step and (due_steps or due_time):
            self._print(trainer, outputs, now)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step > self._last_step:
            self._print(trainer, None, self.clock())

    def _print(self, trainer: pl.Trainer, outputs: Any, now: float) -> None:
        step = trainer.global_step
        dt = max(now - self._last_time, 1e-9)
        self._rate = dt / (step - self._last_step)
        total = _total_steps(trainer)
        budget = next((c for c in trainer.callbacks if isinstance(c, TimeBudget)), None)
        if budget is not None and self._budget_binds(trainer, budget, total):
            used, whole = _fmt_seconds(budget.elapsed()), _fmt_seconds(budget.duration)
            parts = [f"step {step}  time {used}/{whole}"]
        else:
            parts = [f"step {step}" + (f"/{total}" if total else "")]
        loss = _loss(outputs, trainer)
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        if self._samples:
            parts.append(f"{self._samples / dt:.1f} samples/s")
        eta = self._eta(trainer, total)
        if eta is not None:
            parts.append(f"ETA {_fmt_seconds(eta)}")
        self._last_time, self._last_step, self._samples = now, step, 0
        if trainer.is_global_zero and self.enabled():
            print("  ".join(parts), file=self._out(), flush=True)

    def _budget_binds(self, trainer: pl.Trainer, budget: TimeBudget, total: int | None) -> bool:
        """Whether the time budget ends training before the step limit at the budget's step
        time (the time it keeps for the final validation counted)."""
        if not total:
            return True
        per_step = budget.next_step_seconds() or self._rate
        training_left = budget.remaining() - budget.reserve()
        return training_left < max(total - trainer.global_step, 0) * per_step

    def _eta(self, trainer: pl.Trainer, total: int | None) -> float | None:
        etas = []
        if total:
            etas.append(max(total - trainer.global_step, 0) * self._rate)
        budget = next((c for c in trainer.callbacks if isinstance(c, TimeBudget)), None)
        if budget is not None:
            etas.append(budget.remaining())
        return min(etas) if etas else None


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(callable(isatty) and isatty())


def _total_steps(trainer: pl.Trainer) -> int | None:
    total = trainer.estimated_stepping_batches
    return int(total) if total != float("inf") else None


def _loss(outputs: Any, trainer: pl.Trainer) -> float | None:
    value = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if not isinstance(value, torch.Tensor):
        value = trainer.callback_metrics.get("train/loss")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    return None


class ProgressBar(RichProgressBar):
    """Lightning's Rich progress bar, reading the logged metrics every ``metrics_every_n_steps``.

    Reading a logged device tensor is a host sync; the stock bar reads them after every step.
    Between reads the bar shows the last values read. When stdout is not a terminal the bar
    stays off (written to a file it wraps mid-name); :class:`ProgressLine` reports instead.
    """

    def __init__(self, metrics_every_n_steps: int = 10, **kwargs: Any) -> None:
        if isinstance(metrics_every_n_steps, bool) or not isinstance(metrics_every_n_steps, int):
            raise ValueError(
                "callbacks.progress_bar.metrics_every_n_steps must be an int >= 1, "
                f"got {metrics_every_n_steps!r}"
            )
        if metrics_every_n_steps < 1:
            raise ValueError(
                "callbacks.progress_bar.metrics_every_n_steps must be an int >= 1, "
                f"got {metrics_every_n_steps}"
            )
        super().__init__(**kwargs)
        self.metrics_every_n_steps = metrics_every_n_steps
        self._shown: dict[str, int | str | float | dict[str, float]] | None = None
        self._read_at: int | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not _is_terminal(sys.stdout):
            self.disable()
        super().setup(trainer, pl_module, stage)

    def get_metrics(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> dict[str, int | str | float | dict[str, float]]:
        step = trainer.global_step
        due = (
            self._shown is None
            or not trainer.training
            or (step != self._read_at and step % self.metrics_every_n_steps == 0)
        )
        if due:
            self._shown = super().get_metrics(trainer, pl_module)
            self._shown.pop("v_num", None)  # the logger's version, "" or a W&B id: noise here
            self._read_at = step
        return self._shown
