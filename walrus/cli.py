"""Shared command-line plumbing: user errors become one clear message and a non-zero exit."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from walrus.errors import (
    RESOURCE_ERRORS,
    CommandInterrupted,
    DiskFullError,
    NonFiniteLossError,
    NonFiniteWeightsError,
    TrainingInterrupted,
)
from walrus.memory import is_allocator_error
from walrus.run_files import log_line, remove_new_empty_folders

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, KeyError)
# Hydra's errors for a bad command line (misspelled key, unknown config, bad override syntax)
CONFIG_ERRORS = (HydraException, OmegaConfBaseException)
# Lines of OmegaConf's messages that locate the key again, in its own terms.
_OMEGACONF_DETAIL = ("full_key:", "object_type=", "reference_type=")
# Deprecation chatter from third-party internals that a user can do nothing about.
QUIET_WARNINGS = (r".*isinstance\(treespec, LeafSpec\).*", r".*litlogger.*")
LIGHTNING_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.pytorch.trainer.connectors.checkpoint_connector",
)


class _DropLightningChatter(logging.Filter):
    """Drops Lightning's advertising and internal notes a user can do nothing about."""

    PATTERNS = ("litlogger", "`weights_only` was not set")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(p in record.getMessage() for p in self.PATTERNS)


_CHATTER = _DropLightningChatter()


def quiet_lightning() -> None:
    """Silence Lightning's tips and notes (training and inference call this)."""
    for name in LIGHTNING_LOGGERS:
        logging.getLogger(name).addFilter(_CHATTER)  # a filter is added once
    # Lightning's warning; training says it in our words when no best-*.ckpt was written
    warnings.filterwarnings("ignore", message=r".*ModelCheckpoint\(monitor=.*could not find")


def _fail(message: str) -> None:
    """Print ``error: message`` (also into the run's log file, if open) and exit with 2."""
    log_line(f"error: {message}")
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _short_path(name: object, limit: int = 200) -> str:
    text = str(name)
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-limit // 2 :]}"


def run_cli(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; on a user error print ``error: ...`` and exit with status 2.

    Training stopped by SIGTERM (checkpoint saved) exits with status 143 instead, an
    inference command stopped by SIGTERM or SIGINT with 143 or 130. A ``MemoryError``,
    ``RecursionError``, ``OverflowError`` or an allocator's out-of-memory ``RuntimeError``
    (``torch.OutOfMemoryError``, "can't allocate memory") that no check caught becomes one line
    naming the input being read (see :func:`walrus.errors.reading`); an ``OSError`` about a file
    (a path too long, an I/O error) names the file.

    Set ``WALRUS_TRACEBACK=1`` to see the full traceback instead.
    """
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    try:
        return fn()
    except (TrainingInterrupted, CommandInterrupted) as e:
        log_line(f"error: {e}")
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_status)
    except FileExistsError as e:  # e.g. Hydra creating a run directory named like a file
        if os.environ.get("WALRUS_TRACEBACK"):
            raise
        _fail(f"{_short_path(e.filename)} exists and is not a directory")
    except (
        *USER_ERRORS,
        *CONFIG_ERRORS,
        DiskFullError,
        NonFiniteLossError,
        NonFiniteWeightsError,
    ) as e:
        if os.environ.get("WALRUS_TRACEBACK"):
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        if isinstance(e, CONFIG_ERRORS):
            lines = [ln.strip() for ln in str(msg).splitlines()]
            msg = " ".join(ln for ln in lines if ln and not ln.startswith(_OMEGACONF_DETAIL))
            msg = msg.split(" Config search path:")[0]
        elif isinstance(e, OSError) and e.filename and str(e).startswith("[Errno"):
            msg = f"{e.strerror}: {_short_path(e.filename)}"
        _fail(str(msg))
    except OSError as e:  # e.g. ENAMETOOLONG from an over-long out= or hydra.run.dir
        if os.environ.get("WALRUS_TRACEBACK"):
            raise
        if e.filename:
            _fail(f"{e.strerror or type(e).__name__}: {_short_path(e.filename)}")
        lines = str(e).strip().splitlines() or [type(e).__name__]  # e.g. h5py's I/O errors
        _fail(f"{lines[0][:300]} (set WALRUS_TRACEBACK=1 for details)")
    except (*RESOURCE_ERRORS, RuntimeError) as e:
        if os.environ.get("WALRUS_TRACEBACK") or not (
            isinstance(e, RESOURCE_ERRORS) or is_allocator_error(e)
        ):
            raise
        what = getattr(e, "walrus_input", None) or "this run (its options or input files)"
        kind = type(e).__name__ if isinstance(e, RESOURCE_ERRORS) else "out of memory"
        _fail(f"{what} asks for more than this machine can give ({kind})")


def run_hydra_main(main: Callable[[], Any]) -> Any:
    """Run a ``@hydra.main`` function; errors composing the config (a misspelled key, an
    unknown config name) print as one ``error: ...`` line too, instead of Hydra's report.

    A run leaves no empty folder: the run directory Hydra created for it is removed if the run
    wrote nothing there, e.g. when it was refused
    (:func:`walrus.run_files.remove_new_empty_folders`).
    """
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra re-raises; run_cli words it
    try:
        return run_cli(main)
    finally:  # Hydra's run folder, if the run wrote nothing there (refused, or another out)
        remove_new_empty_folders()
