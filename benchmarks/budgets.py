"""Training budgets of the benchmarks: optimiser steps or process CPU seconds.

A CPU budget (``time.process_time``: summed over all threads, validation not counted) is planned
from a short probe run's cost per step (:func:`cpu_per_step`, :func:`steps_for_budget`); the run
may take up to :data:`STEP_CEILING` times those steps, because :class:`CPUBudget` ends it, and
its learning-rate schedule follows the share of CPU used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from walrus.training.budget import BudgetCallback


class BenchmarkError(ValueError):
    """Bad input to the benchmark; the CLI prints it as one line."""


@dataclass(frozen=True)
class Budget:
    """A training budget: ``kind`` is ``"steps"`` (optimiser steps) or ``"cpu_seconds"``."""

    kind: str
    value: float

    def __post_init__(self) -> None:
        if self.kind not in ("steps", "cpu_seconds"):
            raise BenchmarkError(f"budget kind must be 'steps' or 'cpu_seconds', got {self.kind}")
        if not self.value > 0 or (self.kind == "steps" and self.value != int(self.value)):
            raise BenchmarkError(
                f"--{self.kind.replace('_', '-')} must be positive, got {self.value}"
            )

    @property
    def label(self) -> str:
        return f"{int(self.value)} steps" if self.kind == "steps" else f"{self.value:g} cpu-s"


class CPUBudget(BudgetCallback):
    """Stops training once it has used ``seconds`` of process CPU time; records what it used.

    CPU time (``time.process_time``) counts from the start of training and leaves out the time
    spent in validation. The learning-rate schedule follows :meth:`fraction` (see
    ``walrus.training.budget.BudgetCallback``), so it reaches its floor on the step that spends
    the budget, however many steps that turns out to be; training stops after that step.
    ``seconds=None`` only measures (``fraction`` stays 0).

    Attributes:
        used: CPU seconds used by training so far.
        steps: optimiser steps done.
        step_cpu: ``used`` after each training batch.
    """

    def __init__(self, seconds: float | None = None) -> None:
        if seconds is not None and not seconds > 0:
            raise BenchmarkError(f"CPU budget must be positive seconds, got {seconds}")
        self.seconds = seconds
        self.used = 0.0
        self.steps = 0
        self.step_cpu: list[float] = []
        self._start: float | None = None
        self._val_start: float | None = None
        self._val_total = 0.0

    def _used_now(self) -> float:
        return time.process_time() - self._start - self._val_total

    def fraction(self) -> float:
        """Share of the budget used so far, in ``[0, 1]``; 0 without a budget or before training."""
        if self.seconds is None or self._start is None:
            return 0.0
        return min(self._used_now() / self.seconds, 1.0)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._val_total = time.process_time(), 0.0

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._start is not None:
            self._val_start = time.process_time()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_start is not None:
            self._val_total += time.process_time() - self._val_start
            self._val_start = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.used = self._used_now()
        self.steps = trainer.global_step
        self.step_cpu.append(self.used)
        if self.seconds is not None and self.used >= self.seconds:
            trainer.should_stop = True


def cpu_per_step(step_cpu: Sequence[float], warmup: int = 2) -> float:
    """CPU seconds per step from cumulative per-step CPU times, skipping ``warmup`` steps."""
    if len(step_cpu) <= warmup:
        raise BenchmarkError(
            f"the CPU probe needs more than {warmup} steps, got {len(step_cpu)} "
            "(raise --probe-steps)"
        )
    return (step_cpu[-1] - step_cpu[warmup - 1]) / (len(step_cpu) - warmup)


def steps_for_budget(seconds: float, per_step: float) -> int:
    """Optimiser steps that ``seconds`` of CPU buy at ``per_step`` seconds each (at least 1)."""
    return max(1, math.ceil(seconds / max(per_step, 1e-9)))


# A CPU-budget run may take this many times the probe's planned steps: the budget, not the step
# count, ends it and its learning-rate schedule (a probe of a few steps misjudges the per-step
# cost by 10-15 % on a loaded machine).
STEP_CEILING = 1.5


def step_ceiling(planned: int) -> int:
    """The step limit of a CPU-budget run planned at ``planned`` steps."""
    return math.ceil(planned * STEP_CEILING)
