"""Official Walrus checkpoints -> this project's model and checkpoint format.

Both official key layouts convert (:mod:`walrus.compat.keymap`); the model config is inferred
from the tensor shapes (:mod:`walrus.compat.infer`) and validated as a
:class:`~walrus.model.config.WalrusConfig`. For the current layout, without a config or field
names the released model's settings and 67-field vocabulary are used
(:mod:`walrus.compat.released`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from walrus.checkpoint import CHECKPOINT_FORMAT, MODEL_PREFIX, atomic_torch_save
from walrus.compat.infer import check_reserved, infer_config, is_released, n_steps_input
from walrus.compat.inputs import (
    field_map,
    model_section,
    read_config,
    read_fields,
    read_official_file,
    unwrap_state_dict,
)
from walrus.compat.keymap import COMPAT, FOLDED, OURS_ONLY, check_layout, key_list, map_tensors
from walrus.compat.released import RELEASED_FIELDS, RELEASED_N_STEPS_INPUT, RESERVED_NAMES
from walrus.data.normalization import MeanStdNormalizer
from walrus.data.vocab import FieldVocabulary
from walrus.model.config import WalrusConfig
from walrus.model.walrus import Walrus
from walrus.safe_paths import is_symlink

log = logging.getLogger(__name__)

# What the official model's output means (its trainer's ``prediction_type: delta``).
PREDICT_DELTA = True
NORMALIZATION_NOTE = (
    "official training normalised each sample by its mean and std over time and space (eps 1e-4 "
    "added to the std) and the output is the frame delta normalised by the deltas' mean and std; "
    "the checkpoint selects MeanStdNormalizer, which does the same"
)
JITTER_NOTE = (
    "inference as released: patch jitter (periodic axes shift by up to half their length, "
    "others within their padding) and a latent roll along periodic axes before every block; "
    "active when a jitter seed is given"
)


@dataclass
class ConversionReport:
    """What a conversion did.

    Attributes:
        layout: the official key layout found (``"legacy"`` or ``"current"``).
        n_tensors: official tensors read.
        n_params: parameters of the converted model.
        official_only: official keys with no same-named parameter of ours, and where they went.
        ours_only: our keys with no same-named official tensor, and where they came from.
        notes: anything else worth knowing (placeholder field names, inferred settings).
    """

    layout: str
    n_tensors: int
    n_params: int
    official_only: dict[str, str] = field(default_factory=dict)
    ours_only: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"official layout: {self.layout} (compat {COMPAT[self.layout]}); {self.n_tensors} "
            f"tensors read; {self.n_params:,} parameters"
        ]
        lines.append("official keys without a same-named parameter of ours:")
        lines += [f"  {k}: {v}" for k, v in self.official_only.items()] or ["  (none)"]
        lines.append("our keys without a same-named official tensor:")
        lines += [f"  {k}: {v}" for k, v in self.ours_only.items()] or ["  (none)"]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class Converted:
    """A converted official checkpoint.

    Attributes:
        state_dict: our model's weights (tensors may be memory-mapped views of the source file).
        model_config: keyword arguments of :class:`~walrus.model.walrus.Walrus` (with ``_target_``).
        vocab: the field vocabulary, one name per official embedding index.
        report: what was mapped, folded or added.
        inference: inference defaults stored in the checkpoint (``{"jitter": bool}``: whether
            rollouts should jitter by default, as the official model does); empty for legacy.
        data_config: training data facts stored in the checkpoint (``n_steps_input``).
    """

    state_dict: dict[str, Tensor]
    model_config: dict[str, Any]
    vocab: FieldVocabulary
    report: ConversionReport
    inference: dict[str, Any] = field(default_factory=dict)
    data_config: dict[str, Any] = field(default_factory=dict)

    def checkpoint(self) -> dict[str, Any]:
        """The converted weights as a walrus checkpoint dict (``load_model`` / ``init_from``)."""
        meta = {
            "format": CHECKPOINT_FORMAT,
            "model_config": self.model_config,
            "vocab": self.vocab.to_dict(),
            "predict_delta": PREDICT_DELTA,
            "normalizer": MeanStdNormalizer(eps=1e-4).config(),
            "source": {
                "converted_from": "official Walrus",
                "layout": self.report.layout,
                "normalization": NORMALIZATION_NOTE,
            },
        }
        if self.inference:
            meta["inference"] = dict(self.inference)
            if self.inference.get("jitter"):
                meta["source"]["jitter"] = JITTER_NOTE
        if self.data_config:
            meta["data_config"] = dict(self.data_config)
        return {
            "state_dict": {MODEL_PREFIX + k: v for k, v in self.state_dict.items()},
            "walrus": meta,
        }


def _model_config(cfg: Mapping[str, Any], source: str) -> WalrusConfig:
    """The inferred config, validated like a stored one."""
    try:
        return WalrusConfig.from_dict(cfg)
    except ValueError as e:
        raise ValueError(f"{source}: the inferred model config is invalid: {e}") from None


def _check_shapes(out: Mapping[str, Tensor], cfg: Mapping[str, Any], source: str) -> int:
    """Compare with our model's state dict (built on the meta device); returns its size."""
    with torch.device("meta"):
        model = Walrus(_model_config(cfg, source))
    own = model.state_dict()
    missing, extra = set(own) - set(out), set(out) - set(own)
    if missing or extra:
        raise ValueError(
            f"{source} does not map onto our model: missing {key_list(missing)}; "
            f"extra {key_list(extra)}"
        )
    for k, t in out.items():
        if tuple(t.shape) != tuple(own[k].shape):
            raise ValueError(
                f"{source}: shape mismatch at {k}: official {tuple(t.shape)} vs ours "
                f"{tuple(own[k].shape)}"
            )
    return model.num_params()


def _current_names(
    fields: Sequence[str] | Mapping[str, int] | str | os.PathLike | None,
    raw: Mapping[str, Any],
    n_states: int,
    released: bool,
    notes: list[str],
) -> list[str]:
    """Field names of a current-layout checkpoint: given, from the config, or defaults."""
    key = "embed.*.proj1.weight input columns"
    if fields is not None:
        names = read_fields(fields, n_states, key)
    elif field_map(raw) is not None:
        names = read_fields(dict(raw), n_states, key)
    elif n_states == len(RELEASED_FIELDS):
        names = list(RELEASED_FIELDS)
        notes.append("field names: the released 67-field vocabulary (built in)")
    else:
        names = [RESERVED_NAMES.get(i, f"official_field_{i}") for i in range(n_states)]
        notes.append(
            "no field names given: placeholders official_field_<i> used (ids 0-2 named after the "
            "reserved flag channels); pass --fields to name the official embedding indices"
        )
    odd = {i: names[i] for i in RESERVED_NAMES if names[i] != RESERVED_NAMES[i]}
    if odd:
        notes.append(
            f"ids {sorted(odd)} are named {list(odd.values())}, but the current layout uses "
            "them for its boundary flag channels: fields with these names cannot be used"
        )
    if released and names != list(RELEASED_FIELDS):
        notes.append("the field names differ from the released vocabulary")
    return names


def convert_state_dict(
    state: dict[str, Tensor],
    *,
    fields: Sequence[str] | Mapping[str, int] | str | os.PathLike | None = None,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    source: str = "input",
) -> Converted:
    """Convert an official state dict (either layout); ``state`` is emptied as it goes.

    Args:
        state: flat official ``name -> tensor`` dict (see :func:`unwrap_state_dict`); meta
            tensors work (shapes and keys are converted, no values read).
        fields: official field names (list, mapping, or YAML/JSON file); for the current
            layout the config's ``field_index_map`` or the released vocabulary is the default.
        config: official config (dict or YAML/JSON file) to check against and read settings
            from; for the current layout the released model's settings fill what it lacks.
        source: name used in error messages.

    Raises:
        FileNotFoundError, ValueError: bad input, before anything is written.
    """
    layout = check_layout(state, source)
    n_tensors = len(state)
    raw = read_config(config)
    official = model_section(raw)
    cfg = infer_config(state, official, source, layout)
    notes = [f"heads {cfg['heads']} inferred from the head dim and the time bias table"]
    inference: dict[str, Any] = {}
    data_config: dict[str, Any] = {}
    if layout == "current":
        check_reserved(raw, source)
        released = is_released(cfg)
        names = _current_names(fields, raw, cfg["n_fields"], released, notes)
        n_steps = n_steps_input(raw) or (RELEASED_N_STEPS_INPUT if released else None)
        if n_steps:
            data_config["n_steps_input"] = n_steps
        inference["jitter"] = cfg["jitter"]
        assumed = sorted(
            k for k in ("causal_in_time", "jitter_patches", "drop_path") if k not in official
        )
        if assumed:
            notes.append(f"not in the config, the released model's values used: {assumed}")
        if cfg["jitter"] and not official.get("use_periodic_fixed_jitter", True):
            notes.append(
                "the config selects the non-fixed patch jitterer; this model jitters like the "
                "released fixed one (jittered outputs differ, unjittered ones are exact)"
            )
        if official.get("input_field_drop"):
            notes.append("input_field_drop (whole-field dropout in training) is not reproduced")
    else:
        names = read_fields(fields, cfg["n_fields"])
        if fields is None:
            notes.append(
                "no field names given: placeholders official_field_<i> used; pass --fields to "
                "name the official embedding indices"
            )
    out = map_tensors(state, cfg, layout, source)
    n_params = _check_shapes(out, cfg, source)
    report = ConversionReport(
        layout=layout,
        n_tensors=n_tensors,
        n_params=n_params,
        official_only=dict(FOLDED[layout]),
        ours_only=dict(OURS_ONLY),
        notes=notes,
    )
    return Converted(out, cfg, FieldVocabulary(names), report, inference, data_config)


def load_official(
    path_or_state_dict: str | os.PathLike | Mapping[str, Any],
    *,
    fields: Sequence[str] | Mapping[str, int] | str | os.PathLike | None = None,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    trust_pickle: bool = False,
) -> tuple[Walrus, FieldVocabulary]:
    """Official Walrus weights (either layout) as our model, in eval mode.

    The model is built on the meta device and takes the converted tensors directly (no second
    copy; a memory-mapped file stays mapped, and parameters may share memory with the tensors
    of a given state dict). The conversion report is logged at INFO and kept
    as ``model.conversion_report``. A current-layout model jitters as released when a
    ``jitter_seed`` (or generator) is passed to its forward, and not otherwise.

    Args:
        path_or_state_dict: an official ``.pt`` file, or an already loaded checkpoint object
            (bare state dict or a ``model_state_dict`` / ``state_dict`` / ``app.model`` wrapper,
            optionally with a ``module.`` prefix). A given dict is not modified.
        fields: official field names, one per embedding index (list, mapping or YAML file).
        config: official config (dict or YAML/JSON file).
        trust_pickle: allow unpickling arbitrary objects from the file (warns).

    Returns:
        ``(model, vocab)``, like :func:`walrus.checkpoint.load_model`.

    Raises:
        FileNotFoundError, ValueError: bad input.
    """
    if isinstance(path_or_state_dict, Mapping):
        source = "the given state dict"
        state = dict(unwrap_state_dict(path_or_state_dict, source))
    else:
        source = str(path_or_state_dict)
        obj = read_official_file(path_or_state_dict, trust_pickle=trust_pickle)
        state = unwrap_state_dict(obj, source)
        del obj
    conv = convert_state_dict(state, fields=fields, config=config, source=source)
    with torch.device("meta"):
        model = Walrus(_model_config(conv.model_config, source))
    weights = {k: v.float() if v.is_floating_point() else v for k, v in conv.state_dict.items()}
    model.load_state_dict(weights, strict=True, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{source}: tensors left without values after loading: {left[:5]}")
    model.conversion_report = conv.report
    log.info("converted official Walrus weights from %s\n%s", source, conv.report)
    return model.eval(), conv.vocab


def check_output(src: str | os.PathLike, out: str | os.PathLike, overwrite: bool) -> None:
    """Refuse an output that is a directory, the input file itself, a symlink (see
    :mod:`walrus.safe_paths`), or exists (unless ``overwrite``), before anything is read.

    Raises:
        ValueError: naming ``out`` and what is wrong with it.
    """
    out = Path(out)
    if out.is_dir():
        raise ValueError(
            f"output {out} is a directory; give the walrus checkpoint's file name, e.g. "
            f"{out / 'walrus.ckpt'}"
        )
    if not os.path.lexists(out):
        return
    if out.exists() and Path(src).exists() and os.path.samefile(src, out):  # also via links
        raise ValueError(
            f"output {out} is the input file {src}; converting writes a new file: give another "
            "output name"
        )
    if is_symlink(out):  # planted or not, a link is neither followed nor silently replaced
        raise ValueError(
            f"output {out} is a symbolic link; give the path of the file to write itself"
        )
    if not overwrite:
        raise ValueError(f"output {out} exists; pass --overwrite to replace it")


def convert_file(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    fields: Sequence[str] | Mapping[str, int] | str | os.PathLike | None = None,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    trust_pickle: bool = False,
    overwrite: bool = False,
) -> ConversionReport:
    """Convert an official checkpoint file into a walrus checkpoint at ``out`` (atomic write).

    ``out`` may not be a directory, nor the input itself (also through a link); an existing
    ``out`` is replaced only with ``overwrite=True``.

    Raises:
        FileNotFoundError, ValueError: bad input or output; nothing is written then.
    """
    check_output(src, out, overwrite)
    obj = read_official_file(src, trust_pickle=trust_pickle)
    state = unwrap_state_dict(obj, str(src))
    del obj
    conv = convert_state_dict(state, fields=fields, config=config, source=str(src))
    atomic_torch_save(conv.checkpoint(), out)
    return conv.report
