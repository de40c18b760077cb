"""What a run says at its end (one summary block), and ``[job N]`` before each console line of
a sweep (``python train.py -m ...``) job."""

from __future__ import annotations

import contextlib
import logging
import math
import shlex
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TextIO

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from walrus.training.budget import TimeBudget


def stop_reason(trainer: pl.Trainer) -> str:
    """Why fitting ended, in the option's own words (one reason, the one that acted)."""
    budget = next((c for c in trainer.callbacks if isinstance(c, TimeBudget)), None)
    if trainer.fast_dev_run:
        return "debug=fast_dev_run (one batch; no checkpoint is written)"
    if budget is not None and budget.stopped:
        return f"the time budget, trainer.max_time ({timedelta(seconds=int(budget.duration))})"
    if trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps:
        return f"trainer.max_steps={trainer.max_steps}"
    if trainer.max_epochs not in (None, -1) and trainer.current_epoch >= trainer.max_epochs:
        return f"trainer.max_epochs={trainer.max_epochs}"
    return "a callback (e.g. early stopping)"


def _best(trainer: pl.Trainer) -> tuple[str, str] | None:
    """``(path, "monitor = score")`` of the best checkpoint written, if any; one whose score
    is NaN or Inf is never recommended."""
    for cb in trainer.checkpoint_callbacks:
        path = getattr(cb, "best_model_path", "")
        score = getattr(cb, "best_model_score", None)
        if score is not None and not math.isfinite(float(score)):
            continue
        if path and Path(path).is_file():
            value = f"{float(score):.4g}" if score is not None else "?"
            return path, f"{cb.monitor} = {value}"
    return None


def summary_lines(
    trainer: pl.Trainer, out_dir: Path, last: Path, seconds: float, metrics: dict[str, float]
) -> list[str]:
    """The closing block: folder, checkpoints, steps, time, and the resume/rollout commands."""
    lines = [
        f"Run finished: stopped by {stop_reason(trainer)} at step {trainer.global_step} "
        f"({timedelta(seconds=round(seconds))} in this session)",
        f"  folder:     {out_dir}",
    ]
    best = _best(trainer)
    if last.is_file():
        lines.append(f"  last.ckpt:  {last}")
    else:
        lines.append("  last.ckpt:  none written")
    if best is not None:
        lines.append(f"  best:       {best[0]} ({best[1]})")
    else:
        score = next((f"{k} = {v:.4g}" for k, v in sorted(metrics.items()) if k == "val/vrmse"), "")
        lines.append("  best:       none written" + (f" (final {score})" if score else ""))
    if last.is_file():
        # the final weights, as `make demo` and the docs roll out; best: ckpt_path= above
        ckpt = shlex.quote(str(last))
        lines.append(f"  resume:     python train.py ckpt_path={ckpt}")
        lines.append(f"  roll out:   python infer.py rollout ckpt_path={ckpt}")
    return lines


def print_summary(
    trainer: pl.Trainer, out_dir: Path, last: Path, seconds: float, metrics: dict[str, float]
) -> None:
    """Print :func:`summary_lines` once (rank 0)."""
    if trainer.is_global_zero:
        rank_zero_info("\n".join(summary_lines(trainer, out_dir, last, seconds, metrics)))


def sweep_job() -> int | None:
    """The job number of a Hydra multirun (``-m``) job; ``None`` outside one."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    return int(hydra_cfg.job.num) if hydra_cfg.mode == RunMode.MULTIRUN else None


class PrefixedStream:
    """A text stream that writes ``prefix`` at the start of every line to ``stream``."""

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self.stream = stream
        self.prefix = prefix
        self._at_start = True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self._at_start:
                out.append(self.prefix)
            out.append(piece)
            self._at_start = piece.endswith("\n")
        self.stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def __getattr__(self, name: str) -> object:
        return getattr(self.stream, name)


def _console_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    return [
        h
        for lg in loggers
        for h in lg.handlers
        if type(h) is logging.StreamHandler and h.stream in (sys.stdout, sys.stderr)
    ]


@contextlib.contextmanager
def job_prefix(job: int | None) -> Iterator[None]:
    """Within the block, console lines (stdout, stderr, console log handlers) start with
    ``[job N] ``; nothing changes when ``job`` is ``None``."""
    if job is None:
        yield
        return
    prefix = f"[job {job}] "
    out, err = sys.stdout, sys.stderr
    wrapped = {id(out): PrefixedStream(out, prefix), id(err): PrefixedStream(err, prefix)}
    handlers = [(h, h.stream) for h in _console_handlers()]
    sys.stdout, sys.stderr = wrapped[id(out)], wrapped[id(err)]
    for handler, stream in handlers:
        handler.setStream(wrapped[id(stream)])
    try:
        yield
    finally:
        for handler, stream in handlers:
            handler.setStream(stream)
        sys.stdout, sys.stderr = out, err
