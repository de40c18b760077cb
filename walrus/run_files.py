"""The run directory's own files, written only once a run's checks have passed.

Hydra is configured to write nothing when a command starts (``hydra.output_subdir: null``, no
file handler; see ``configs/hydra/default.yaml``), so a refused run leaves an earlier result
folder as it was. :func:`write_run_files` then writes what Hydra used to: ``.hydra/config.yaml``,
``.hydra/overrides.yaml``, ``.hydra/hydra.yaml``, and opens the run's log file, which records
every log record at INFO and above and every complete line the run prints on stdout (tables,
notes, the progress line), without terminal-only updates (``\\r`` redraws, colours). Both go
through :mod:`walrus.safe_paths`: a ``.hydra`` or log planted as a symlink is refused, never
written through.

Hydra itself creates the run directory before the command starts. :class:`NewFolders` (a Hydra
callback, ``configs/hydra/default.yaml``) notes which folders of it did not exist yet, and
:func:`remove_new_empty_folders` removes those still empty when a run is refused, so a refused
run leaves no empty folder behind.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import IO, Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from walrus.atomic import write_text_atomic
from walrus.safe_paths import make_dirs, open_append

LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


class _Tee:
    """``stdout`` that also appends each complete printed line to the run's log file."""

    def __init__(self, stream: IO[str], log: IO[str]) -> None:
        self._stream, self._log, self._pending = stream, log, ""

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            if "\r" not in line and "\x1b" not in line:  # not a terminal redraw
                self._log.write(line + "\n")
        if lines:
            self._log.flush()
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, flush...
        return getattr(self._stream, name)


class _RunLog:
    """The open log file of this process's run, its logging handler and the stdout tee."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open_append(path)  # for the whole run; never through a planted symlink
        self.handler = logging.StreamHandler(self.file)
        self.handler.setFormatter(logging.Formatter(LOG_FORMAT))
        self.handler.setLevel(logging.INFO)
        root = logging.getLogger()
        root.addHandler(self.handler)
        root.setLevel(min(root.level or logging.INFO, logging.INFO))
        self.stdout = sys.stdout
        sys.stdout = _Tee(sys.stdout, self.file)

    def close(self) -> None:
        logging.getLogger().removeHandler(self.handler)
        if isinstance(sys.stdout, _Tee) and sys.stdout._log is self.file:
            sys.stdout = self.stdout
        self.file.close()


_ACTIVE: _RunLog | None = None


def close_run_log() -> None:
    """Stop recording into the current run's log file (a later run opens its own)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.close()
        _ACTIVE = None


def log_line(message: str) -> None:
    """Append ``message`` to the current run's log file, if one is open (e.g. a final error)."""
    if _ACTIVE is not None and not _ACTIVE.file.closed:
        _ACTIVE.file.write(message.rstrip("\n") + "\n")
        _ACTIVE.file.flush()


def is_first_process() -> bool:
    """Whether this is the launching process (not a relaunched DDP rank)."""
    return all(int(os.environ.get(k, "0") or 0) == 0 for k in ("LOCAL_RANK", "NODE_RANK"))


def write_run_files(cfg: DictConfig, out_dir: str | os.PathLike, log_name: str) -> None:
    """Write the run directory's Hydra files and start its log file; call after the checks.

    Does nothing outside a Hydra run (a config composed in-process has no run directory of
    Hydra's). Every process of a multi-rank run appends to the same log file; only the first
    writes ``.hydra/``.

    Args:
        cfg: the run's composed config (as ``@hydra.main`` passed it).
        out_dir: the run directory.
        log_name: the log file's name in ``out_dir`` (``train.log``, ``infer.log``).
    """
    global _ACTIVE
    if not HydraConfig.initialized():
        return
    out = Path(out_dir)
    hydra_cfg = HydraConfig.get()
    if is_first_process():
        sub = make_dirs(out, ".hydra")  # a real folder, never a planted symlink
        write_text_atomic(sub / "config.yaml", OmegaConf.to_yaml(cfg))
        overrides = OmegaConf.to_container(hydra_cfg.overrides.task)
        write_text_atomic(sub / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(overrides)))
        write_text_atomic(
            sub / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg}))
        )
    close_run_log()
    make_dirs(out)
    _ACTIVE = _RunLog(out / log_name)


_NEW_FOLDERS: list[Path] = []  # folders Hydra creates for this command, deepest first
_JOB_DIR: list[Path] = []  # the job's run directory (below a sweep's folder in a multirun)


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist, deepest first."""
    missing = []
    for folder in [path, *path.parents]:
        if os.path.lexists(folder):
            break
        missing.append(folder)
    return missing


class NewFolders(Callback):
    """Hydra callback: notes the folders of the run (or sweep) directory that Hydra is about
    to create, for :func:`remove_new_empty_folders`."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _NEW_FOLDERS[:] = _missing_folders(Path(str(config.hydra.run.dir)).absolute())

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _NEW_FOLDERS[:] = _missing_folders(Path(str(config.hydra.sweep.dir)).absolute())

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        _JOB_DIR[:] = [Path(str(config.hydra.runtime.output_dir))]


def remove_new_empty_folders() -> None:
    """Remove the folders Hydra created for this command that are still empty (a refused
    run), from the job's run directory up; a folder holding anything is kept, and so are all
    above it. Folders that existed before the command are never removed."""
    close_run_log()
    if _NEW_FOLDERS:
        top = _NEW_FOLDERS[-1]
        folder = _JOB_DIR[0] if _JOB_DIR else _NEW_FOLDERS[0]
        while folder == top or top in folder.parents:
            try:
                folder.rmdir()
            except OSError:  # not empty (the run wrote something), or gone
                break
            folder = folder.parent
    _NEW_FOLDERS.clear()
    _JOB_DIR.clear()
