"""Where checkpoints come from: walrus checkpoints, official ``walrus.pt`` files and the Hub.

A checkpoint option (``init_from=``, ``ckpt_path=`` of ``infer.py``, ``walrus.load``) takes a
local walrus checkpoint, a local official file (e.g. the released ``walrus.pt``, converted in
memory with the ``extended_config.yaml`` beside it when there is one), or a Hugging Face Hub URL::

    hf://ORG/NAME[/FILE][@REVISION]

``ORG/NAME`` is a model repo; ``FILE`` a path inside it (default ``walrus.pt``); ``REVISION``
everything after the first ``@`` (a branch, tag or commit hash, default ``main``; it may hold
``/``, as in ``refs/pr/3``). File names holding ``@`` are not supported.

Hub files are fetched with ``huggingface_hub`` into the user's Hub cache (``HF_HUB_CACHE``, else
``HF_HOME/hub``, else ``~/.cache/huggingface/hub``, read when called). An official file is
converted once; the walrus checkpoint is kept in the same cache, in
``models--ORG--NAME/walrus-converted/<blob>.ckpt``, named after the file's blob (its hash on the
Hub, the name of the file the snapshot links to), so a later call loads it without reading the
official file. With ``HF_HUB_OFFLINE=1`` only the cache is used.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from walrus.checkpoint import atomic_torch_save, load_checkpoint_file
from walrus.compat.convert import convert_state_dict
from walrus.compat.inputs import read_official_file, unwrap_state_dict
from walrus.compat.keymap import check_layout
from walrus.compat.released import CONFIG_FILE, config_beside

log = logging.getLogger(__name__)

SCHEME = "hf://"
DEFAULT_FILE = "walrus.pt"
DEFAULT_REVISION = "main"
CONVERTED_DIR = "walrus-converted"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class HubFile:
    """One file of a Hub model repo at one revision."""

    repo_id: str
    filename: str = DEFAULT_FILE
    revision: str = DEFAULT_REVISION

    @property
    def url(self) -> str:
        """The ``hf://`` URL naming this file."""
        return f"{SCHEME}{self.repo_id}/{self.filename}@{self.revision}"


def is_hub_url(value: Any) -> bool:
    """Whether ``value`` is an ``hf://`` URL."""
    return isinstance(value, str) and value.startswith(SCHEME)


def hub_file(
    repo_id: str, filename: str = DEFAULT_FILE, revision: str = DEFAULT_REVISION
) -> HubFile:
    """A validated ``HubFile``.

    Raises:
        ValueError: ``repo_id`` is not ``ORG/NAME``, or the file or revision is malformed.
    """
    parts = repo_id.split("/") if isinstance(repo_id, str) else []
    if len(parts) != 2 or not all(_NAME.fullmatch(p) for p in parts):
        raise ValueError(
            f"Hub repo {repo_id!r} must be ORG/NAME (letters, digits, '.', '_', '-'), e.g. "
            "polymathic-ai/walrus"
        )
    segments = filename.split("/") if isinstance(filename, str) else [""]
    if not all(segments) or any(s in (".", "..") for s in segments) or "@" in filename:
        raise ValueError(
            f"Hub file {filename!r} of {repo_id} must be a path inside the repo, e.g. walrus.pt"
        )
    if not isinstance(revision, str) or not revision or any(c.isspace() for c in revision):
        raise ValueError(
            f"Hub revision {revision!r} of {repo_id} must be a branch, tag or commit hash"
        )
    return HubFile(repo_id, filename, revision)


def parse_hub_url(url: str) -> HubFile:
    """``hf://ORG/NAME[/FILE][@REVISION]`` as a ``HubFile`` (see the module docstring).

    Raises:
        ValueError: not an ``hf://`` URL of a model repo, or a malformed part.
    """
    if not is_hub_url(url):
        raise ValueError(f"{url!r} is not a Hub URL: expected hf://ORG/NAME[/FILE][@REVISION]")
    path, at, revision = url[len(SCHEME) :].partition("@")
    parts = path.strip("/").split("/")
    if parts[0] in ("datasets", "spaces"):
        raise ValueError(f"{url}: checkpoints come from model repos, not {parts[0]}/")
    if len(parts) < 2 or (at and not revision):
        raise ValueError(f"{url}: expected hf://ORG/NAME[/FILE][@REVISION]")
    filename = "/".join(parts[2:]) or DEFAULT_FILE
    return hub_file("/".join(parts[:2]), filename, revision or DEFAULT_REVISION)


def hub_cache_dir() -> Path:
    """The Hub cache ``huggingface_hub`` uses, from the environment as it is now."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set now (``huggingface_hub`` reads it once, at import)."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return env.strip().lower() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def download(ref: HubFile) -> Path:
    """The file in the Hub cache (fetched first unless cached, or only cached when offline).

    Returns:
        Its path in the revision's snapshot folder (a link into the cache's ``blobs/``).

    Raises:
        FileNotFoundError: no such repo or file, or offline and not cached.
        ValueError: no such revision, a gated repo, or another refusal by the Hub.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache, offline = hub_cache_dir(), hub_offline()
    where = f"{ref.url} (repo {ref.repo_id}, file {ref.filename}, revision {ref.revision})"
    try:
        path = hf_hub_download(
            ref.repo_id,
            ref.filename,
            revision=ref.revision,
            cache_dir=cache,
            local_files_only=offline,
        )
    except GatedRepoError:
        raise ValueError(
            f"{where}: the repo is gated; accept its terms on huggingface.co and log in "
            "(`hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{where}: no such model repo on the Hugging Face Hub (or it is private: log in "
            "with `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(
            f"{where}: the repo has no revision {ref.revision!r} (give a branch, tag or commit "
            "hash)"
        ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise FileNotFoundError(
            f"{where}: not in the Hub cache {cache} and {why}; fetch it once online (or check "
            "HF_HUB_CACHE / HF_HOME)"
        ) from None
    except EntryNotFoundError:
        raise FileNotFoundError(f"{where}: the repo has no such file at this revision") from None
    except HfHubHTTPError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{where}: the Hub refused the download: {first}") from None
    return Path(path)


def _snapshot(path: Path, filename: str) -> Path:
    """The snapshot folder (``.../snapshots/<commit>``) holding ``path``, ``filename`` in the repo."""
    for _ in filename.split("/"):
        path = path.parent
    return path


def blob_name(path: Path, filename: str) -> str:
    """The cache's name for the content of ``path``: its blob's name (the Hub's hash of it).

    Caches without links (copies) fall back to ``<commit>-<file>``; nothing is hashed.
    """
    target = Path(os.path.realpath(path))
    if target.parent.name == "blobs":
        return target.name
    return f"{_snapshot(path, filename).name}-{filename.replace('/', '--')}"


def _config_for(ref: HubFile, weights: Path) -> Path | None:
    """``extended_config.yaml`` beside ``ref`` in the same snapshot (fetched when online)."""
    from huggingface_hub.errors import EntryNotFoundError

    local = config_beside(weights)
    if local is not None or hub_offline():
        return local
    snapshot = _snapshot(weights, ref.filename)
    name = posixpath.join(posixpath.dirname(ref.filename), CONFIG_FILE)
    try:
        return download(HubFile(ref.repo_id, name, snapshot.name))
    except (FileNotFoundError, EntryNotFoundError):
        return None


def converted_checkpoint(ref: HubFile) -> Path:
    """A walrus checkpoint of the Hub file ``ref``, converted once and kept in the Hub cache.

    A file that already is a walrus checkpoint is returned as it is. An official one is
    converted (with ``extended_config.yaml`` from the same snapshot when present) into
    ``models--ORG--NAME/walrus-converted/<blob>[-<config blob>].ckpt``; a later call finds it there.

    Raises:
        FileNotFoundError, ValueError: see :func:`download`; an unreadable or unknown file.
    """
    weights = download(ref)
    config = _config_for(ref, weights)
    key = blob_name(weights, ref.filename)
    if config is not None:
        key += "-" + blob_name(config, posixpath.join(posixpath.dirname(ref.filename), CONFIG_FILE))
    out = _snapshot(weights, ref.filename).parent.parent / CONVERTED_DIR / f"{key}.ckpt"
    if out.is_file():
        return out
    obj = read_official_file(weights)
    if isinstance(obj, dict) and "walrus" in obj:
        return weights
    state = unwrap_state_dict(obj, ref.url)
    del obj
    log.info("converting %s once into %s", ref.url, out)
    conv = convert_state_dict(state, config=config, source=ref.url)
    ckpt = conv.checkpoint()
    ckpt["walrus"]["source"]["hub"] = {
        "repo_id": ref.repo_id,
        "filename": ref.filename,
        "revision": ref.revision,
        "commit": _snapshot(weights, ref.filename).name,
        "config": CONFIG_FILE if config is not None else None,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(ckpt, out)
    return out


def open_checkpoint(spec: str | os.PathLike) -> tuple[dict[str, Any], Path]:
    """Load a walrus checkpoint dict from a path or an ``hf://`` URL.

    A local official checkpoint (e.g. the released ``walrus.pt``) is converted in memory, with
    the ``extended_config.yaml`` from its folder when there is one (otherwise the converter's
    released defaults).

    Returns:
        ``(checkpoint dict, the file it was read from)``; validate it with
        :func:`walrus.checkpoint.walrus_meta`.

    Raises:
        FileNotFoundError, ValueError: see :func:`download` and
            :func:`walrus.checkpoint.load_checkpoint_file`.
    """
    if is_hub_url(spec):
        path = converted_checkpoint(parse_hub_url(str(spec)))
        return load_checkpoint_file(path), path
    path = Path(spec)
    ckpt = load_checkpoint_file(path)
    if "walrus" in ckpt:
        return ckpt, path
    try:
        state = unwrap_state_dict(ckpt, str(path))
        check_layout(state, str(path))
    except ValueError:
        return ckpt, path  # not official either: walrus_meta says what is wrong
    config = config_beside(path)
    log.info(
        "converting official checkpoint %s in memory (config: %s)",
        path,
        config or "released defaults",
    )
    return convert_state_dict(state, config=config, source=str(path)).checkpoint(), path
