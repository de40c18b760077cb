"""Loggers that keep a run's history and settings: a CSV logger that appends on resume, and a
W&B logger that never prompts, never fails for lack of network and resumes by run id."""

from __future__ import annotations

import csv
import logging
import netrc
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

WANDB_TARGETS = (
    "walrus.training.loggers.SafeWandbLogger",
    "lightning.pytorch.loggers.WandbLogger",
    "lightning.pytorch.loggers.wandb.WandbLogger",
)
# Options left out of a W&B run name: places and the experiment itself, not settings.
_UNNAMED = ("ckpt_path", "init_from", "paths", "hydra", "experiment", "logger")


def wandb_key_configured() -> bool:
    """True when an API key is set in the environment or in ``~/.netrc``."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def is_wandb_config(logger_cfg: Mapping[str, Any]) -> bool:
    """Whether a ``logger`` entry builds a W&B logger."""
    return str(logger_cfg.get("_target_", "")) in WANDB_TARGETS


def wandb_run_name(task_name: str | None, overrides: Sequence[str] | None) -> str:
    """``task_name`` followed by the overrides that set options (what differs from the
    experiment), e.g. ``finetune optimizer.lr=1e-4 seed=1``."""
    kept = []
    for line in overrides or ():
        key = line.split("=", 1)[0].lstrip("+~")
        if not any(key == k or key.startswith(k + ".") for k in _UNNAMED):
            kept.append(line)
    return " ".join([str(task_name or "train"), *kept])[:256]


class SafeWandbLogger(WandbLogger):
    """``WandbLogger`` that runs offline unless a W&B API key is configured.

    Offline runs are written under ``save_dir/wandb/offline-run-*`` and can be uploaded later with
    ``wandb sync``. ``mode`` forces ``"online"``, ``"offline"`` or ``"disabled"``. ``id`` names
    the run; training passes the one stored with the run, so a resume continues it.
    """

    def __init__(self, *args: Any, mode: str | None = None, **kwargs: Any) -> None:
        mode = (
            mode
            or os.environ.get("WANDB_MODE")
            or ("online" if wandb_key_configured() else "offline")
        )
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_CONSOLE", "off")
        super().__init__(*args, offline=mode == "offline", mode=mode, **kwargs)
        if not self._wandb_init.get("anonymous"):
            # W&B warns that the setting "has no effect" whenever it is passed at all
            self._wandb_init.pop("anonymous", None)


def finish_wandb_runs(loggers: Sequence[Any]) -> None:
    """Finish the W&B runs these loggers started (W&B keeps one global run per process, which a
    later logger would otherwise join)."""
    for logger in loggers:
        if isinstance(logger, WandbLogger) and getattr(logger, "_experiment", None) is not None:
            finish = getattr(logger._experiment, "finish", None)
            if callable(finish):
                finish()


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing ``metrics.csv`` is continued (its
    columns kept) instead of deleted."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                header = next(csv.reader(file), [])
            self.metrics_keys = sorted(header)


class CSVLogger(_LightningCSVLogger):
    """Lightning's ``CSVLogger`` that appends to ``metrics.csv`` when the run resumes into the
    same folder, so the file keeps the whole history."""

    @property
    @rank_zero_experiment
    def experiment(self) -> _AppendingWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


class _DropStopChatter(logging.Filter):
    """Drops Lightning's "`Trainer.fit` stopped: ..." lines: the run summary names the one
    limit that ended the run (a time budget and an epoch limit must not both claim it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("`Trainer.fit` stopped")


_STOP_CHATTER = _DropStopChatter()


def quiet_logger_noise() -> None:
    """Silence Lightning's stop notes (the run summary says why training stopped)."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_STOP_CHATTER)
