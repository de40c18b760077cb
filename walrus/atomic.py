"""Atomic file writes: write beside the target, fsync, then rename over it.

A reader never sees a half-written file, an error leaves the previous file in place, and a
committed file survives a power loss (file and directory are fsynced). A process killed
mid-write (``kill -9``) leaves a temporary file ``.<name>.<pid>.<hex8>.walrus-tmp<suffix>``;
:func:`remove_stale_temp_files` deletes those of processes no longer running.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

from walrus.errors import DiskFullError

TEMP_MARK = ".walrus-tmp"
_TEMP_NAME = re.compile(r"^\..+\.(?P<pid>\d+)\.[0-9a-f]{8}" + re.escape(TEMP_MARK) + r"(\.\w+)?$")


def _fsync(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (same suffix); fsync it and rename it onto ``path``.

    The temporary file is removed if the block raises. Files get the usual umask permissions.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(
        f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TEMP_MARK}{path.suffix}"
    )
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise DiskFullError(str(path), e.errno) from None
        raise
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        _fsync(path.parent, directory=True)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temp_files(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files of interrupted atomic writes in ``directory``.

    Only files named by :func:`atomic_path` whose writing process is no longer running are
    removed. Returns the removed paths.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in directory.iterdir():
        match = _TEMP_NAME.match(entry.name)
        if match and entry.is_file() and not _running(int(match["pid"])):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically; returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)
