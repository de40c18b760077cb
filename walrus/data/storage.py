"""Where data lives: a local path or an fsspec URL, behind one set of helpers.

``paths.data_dir`` may be a local folder (a Well download) or an fsspec URL such as
``memory://well``, ``file:///data/well`` or ``hf://datasets/polymathic-ai/``. Both go through
fsspec, so listing, existence checks and opening have one code path. A local location stays a
``Path`` (messages and return values look as before); a URL stays the string the user gave.

Only regular files are opened as data: symlinks are followed, then FIFOs, devices and sockets
are refused (reading one could block forever or never end).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

from fsspec.core import url_to_fs

Location = Path | str  # a local path, or an fsspec URL ("memory://...", "hf://...")


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an fsspec protocol (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and "://" in path


def as_location(path: str | os.PathLike) -> Location:
    """``path`` as a ``Path``, or, for a URL, the URL without a trailing slash."""
    if is_url(path):
        scheme, _, rest = str(path).partition("://")
        return f"{scheme}://{rest.rstrip('/')}"
    return Path(path)


def join(loc: Location, *parts: str) -> Location:
    """``loc / part / ...`` for a path or a URL."""
    if isinstance(loc, Path):
        return loc.joinpath(*parts)
    for part in parts:
        loc = loc + part if loc.endswith("/") else f"{loc}/{part}"
    return loc


def name(loc: Location) -> str:
    """The last component of ``loc`` (``''`` for a URL's bare root)."""
    if isinstance(loc, Path):
        return loc.name
    rest = loc.partition("://")[2]
    return rest.rstrip("/").rpartition("/")[2]


def parent(loc: Location) -> Location:
    """The folder holding ``loc``."""
    if isinstance(loc, Path):
        return loc.parent
    scheme, _, rest = loc.partition("://")
    return f"{scheme}://{rest.rstrip('/').rpartition('/')[0]}"


def _fs(loc: Location) -> tuple[Any, str]:
    """``(filesystem, path on it)``; an unknown or unusable protocol is a ``ValueError``."""
    try:
        return url_to_fs(str(loc))
    except (ValueError, ImportError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"{loc}: cannot use this location through fsspec: {msg}") from None


def _info(loc: Location) -> dict[str, Any] | None:
    """fsspec's ``info`` of ``loc`` (symlinks followed), or ``None`` when nothing is there."""
    fs, path = _fs(loc)
    try:
        return fs.info(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError:
        raise PermissionError(f"{loc}: permission denied; this user may not read it") from None
    except OSError as e:
        raise ValueError(f"{loc}: cannot be read: {' '.join(str(e).split())}") from None


def is_dir(loc: Location) -> bool:
    """Whether ``loc`` is an existing folder (local or fsspec)."""
    info = _info(loc)
    return info is not None and info.get("type") == "directory"


def data_root_exists(root: str | os.PathLike) -> bool:
    """Whether a data root (``paths.data_dir``) may hold datasets.

    A local path must be an existing folder. A URL fails only when it is known not to be a
    folder (it is a file): object stores and the Hub have no folder objects
    (``hf://datasets/polymathic-ai`` is an organisation, not a repository), so a missing
    dataset is reported when its own folder is looked up. An unknown protocol is a
    ``ValueError``.
    """
    loc = as_location(root)
    if isinstance(loc, Path):
        return is_dir(loc)
    fs, path = _fs(loc)
    try:
        return fs.info(path).get("type") != "file"
    except (OSError, ValueError):
        return True


def list_folders(loc: Location) -> list[str] | None:
    """Names of the folders in ``loc``, sorted; ``None`` when it cannot be listed."""
    try:
        return [n for n, kind in list_dir(loc) if kind == "directory"]
    except (OSError, ValueError):
        return None


def exists(loc: Location) -> bool:
    """Whether anything is at ``loc``."""
    return _info(loc) is not None


def list_dir(loc: Location) -> list[tuple[str, str]]:
    """``(name, type)`` of each entry of folder ``loc``, sorted by name; ``type`` as fsspec gives it
    (``file``, ``directory``, ``other``)."""
    fs, path = _fs(loc)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        entry = str(e["name"]).rstrip("/").rpartition("/")[2]
        if entry:
            out.append((entry, str(e.get("type", "other"))))
    return sorted(out)


def check_regular_file(loc: Location) -> None:
    """Raise unless ``loc`` is a regular file (after following symlinks).

    Raises:
        FileNotFoundError: nothing there. ValueError: a folder, FIFO, device or socket.
    """
    info = _info(loc)
    if info is None:
        raise FileNotFoundError(f"{loc}: no such file")
    kind = info.get("type")
    if kind == "directory":
        raise ValueError(f"{loc}: is a directory, not a file")
    if kind != "file":
        raise ValueError(
            f"{loc}: not a regular file (a FIFO, device or socket?); data files must be "
            "regular files"
        )


def open_binary(loc: Location) -> IO[bytes]:
    """Open the regular file ``loc`` for reading bytes (local or fsspec, one code path)."""
    check_regular_file(loc)
    fs, path = _fs(loc)
    try:
        return fs.open(path, "rb")
    except PermissionError:
        raise PermissionError(
            f"{loc}: permission denied; this user may not read it (check its permissions)"
        ) from None
    except OSError as e:
        raise ValueError(f"{loc}: cannot be opened: {' '.join(str(e).split())}") from None


def read_bytes(loc: Location, max_bytes: int) -> bytes:
    """The bytes of the regular file ``loc``; more than ``max_bytes`` is a ``ValueError``."""
    with open_binary(loc) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{loc}: larger than {max_bytes} bytes, the most read from such a file")
    return data
