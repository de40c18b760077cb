"""CPU training's thread count, chosen by timing: all cores when they are free, one when shared.

An OpenMP team is as fast as its slowest thread. When another process computes on the same
cores, one of the team's threads keeps losing its core and every parallel region waits for it:
on 2 cores a quickstart run beside a loop of short torch processes took 2.1-3.4x its quiet time
with 2 threads and a short spin, and a step took about half as long with 1 thread as with 2
(docs/performance.md, "Shared machines"). :class:`ThreadTuner` times a window of training steps at the current thread count
and one at the other (all cores or one), keeps the faster, and probes again every
``every_n_steps`` steps, so a run follows the machine as neighbours come and go.

It stands back (changes nothing) when the user fixed the count (``OMP_NUM_THREADS``), when the
model is not on the CPU, with more than one process, or with one core.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch

log = logging.getLogger(__name__)
OPTION = "callbacks.thread_tuner"


def _check_int(name: str, value: Any, low: int, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        none = " or null" if allow_none else ""
        raise ValueError(f"{OPTION}.{name} must be an int >= {low}{none}, got {value!r}")
    return value


class ThreadTuner(pl.Callback):
    """Keep the faster of all cores and one thread for CPU training, re-checked as it runs.

    From step ``start_step``, and then every ``every_n_steps`` steps, the next ``window`` steps
    run at the current count and the ``window`` after them (less one step that absorbs the
    switch) at the other one; the other count is kept when its median step is faster by more
    than ``margin``. Each decision is logged and kept in :attr:`history`. The count the run
    started with is restored when training ends.

    Args:
        every_n_steps: steps between probes; ``None``: never change the count.
        window: steps timed at each count per probe.
        start_step: the first probe's step (after warm-up).
        margin: relative gain the other count must show to be kept.
    """

    def __init__(
        self,
        every_n_steps: int | None = 100,
        window: int = 8,
        start_step: int = 10,
        margin: float = 0.1,
    ) -> None:
        self.every_n_steps = _check_int("every_n_steps", every_n_steps, 1, allow_none=True)
        self.window = _check_int("window", window, 1)
        self.start_step = _check_int("start_step", start_step, 0)
        number = isinstance(margin, int | float) and not isinstance(margin, bool)
        if not (number and math.isfinite(margin) and 0 <= margin < 1):
            raise ValueError(f"{OPTION}.margin must be a number in [0, 1), got {margin!r}")
        self.margin = float(margin)
        self.active = False
        self.history: list[dict[str, Any]] = []
        self._started: int | None = None  # the count to restore
        self._full = 1
        self._steps = 0
        self._next_probe = 0
        self._phase = "idle"  # idle | current | other
        self._times: list[float] = []
        self._current_median = 0.0
        self._t0: float | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        threads = torch.get_num_threads()
        self.active = (
            self.every_n_steps is not None
            and "OMP_NUM_THREADS" not in os.environ
            and pl_module.device.type == "cpu"
            and trainer.world_size == 1
            and threads > 1
        )
        if self.active:
            self._started = self._full = threads
            self._steps, self._next_probe, self._phase = 0, self.start_step, "idle"

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.active:
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.active and self._t0 is not None:
            self.record(time.perf_counter() - self._t0)
            self._t0 = None

    def record(self, seconds: float) -> None:
        """Account one training step of ``seconds`` (wall) and switch counts as the probe says."""
        self._steps += 1
        if self._phase == "idle":
            if self._steps >= self._next_probe:
                self._phase, self._times = "current", []
            return
        self._times.append(seconds)
        if self._phase == "current" and len(self._times) == self.window:
            self._current_median = statistics.median(self._times)
            torch.set_num_threads(self._other(torch.get_num_threads()))
            self._phase, self._times = "other", []
        elif self._phase == "other" and len(self._times) == self.window + 1:
            self._decide(statistics.median(self._times[1:]))  # the first absorbed the switch

    def _other(self, threads: int) -> int:
        return 1 if threads == self._full else self._full

    def _decide(self, other_median: float) -> None:
        tried = torch.get_num_threads()
        was = self._other(tried)
        keep = other_median < self._current_median * (1 - self.margin)
        torch.set_num_threads(tried if keep else was)
        chosen = torch.get_num_threads()
        self.history.append(
            {
                "step": self._steps,
                "median_s": {str(was): self._current_median, str(tried): other_median},
                "threads": chosen,
            }
        )
        if chosen != was:
            log.info(
                "threads: %d from now on (median step %.0f ms with %d, %.0f ms with %d)",
                chosen,
                1e3 * other_median,
                tried,
                1e3 * self._current_median,
                was,
            )
        self._next_probe = self._steps + self.every_n_steps
        self._phase, self._times = "idle", []

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._started is not None:
            torch.set_num_threads(self._started)
            self._started = None
        self.active = False
