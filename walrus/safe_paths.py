"""Paths derived from input stay inside their folder, and no write follows a planted symlink.

One rule for training, inference, the converter and the generators:

* A name taken from input (a dataset name, a system name) becomes a path only through
  :func:`plain_name` (one path component: no separator, not ``.`` or ``..``) or, for a dataset
  given by path, :func:`result_folder_names` (its last component, e.g. ``/data/ns`` -> ``ns``).
* The folder a user names (``out=``, ``hydra.run.dir``, ``--out``) is theirs and may itself be
  a symlink; every entry a run creates *inside* it is a real file or folder. An existing entry
  that is a symlink, which the run did not create, is refused (:func:`refuse_symlinks`), and
  :func:`make_dirs` and :func:`open_append` never go through one (``O_NOFOLLOW``).

Every refusal is a ``ValueError`` naming the path, for ``walrus.cli``'s one-line error.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path, PurePath
from typing import IO

# separators on every platform a result folder may be copied to
_SEPARATORS = ("/", "\\")


def plain_name(name: object, what: str) -> str:
    """``name`` if it is one plain path component, else a ``ValueError`` naming ``what``.

    Plain: a non-empty string without ``/``, ``\\`` or NUL, other than ``.`` and ``..``.
    """
    text = str(name)
    if (
        not isinstance(name, str)
        or text in ("", ".", "..")
        or "\0" in text
        or any(s in text for s in _SEPARATORS)
    ):
        raise ValueError(
            f"{what} {text[:200]!r} is not a plain name (one path component: no '/', '\\', "
            "and not '.' or '..')"
        )
    return text


def result_folder_names(datasets: Iterable[str]) -> dict[str, str]:
    """The folder inside ``out=`` for each dataset's results: the name itself, or for a
    dataset given by path (``data.datasets=[/data/ns]``, ``../runs/ns``) its last component.

    Raises:
        ValueError: a path with no last name (``..``, ``/``), or two datasets whose folders
            would be the same name.
    """
    folders: dict[str, str] = {}
    for dataset in datasets:
        last = PurePath(str(dataset).replace("\\", "/")).name
        folders[dataset] = plain_name(
            last if last not in ("", ".", "..") else str(dataset), "data.datasets entry"
        )
    seen: dict[str, str] = {}
    for dataset, folder in folders.items():
        if folder in seen:
            raise ValueError(
                f"data.datasets entries {seen[folder]!r} and {dataset!r} would both write their "
                f"results to out/{folder}; roll them out in separate runs (or give each its own "
                "out=DIR)"
            )
        seen[folder] = dataset
    return folders


def is_symlink(path: Path) -> bool:
    """Whether ``path`` itself is a symlink (not followed)."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def refuse_symlinks(folder: Path, names: Iterable[str] | None = None, *, what: str) -> None:
    """Refuse symlinks among ``folder``'s entries (``names``, or all of them): a run writes
    nothing through a link it did not create.

    Args:
        folder: the run or output folder (it may be a symlink itself: the user named it).
        names: entries to check; ``None`` checks every entry.
        what: how the message names the folder (``"out=DIR"``).
    """
    if not folder.is_dir():
        return
    entries = [folder / n for n in names] if names is not None else list(folder.iterdir())
    links = sorted(p.name for p in entries if is_symlink(p))
    if links:
        raise ValueError(
            f"{what} holds symbolic links this run did not create: {', '.join(links[:5])} "
            "(nothing is written through a link); remove them or pick a new folder"
        )


def make_dirs(base: Path, *parts: str) -> Path:
    """Create ``base/part0/part1/...`` (each part a plain name) and return it.

    ``base`` is the user's folder: created with its parents, and it may be a symlink. Each
    part below it is created if missing; one that exists must be a real directory, not a
    symlink (``ValueError`` naming it).
    """
    base.mkdir(parents=True, exist_ok=True)
    path = base
    for part in parts:
        path = path / plain_name(part, "folder name")
        try:
            os.mkdir(path)
        except FileExistsError:
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise ValueError(
                    f"{path} is a symbolic link this run did not create (nothing is written "
                    "through a link); remove it or pick a new folder"
                ) from None
            if not stat.S_ISDIR(mode):
                raise NotADirectoryError(f"{path} exists and is not a directory") from None
    return path


def open_append(path: Path) -> IO[str]:
    """Open ``path`` (a log) for appending text, creating it; never through a symlink.

    Raises:
        ValueError: ``path`` is a symlink or not a regular file (a FIFO, a device).
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK) or is_symlink(path):
            raise ValueError(
                f"{path} is a symbolic link this run did not create (the log is never written "
                "through a link); remove it or pick a new folder"
            ) from None
        if e.errno == errno.ENXIO:  # a FIFO without a reader
            raise ValueError(f"{path} is not a regular file; remove it") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file; remove it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")


def inside(folder: Path, path: Path) -> bool:
    """Whether ``path`` lies inside ``folder`` once both are resolved (links followed)."""
    try:
        Path(path).resolve().relative_to(Path(folder).resolve())
    except ValueError:
        return False
    return True
