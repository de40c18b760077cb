"""Checkpoint files: atomic writes, safe loads, and the model + vocabulary they carry.

A walrus checkpoint is a Lightning checkpoint with one extra entry, ``"walrus"``:
``{"format": 1, "model_config": {...}, "vocab": {...}, "checksums": {...}}``. Everything in it
is plain tensors, numbers, strings, lists and dicts, so it loads with
``torch.load(weights_only=True)`` and loading never executes code from the file.
``checksums`` maps the location of every tensor outside the ``"walrus"`` entry (e.g.
``state_dict/model.encoder.weight``) to the SHA-256 of its bytes; every load verifies them.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

from walrus.atomic import atomic_path
from walrus.data.vocab import FieldVocabulary
from walrus.model.config import MODEL_TARGET, WalrusConfig

CHECKPOINT_FORMAT = 1
MODEL_TARGETS = (MODEL_TARGET,)
MODEL_PREFIX = "model."


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(location, tensor)`` for every tensor in nested dicts/lists, skipping ``"walrus"``."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if not (prefix == "" and key == "walrus"):
                yield from _tensors(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}/{i}")


def _digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and raw bytes."""
    t = tensor.detach().cpu().contiguous().reshape(-1)
    h = hashlib.sha256(f"{t.dtype}{tuple(tensor.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def tensor_checksums(ckpt: dict[str, Any]) -> dict[str, str]:
    """SHA-256 per tensor of a checkpoint (outside its ``"walrus"`` entry), in storage order."""
    return {name: _digest(t) for name, t in _tensors(ckpt)}


def with_checksums(ckpt: dict[str, Any]) -> dict[str, Any]:
    """``ckpt`` with ``walrus.checksums`` filled in (a shallow copy; no-op without ``"walrus"``)."""
    if not isinstance(ckpt.get("walrus"), dict):
        return ckpt
    return {**ckpt, "walrus": {**ckpt["walrus"], "checksums": tensor_checksums(ckpt)}}


def verify_checksums(ckpt: dict[str, Any], path: str | os.PathLike) -> None:
    """Check every tensor against ``walrus.checksums``; warn when a walrus checkpoint has none.

    Raises:
        ValueError: naming the file and the first tensor that is missing, extra or altered.
    """
    meta = ckpt.get("walrus")
    if not isinstance(meta, dict):
        return
    stored = meta.get("checksums")
    if stored is None:
        warnings.warn(
            f"checkpoint {path} has no tensor checksums (written by an older walrus); "
            "corruption in it cannot be detected",
            stacklevel=3,
        )
        return
    if not isinstance(stored, dict):
        raise ValueError(f"checkpoint {path}: walrus.checksums is a {type(stored).__name__}")
    found = dict(_tensors(ckpt))
    for name in [*stored, *(k for k in found if k not in stored)]:
        if name not in found or name not in stored or _digest(found[name]) != stored[name]:
            what = "missing" if name not in found else "not listed" if name not in stored else ""
            raise ValueError(
                f"checkpoint {path} is corrupt: tensor {name} "
                f"{what or 'does not match its stored checksum'} (damaged copy or disk?); "
                "use another checkpoint"
            )


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename over it.

    A walrus checkpoint (a dict with a ``"walrus"`` entry) gets its tensor checksums stored.
    A full disk raises :class:`~walrus.errors.DiskFullError` naming ``path``.
    """
    if isinstance(obj, dict):
        obj = with_checksums(obj)
    # through a Python file: torch's own file writer reports a full disk as a RuntimeError
    # without an errno; a Python file raises OSError(ENOSPC), which torch's zip writer may mask
    # with a RuntimeError ("unexpected pos") while it finishes the archive
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            cause = e.__context__
            if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
                raise cause from None  # atomic_path turns it into DiskFullError
            raise


# what torch's weights-only unpickler says about a pickled class or function (wording varies
# by version: "Unsupported global: GLOBAL x", "unsupported GLOBAL x whose module os is blocked")
PICKLED_OBJECT = re.compile(
    r"unsupported global|reduce for unrecognized function|can only create new object", re.I
)


def pickled_object(error: Exception) -> str | None:
    """The line of a weights-only unpickling error naming a refused object, if it names one."""
    lines = [ln.strip() for ln in str(error).splitlines()]
    return next((ln for ln in lines if PICKLED_OBJECT.search(ln)), None)


def sniff_format(path: Path) -> str:
    """``"zip"``, ``"pickle"`` (legacy torch format), ``"empty"``, ``"text"`` or ``"unknown"``.

    Raises:
        PermissionError: naming the file, when it may not be read.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except PermissionError:
        raise PermissionError(
            f"{path}: permission denied; this user may not read it (check its permissions)"
        ) from None
    if not head:
        return "empty"
    if head.startswith(b"PK"):
        return "zip"
    if head[:1] == b"\x80":
        return "pickle"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return "unknown"
    return "text" if all(c.isprintable() or c.isspace() for c in text) else "unknown"


def load_checkpoint_file(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` and turn every failure into a clear error.

    Raises (each naming the file): FileNotFoundError, PermissionError, or ValueError for a
    directory, an empty, text or corrupt file, pickled objects besides tensors, or a tensor
    that fails its checksum.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise ValueError(f"checkpoint {path} is a directory, expected a .ckpt file")
    kind = sniff_format(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except PermissionError:
        raise PermissionError(
            f"{path}: permission denied; this user may not read it (check its permissions)"
        ) from None
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, KeyError, EOFError...
        if kind in ("empty", "text"):
            what = "empty" if kind == "empty" else "a text file"
            raise ValueError(
                f"checkpoint {path} is not a PyTorch checkpoint: it is {what}"
            ) from None
        refused = pickled_object(e) if isinstance(e, pickle.UnpicklingError) else None
        if refused:
            raise ValueError(
                f"checkpoint {path} holds pickled objects that are not plain weights; refusing "
                f"to unpickle it ({refused})"
            ) from None
        if isinstance(e, pickle.UnpicklingError):
            detail = "its pickle stream is invalid"
        else:
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"checkpoint {path} is not a readable PyTorch checkpoint (corrupt or truncated?): "
            f"{detail}"
        ) from None
    if not isinstance(ckpt, dict):
        raise ValueError(f"checkpoint {path} holds a {type(ckpt).__name__}, expected a dict")
    verify_checksums(ckpt, path)
    return ckpt


def walrus_meta(ckpt: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """The ``"walrus"`` entry of a checkpoint, validated."""
    meta = ckpt.get("walrus")
    if (
        not isinstance(meta, dict)
        or not isinstance(meta.get("model_config"), dict)
        or not isinstance(meta.get("vocab"), dict)
    ):
        raise ValueError(
            f"checkpoint {path} was not written by walrus training (no model config / field "
            "vocabulary inside); to use official Walrus weights, convert them first with "
            "`python -m walrus.compat convert`"
        )
    _check_plain_data(meta, "walrus", path)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"checkpoint {path} has format {meta.get('format')!r}; this version reads format "
            f"{CHECKPOINT_FORMAT}"
        )
    target = meta["model_config"].get("_target_")
    if target not in MODEL_TARGETS:
        raise ValueError(
            f"checkpoint {path} names model class {target!r}; only {MODEL_TARGETS} can be built"
        )
    return meta


# the only places a class name may appear in checkpoint metadata (read as data, allow-listed)
_TARGET_AT = ("walrus/model_config", "walrus/normalizer", "walrus/data_config")


def _check_plain_data(value: Any, where: str, path: str | os.PathLike) -> None:
    """Refuse metadata that is not plain data: objects, nested ``_target_`` configs, ``${...}``.

    Nothing read from a file is instantiated or resolved anyway; refusing such content makes a
    crafted or mis-written file fail loudly instead of being half-used. Values are not echoed.
    """
    if isinstance(value, str):
        if "${" in value:
            raise ValueError(
                f"checkpoint {path}: {where} holds an interpolation (${{...}}); checkpoint "
                "metadata is plain data and is never resolved"
            )
    elif isinstance(value, dict):
        if "_target_" in value and where not in _TARGET_AT:
            raise ValueError(
                f"checkpoint {path}: {where} holds an object config (_target_); checkpoint "
                "metadata must be plain data"
            )
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise ValueError(f"checkpoint {path}: {where} has a {type(key).__name__} key")
            _check_plain_data(item, f"{where}/{key}", path)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_plain_data(item, f"{where}/{i}", path)
    elif not (value is None or isinstance(value, bool | int | float)):
        raise ValueError(
            f"checkpoint {path}: {where} is a {type(value).__name__}; checkpoint metadata must "
            "be numbers, strings, lists and dicts"
        )


def model_state_dict(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Model weights from a Lightning checkpoint (``model.`` prefix stripped)."""
    state = ckpt.get("state_dict", {})
    return {k[len(MODEL_PREFIX) :]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}


def build_model(model_config: dict[str, Any], **overrides: Any) -> nn.Module:
    """Build the model a stored config describes, validated as a :class:`WalrusConfig`.

    The config is data (it may come from a checkpoint file): it is read option by option into
    a :class:`~walrus.model.config.WalrusConfig` and never passed to Hydra, so no ``_target_``
    inside it is instantiated and no ``${...}`` string is resolved. ``overrides`` replace
    options first (e.g. :attr:`WalrusConfig.RUNTIME_OPTIONS` from the current run).

    Raises:
        ValueError: an unknown class or option, a value of the wrong kind (naming the option),
            or options the model rejects.
    """
    from walrus.model.walrus import Walrus

    if not isinstance(model_config, dict):
        raise ValueError(f"model config must be a mapping, got {type(model_config).__name__}")
    try:
        config = WalrusConfig.from_dict({**model_config, **overrides})
    except ValueError as e:
        raise ValueError(f"cannot build the model from its config: {e}") from None
    return Walrus(config)


def load_weights_strict(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state`` into ``model``; any missing/unexpected key or shape mismatch is an error."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if own[k].shape != state[k].shape
    ]
    if missing or unexpected or mismatched:
        lines = [f"weights in {source} do not fit the model:"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {', '.join(missing[:10])}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {', '.join(unexpected[:10])}")
        if mismatched:
            lines.append(f"  shape mismatches ({len(mismatched)}): {'; '.join(mismatched[:10])}")
        raise ValueError("\n".join(lines))
    model.load_state_dict(state, strict=True)


def load_model(
    path: str | os.PathLike, map_location: Any = "cpu"
) -> tuple[nn.Module, FieldVocabulary]:
    """Rebuild a trained model and its field vocabulary from a walrus checkpoint alone."""
    model, vocab, _ = load_model_and_meta(path, map_location)
    return model, vocab


def load_model_and_meta(
    path: str | os.PathLike, map_location: Any = "cpu"
) -> tuple[nn.Module, FieldVocabulary, dict[str, Any]]:
    """``load_model`` plus the checkpoint's validated ``"walrus"`` entry."""
    ckpt = load_checkpoint_file(path, map_location)
    meta = walrus_meta(ckpt, path)
    try:
        model = build_model(meta["model_config"])
    except ValueError as e:
        raise ValueError(f"checkpoint {path}: {e}") from None
    load_weights_strict(model, model_state_dict(ckpt), str(path))
    return model, FieldVocabulary.from_dict(meta["vocab"]), meta


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO that writes atomically and loads with ``weights_only=True``."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict:
        return load_checkpoint_file(path, map_location or "cpu")
