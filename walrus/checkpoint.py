"""Checkpoint files: atomic writes, safe loads, and the model + vocabulary they carry.

A walrus checkpoint is a Lightning checkpoint with one extra entry, ``"walrus"``:
``{"format": 1, "model_config": {...}, "vocab": {...}}``. Everything in it is plain
tensors, numbers, strings, lists and dicts, so it loads with ``torch.load(weights_only=True)``
and loading never executes code from the file.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

from walrus.atomic import atomic_path
from walrus.data.vocab import FieldVocabulary

CHECKPOINT_FORMAT = 1
MODEL_TARGETS = ("walrus.model.walrus.Walrus",)
MODEL_PREFIX = "model."


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename over it."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def load_checkpoint_file(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` and turn every failure into a clear error."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise ValueError(f"checkpoint {path} is a directory, expected a .ckpt file")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"checkpoint {path} holds pickled objects that are not plain weights; refusing to "
            f"unpickle it ({str(e).splitlines()[0]})"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise ValueError(
            f"checkpoint {path} is not a readable PyTorch checkpoint (corrupt or truncated?): "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None
    if not isinstance(ckpt, dict):
        raise ValueError(f"checkpoint {path} holds a {type(ckpt).__name__}, expected a dict")
    return ckpt


def walrus_meta(ckpt: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """The ``"walrus"`` entry of a checkpoint, validated."""
    meta = ckpt.get("walrus")
    if not isinstance(meta, dict) or "model_config" not in meta or "vocab" not in meta:
        raise ValueError(
            f"checkpoint {path} was not written by walrus training (no model config / field "
            "vocabulary inside); to use official Walrus weights, convert them first with "
            "`python -m walrus.compat convert`"
        )
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


def model_state_dict(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Model weights from a Lightning checkpoint (``model.`` prefix stripped)."""
    state = ckpt.get("state_dict", {})
    return {k[len(MODEL_PREFIX) :]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}


def build_model(model_config: dict[str, Any], **overrides: Any) -> nn.Module:
    """Build the model a config describes: an allow-listed class called with plain keywords.

    The config is data (it may come from a checkpoint file): it is never passed to Hydra, so
    no ``_target_`` inside it is instantiated and no ``${...}`` string is resolved.

    Raises:
        ValueError: an unknown class, a nested object config, or arguments the class rejects.
    """
    from walrus.model.walrus import Walrus

    classes = {"walrus.model.walrus.Walrus": Walrus}
    target = model_config.get("_target_")
    if target not in MODEL_TARGETS:
        raise ValueError(f"model config names {target!r}, not a walrus model")
    kwargs = {k: v for k, v in {**model_config, **overrides}.items() if k != "_target_"}
    for key, value in kwargs.items():
        if not isinstance(key, str) or not _plain_value(value):
            raise ValueError(
                f"model config entry {key!r} must be a plain value (number, string, bool, list), "
                f"got {type(value).__name__}"
            )
    try:
        return classes[target](**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot build the model from its config: {e}") from None


def _plain_value(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_plain_value(v) for v in value)
    return False


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
    model = build_model(meta["model_config"])
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
