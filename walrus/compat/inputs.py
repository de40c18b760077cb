"""Reading the converter's inputs: official checkpoint files, field names, official configs.

Everything here turns a missing or malformed input into a one-line ``ValueError`` /
``FileNotFoundError`` naming the file; nothing read is instantiated or resolved.
"""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from walrus.checkpoint import pickled_object, sniff_format
from walrus.safe_yaml import load_yaml

WRAPPER_KEYS = ("model_state_dict", "state_dict")
PREFIXES = ("module.", "_orig_mod.")


def read_official_file(path: str | os.PathLike, *, trust_pickle: bool = False) -> Any:
    """Load an official checkpoint file, memory-mapped, as plain tensors only.

    Args:
        path: the ``.pt`` file.
        trust_pickle: allow arbitrary pickled objects (runs code from the file; warns).

    Raises:
        FileNotFoundError: no such file.
        PermissionError: the file may not be read.
        ValueError: a directory, not a PyTorch checkpoint (or a truncated one), or it holds
            pickled objects and ``trust_pickle`` is off.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"official checkpoint {path} is a directory, expected a .pt file")
    if not path.is_file():
        raise FileNotFoundError(f"official checkpoint {path} does not exist or is not a file")
    kind = sniff_format(path)  # PermissionError naming the file if it may not be read
    if kind == "zip" and not zipfile.is_zipfile(path):
        raise ValueError(
            f"{path} is not a readable PyTorch checkpoint: the zip archive has no central "
            f"directory (truncated or corrupt download? {path.stat().st_size:,} bytes)"
        )
    if kind in ("empty", "text", "unknown"):  # neither a zip archive nor a pickle stream
        what = {"empty": "it is empty", "text": "it is a text file"}.get(kind, "unknown format")
        raise ValueError(f"{path} is not a readable PyTorch checkpoint ({what})")
    if trust_pickle:
        warnings.warn(
            f"unpickling {path} with weights_only=False (--trust-pickle): this can run code "
            "from the file; only do this for files you trust",
            stacklevel=2,
        )
    try:
        # the legacy (non-zip) torch format cannot be memory-mapped
        return torch.load(
            path, map_location="cpu", weights_only=not trust_pickle, mmap=kind == "zip"
        )
    except pickle.UnpicklingError as e:
        refused = pickled_object(e)
        if refused:
            raise ValueError(
                f"official checkpoint {path} holds pickled Python objects besides tensors, which "
                f"a safe (weights_only) load refuses ({refused}). If you trust the file's "
                "source, rerun with --trust-pickle (API: trust_pickle=True)"
            ) from None
        raise ValueError(
            f"{path} is not a readable PyTorch checkpoint: its pickle stream is invalid"
        ) from None
    except PermissionError:
        raise PermissionError(
            f"{path}: permission denied; this user may not read it (check its permissions)"
        ) from None
    except Exception as e:  # torch raises RuntimeError, KeyError, EOFError... on non-checkpoints
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path} is not a readable PyTorch checkpoint: {first}") from None


def unwrap_state_dict(obj: Any, source: str = "input") -> dict[str, Tensor]:
    """The flat ``name -> tensor`` dict inside a checkpoint object.

    Accepts a bare state dict, ``{"model_state_dict": ...}``, ``{"state_dict": ...}`` and the
    published ``{"app": {"model": ...}}``; strips a ``module.`` / ``_orig_mod.`` prefix.

    Raises:
        ValueError: no tensors found.
    """
    if not isinstance(obj, Mapping):
        raise ValueError(f"{source} holds a {type(obj).__name__}, not a checkpoint dict")
    for key in WRAPPER_KEYS:
        if isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    else:
        app = obj.get("app")
        if isinstance(app, Mapping) and isinstance(app.get("model"), Mapping):
            obj = app["model"]
    state = {str(k): v for k, v in obj.items() if isinstance(v, Tensor)}
    if not state:
        keys = ", ".join(map(str, list(obj)[:10]))
        raise ValueError(
            f"{source} is not a model checkpoint: no tensors found (top-level keys: {keys or 'none'})"
        )
    for prefix in PREFIXES:
        if all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return state


def _load_yaml(path: str | os.PathLike, what: str) -> Any:
    """A YAML (or JSON) file's content; missing or malformed files are clear errors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {path} does not exist")
    try:
        return load_yaml(path)  # no aliases, tags or files over 1 MiB
    except ValueError as e:
        reason = str(e).removeprefix(f"{path}: ")
        raise ValueError(f"{what} file {path} is not valid YAML/JSON: {reason}") from None


def field_map(obj: Mapping[str, Any]) -> Any:
    """The field index map inside an official config (released or training layout), if any."""
    if "field_index_map" in obj:
        return obj["field_index_map"]
    data = obj.get("data")
    if isinstance(data, Mapping) and "field_index_map_override" in data:
        return data["field_index_map_override"]
    return None


def read_fields(
    fields: Sequence[str] | Mapping[str, int] | str | os.PathLike | None,
    n_states: int,
    key: str = "space_bag.linear.weight columns",
) -> list[str]:
    """Official field names, one per embedding index.

    ``fields`` is a list of names or a ``name: index`` mapping, or a YAML/JSON file holding one
    of them or a full official config (its ``field_index_map`` or
    ``data.field_index_map_override``). ``None`` gives placeholders ``official_field_<i>``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: malformed, or its length differs from the embedding's ``n_states``.
    """
    if fields is None:
        return [f"official_field_{i}" for i in range(n_states)]
    source = "fields"
    if isinstance(fields, str | os.PathLike):
        source = f"fields file {fields}"
        fields = _load_yaml(fields, "fields")
    if isinstance(fields, Mapping) and field_map(fields) is not None:
        fields = field_map(fields)
    if isinstance(fields, Mapping):
        index = {str(k): v for k, v in fields.items()}
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in index.values()):
            raise ValueError(f"{source}: a name -> index mapping must map each name to an integer")
        if sorted(index.values()) != list(range(len(index))):
            raise ValueError(
                f"{source}: a name -> index mapping must use each index 0..{len(index) - 1} once"
            )
        fields = sorted(index, key=index.__getitem__)
    if not isinstance(fields, list | tuple) or not all(isinstance(f, str) and f for f in fields):
        raise ValueError(f"{source} must be a list of field names (or a name -> index mapping)")
    if len(set(fields)) != len(fields):
        raise ValueError(f"{source} names a field twice")
    if len(fields) != n_states:
        raise ValueError(
            f"{source} lists {len(fields)} fields but the checkpoint's field embedding has "
            f"{n_states} ({key}); give one name per embedding index"
        )
    return list(fields)


def read_config(config: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    """The official config as a plain dict (the whole file: see :func:`model_section`)."""
    if config is None:
        return {}
    if isinstance(config, str | os.PathLike):
        path = config
        config = _load_yaml(path, "config")
        if not isinstance(config, Mapping):
            raise ValueError(f"config file {path} must hold a mapping")
    return dict(config)


def model_section(config: Mapping[str, Any]) -> dict[str, Any]:
    """The model settings of an official config: its ``model:`` section if present."""
    model = config.get("model")
    return dict(model) if isinstance(model, Mapping) else dict(config)
