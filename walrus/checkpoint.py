"""Checkpoint files: atomic writes, safe loads, and the model + vocabulary they carry.

A walrus checkpoint is a Lightning checkpoint with one extra entry, ``"walrus"``:
``{"format": 1, "model_config": {...}, "vocab": {...}, "checksums": {...}}``. Everything in it
is plain tensors, numbers, strings, lists and dicts, so it loads with
``torch.load(weights_only=True)`` and loading never executes code from the file.
``checksums`` maps the location of every tensor outside the ``"walrus"`` entry (e.g.
``state_dict/model.encoder.weight``) to the SHA-256 of its bytes, and ``content_checksum`` is
the SHA-256 of everything else in the file: the metadata (``predict_delta``, the vocabulary,
the normaliser, the model and data configs, the run record) and Lightning's loop, optimizer
and callback entries, each number by its exact bits. Every load verifies both before any
value is used. A file written before ``content_checksum`` existed still loads, with a one-line
warning that its metadata cannot be checked. Tensor records must be stored uncompressed (as
``torch.save`` writes them): a deflate-compressed record is refused before it is inflated.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import pickle
import re
import stat
import struct
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

from walrus.atomic import atomic_path
from walrus.data.vocab import FieldVocabulary
from walrus.errors import reading
from walrus.model.config import MODEL_TARGET, WalrusConfig

CHECKPOINT_FORMAT = 1
MODEL_TARGETS = (MODEL_TARGET,)
MODEL_PREFIX = "model."


# deepest nesting accepted anywhere in a checkpoint (Lightning's own entries are < 10 deep)
MAX_DEPTH = 64


def _tensors(obj: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(location, tensor)`` for every tensor in nested dicts/lists, skipping ``"walrus"``.

    Walks iteratively, in storage order (a crafted file must not exhaust the interpreter's
    stack; :func:`load_checkpoint_file` also bounds the nesting).
    """
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        prefix, value = stack.pop()
        if isinstance(value, torch.Tensor):
            yield prefix, value
            continue
        if isinstance(value, dict):
            items = [(k, v) for k, v in value.items() if not (prefix == "" and k == "walrus")]
        elif isinstance(value, list | tuple):
            items = list(enumerate(value))
        else:
            continue
        for key, item in reversed(items):
            stack.append((f"{prefix}/{key}" if prefix else str(key), item))


def _digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and raw bytes."""
    t = tensor.detach().cpu().contiguous().reshape(-1)
    h = hashlib.sha256(f"{t.dtype}{tuple(tensor.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


# keys of the "walrus" entry that hold the checksums themselves (left out of the content one)
CHECKSUM_KEYS = ("checksums", "content_checksum")


def content_checksum(ckpt: dict[str, Any]) -> str:
    """SHA-256 of everything in a checkpoint besides tensor bytes and the checksums.

    Walks the structure iteratively in storage order and hashes each key and value with its
    kind: floats by their 8 bytes (a flipped bit changes the digest), tensors by position only
    (:func:`tensor_checksums` covers their bytes).
    """
    h = hashlib.sha256()
    stack: list[Any] = [ckpt]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            h.update(b"T")
        elif isinstance(value, dict):
            skip = CHECKSUM_KEYS if value is ckpt.get("walrus") else ()
            items = [(k, v) for k, v in value.items() if k not in skip]
            h.update(b"D%d:" % len(items))
            for key, item in reversed(items):
                stack.extend((item, key))  # the key is hashed before its value
        elif isinstance(value, list | tuple):
            h.update(b"L%d:" % len(value))
            stack.extend(reversed(value))
        elif isinstance(value, bool) or value is None:
            h.update(b"B" + repr(value).encode())
        elif isinstance(value, int):
            h.update(b"I" + str(value).encode() + b";")
        elif isinstance(value, float):
            h.update(b"F" + struct.pack("<d", value))
        elif isinstance(value, str):
            data = value.encode("utf-8", "surrogatepass")
            h.update(b"S%d:" % len(data) + data)
        else:  # torch.Size, dtypes, devices...: by kind and text
            text = f"{type(value).__name__}:{value!r}".encode("utf-8", "surrogatepass")
            h.update(b"O%d:" % len(text) + text)
    return h.hexdigest()


def tensor_checksums(ckpt: dict[str, Any]) -> dict[str, str]:
    """SHA-256 per tensor of a checkpoint (outside its ``"walrus"`` entry), in storage order."""
    return {name: _digest(t) for name, t in _tensors(ckpt)}


def with_checksums(ckpt: dict[str, Any]) -> dict[str, Any]:
    """``ckpt`` with ``walrus.checksums`` and ``walrus.content_checksum`` filled in (a shallow
    copy; no-op without ``"walrus"``)."""
    if not isinstance(ckpt.get("walrus"), dict):
        return ckpt
    out = {**ckpt, "walrus": {**ckpt["walrus"], "checksums": tensor_checksums(ckpt)}}
    out["walrus"]["content_checksum"] = content_checksum(out)
    return out


def verify_checksums(ckpt: dict[str, Any], path: str | os.PathLike) -> None:
    """Check everything but the tensors against ``walrus.content_checksum``, then every tensor
    against ``walrus.checksums``; warn (one line) when a walrus checkpoint lacks either.

    Raises:
        ValueError: naming the file and what is altered: its metadata, or the first tensor that
            is missing, extra or altered.
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
    content = meta.get("content_checksum")
    if content is None:
        warnings.warn(
            f"checkpoint {path} has no metadata checksum (written by an older walrus); "
            "corruption of its settings (vocabulary, normaliser, configs) cannot be detected",
            stacklevel=3,
        )
    elif content != content_checksum(ckpt):
        raise ValueError(
            f"checkpoint {path} is corrupt: its metadata (settings, vocabulary, normaliser, "
            "configs or training state) does not match its stored checksum (damaged copy or "
            "disk?); use another checkpoint"
        )
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
    A full disk, quota or file-size limit raises :class:`~walrus.errors.DiskFullError` naming
    ``path``.
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
            if isinstance(cause, OSError) and cause.errno in (
                errno.ENOSPC,
                errno.EDQUOT,
                errno.EFBIG,
            ):
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
    directory, a FIFO or device, an empty, text or corrupt file, pickled objects besides
    tensors, nesting deeper than :data:`MAX_DEPTH`, or a tensor that fails its checksum.
    """
    with reading(f"checkpoint {path}"):
        return _load_checkpoint_file(Path(path), map_location)


def _load_checkpoint_file(path: Path, map_location: Any) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise ValueError(f"checkpoint {path} is a directory, expected a .ckpt file")
    if not stat.S_ISREG(path.stat().st_mode):  # symlinks followed: the Hub's cache uses them
        raise ValueError(
            f"checkpoint {path} is not a regular file (a FIFO, socket or device?); expected a "
            ".ckpt file"
        )
    kind = sniff_format(path)
    if kind == "zip":
        _check_zip_records(path)
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
    _check_nesting(ckpt, path)
    verify_checksums(ckpt, path)
    return ckpt


def _check_zip_records(path: Path) -> None:
    """Refuse an archive with a compressed record, or one declaring more bytes than it holds,
    from its directory alone (nothing is inflated). ``torch.save`` stores records uncompressed;
    an archive Python cannot read is left to ``torch.load`` to report."""
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return
    size = path.stat().st_size
    for info in records:
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(
                f"checkpoint {path}: record {info.filename[:80]!r} is compressed; PyTorch "
                "checkpoints store records uncompressed, so this file was not written by "
                "torch.save (refused before inflating it)"
            )
        if info.file_size != info.compress_size or info.file_size > size:
            raise ValueError(
                f"checkpoint {path}: record {info.filename[:80]!r} declares {info.file_size} "
                "bytes, more than the file holds (corrupt or crafted)"
            )


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
    _check_meta_values(meta, path)
    return meta


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_meta_values(meta: dict[str, Any], path: str | os.PathLike) -> None:
    """The kinds of the metadata values loaders read besides the model config."""
    names = meta["vocab"].get("names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"checkpoint {path}: walrus.vocab.names must be a list of field names, got a "
            f"{type(names).__name__}"
            + ("" if not isinstance(names, list) else " holding other things than strings")
        )
    if not all(names) or len(set(names)) != len(names):
        raise ValueError(
            f"checkpoint {path}: walrus.vocab.names holds an empty or repeated field name"
        )
    if "predict_delta" in meta and not isinstance(meta["predict_delta"], bool):
        raise ValueError(
            f"checkpoint {path}: walrus.predict_delta must be true or false, got a "
            f"{type(meta['predict_delta']).__name__}"
        )
    data = meta.get("data_config")
    if data is None:
        return
    if not isinstance(data, dict):
        raise ValueError(f"checkpoint {path}: walrus.data_config is a {type(data).__name__}")
    if data.get("n_steps_input") is not None and not _is_count(data["n_steps_input"]):
        raise ValueError(
            f"checkpoint {path}: walrus.data_config.n_steps_input must be an int >= 1, got a "
            f"{type(data['n_steps_input']).__name__}"
        )
    stride = data.get("time_stride")
    strides = stride if isinstance(stride, list) and stride else [stride]
    if stride is not None and not all(_is_count(s) for s in strides):
        raise ValueError(
            f"checkpoint {path}: walrus.data_config.time_stride must be an int >= 1 or a list "
            "of them"
        )


# the only places a class name may appear in checkpoint metadata (read as data, allow-listed)
_TARGET_AT = ("walrus/model_config", "walrus/normalizer", "walrus/data_config")


def _check_nesting(ckpt: dict[str, Any], path: str | os.PathLike) -> None:
    """Refuse a checkpoint nested deeper than :data:`MAX_DEPTH` anywhere (iteratively)."""
    stack: list[tuple[str, Any, int]] = [("", ckpt, 0)]
    while stack:
        where, value, depth = stack.pop()
        if isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, list | tuple):
            items = list(enumerate(value))
        else:
            continue
        if items and depth >= MAX_DEPTH:
            raise ValueError(
                f"checkpoint {path}: {where} is nested more than {MAX_DEPTH} levels deep; not "
                "a checkpoint walrus or Lightning writes"
            )
        stack.extend((f"{where}/{k}" if where else str(k), v, depth + 1) for k, v in items)


def _check_plain_data(value: Any, where: str, path: str | os.PathLike) -> None:
    """Refuse metadata that is not plain data: objects, nested ``_target_`` configs, ``${...}``.

    Nothing read from a file is instantiated or resolved anyway; refusing such content makes a
    crafted or mis-written file fail loudly instead of being half-used. Values are not echoed.
    Walks iteratively; nesting is bounded by :func:`load_checkpoint_file`.
    """
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        where, value = stack.pop()
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
            for key in value:
                if not isinstance(key, str | int):
                    raise ValueError(f"checkpoint {path}: {where} has a {type(key).__name__} key")
            stack.extend((f"{where}/{k}", v) for k, v in reversed(value.items()))
        elif isinstance(value, list | tuple):
            stack.extend((f"{where}/{i}", v) for i, v in reversed(list(enumerate(value))))
        elif not (value is None or isinstance(value, bool | int | float)):
            raise ValueError(
                f"checkpoint {path}: {where} is a {type(value).__name__}; checkpoint metadata "
                "must be numbers, strings, lists and dicts"
            )


def model_state_dict(
    ckpt: dict[str, Any], path: str | os.PathLike = "checkpoint"
) -> dict[str, torch.Tensor]:
    """Model weights from a Lightning checkpoint (``model.`` prefix stripped).

    Raises:
        ValueError: naming ``path``, when ``state_dict`` is not a mapping of names to tensors.
    """
    state = ckpt.get("state_dict", {})
    if not isinstance(state, dict):
        raise ValueError(
            f"checkpoint {path}: its state_dict is a {type(state).__name__}, expected a mapping "
            "of parameter names to tensors"
        )
    bad = next(
        (k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)),
        None,
    )
    if bad is not None:
        raise ValueError(
            f"checkpoint {path}: state_dict entry {str(bad)[:80]!r} is not a named tensor"
        )
    return {k[len(MODEL_PREFIX) :]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}


_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")


def _options_in(shape: tuple[int, ...], stored: tuple[int, ...], config: WalrusConfig) -> str:
    """The size options whose values appear in ``shape`` where it differs from ``stored``."""
    odd = {n for i, n in enumerate(shape) if i >= len(stored) or stored[i] != n}
    sizes = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    named = [f"{k}={v}" for k, v in sizes.items() if isinstance(v, int) and v in odd and v > 1]
    return ", ".join(named) or "its sizes"


def check_config_fits(
    model_config: dict[str, Any], state: dict[str, torch.Tensor], source: str | os.PathLike
) -> WalrusConfig:
    """Check a stored model config against the stored weights before anything is allocated.

    The depth is compared with the block indices in ``state`` first (so building is bounded by
    the file), then every parameter's shape with the shapes the config implies, computed on
    PyTorch's ``meta`` device (no memory). Only then may the caller build the model for real.

    Returns:
        the validated config.

    Raises:
        ValueError: one line naming ``source`` and the option that disagrees with the weights.
    """
    with reading(f"checkpoint {source}"):
        return _check_config_fits(model_config, state, source)


def _check_config_fits(
    model_config: dict[str, Any], state: dict[str, torch.Tensor], source: str | os.PathLike
) -> WalrusConfig:
    from walrus.model.walrus import Walrus

    try:
        config = WalrusConfig.from_dict(model_config)
    except ValueError as e:
        raise ValueError(
            f"checkpoint {source}: cannot build the model from its config: {e}"
        ) from None
    blocks = {int(m.group(1)) for k in state if (m := _BLOCK_KEY.match(k))}
    if len(blocks) != config.depth:
        raise ValueError(
            f"checkpoint {source}: model_config depth={config.depth} but the weights hold "
            f"{len(blocks)} blocks"
        )
    with torch.device("meta"):
        implied = {k: tuple(v.shape) for k, v in Walrus(config).state_dict().items()}
    missing = [k for k in implied if k not in state]
    extra = [k for k in state if k not in implied]
    if missing or extra:
        raise ValueError(
            f"checkpoint {source}: its weights do not fit its model_config: "
            f"missing keys ({len(missing)}): {', '.join(missing[:3]) or '-'}; "
            f"unexpected keys ({len(extra)}): {', '.join(extra[:3]) or '-'}"
        )
    for key, shape in implied.items():
        stored = tuple(state[key].shape)
        if stored != shape:
            raise ValueError(
                f"checkpoint {source}: model_config {_options_in(shape, stored, config)} does "
                f"not fit the weights: {key} is {stored} in the file, the config implies {shape}"
            )
    return config


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
    """``load_model`` plus the checkpoint's validated ``"walrus"`` entry.

    The model config is checked against the stored weights (:func:`check_config_fits`) before
    the model is built, so a crafted size cannot make loading allocate more than the file holds.
    """
    with reading(f"checkpoint {path}"):
        return _load_model_and_meta(path, map_location)


def _load_model_and_meta(
    path: str | os.PathLike, map_location: Any
) -> tuple[nn.Module, FieldVocabulary, dict[str, Any]]:
    ckpt = load_checkpoint_file(path, map_location)
    meta = walrus_meta(ckpt, path)
    return model_from_checkpoint(ckpt, meta, path), FieldVocabulary.from_dict(meta["vocab"]), meta


def model_from_checkpoint(
    ckpt: dict[str, Any], meta: dict[str, Any], path: str | os.PathLike
) -> nn.Module:
    """The model of a loaded checkpoint (``meta`` from :func:`walrus_meta`), with its weights.

    The config is checked against the stored weights (:func:`check_config_fits`) first, so a
    crafted size is refused before anything is allocated.
    """
    state = model_state_dict(ckpt, path)
    config = check_config_fits(meta["model_config"], state, path)
    if len(meta["vocab"]["names"]) > config.n_fields:
        raise ValueError(
            f"checkpoint {path}: its vocabulary names {len(meta['vocab']['names'])} fields but "
            f"model_config n_fields={config.n_fields}"
        )
    try:
        model = build_model(meta["model_config"])
    except ValueError as e:
        raise ValueError(f"checkpoint {path}: {e}") from None
    load_weights_strict(model, state, str(path))
    return model


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
