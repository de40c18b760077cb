"""Official Walrus checkpoints -> this project's model and checkpoint format.

Both official key layouts are converted; :func:`check_layout` tells which one a file uses.

- **legacy** (``compat="walrus_official"``): separate ``space_bag`` field projection,
  ``encoder_dummy``, ``patch_jitterer.padding_tokens``, ``gamma``/``gamma_att`` layer scales,
  ``ff_out.1``. Pinned down numerically by the ``walrus_reference_tiny`` fixture.
- **current** (``compat="walrus_current"``): the layout of the released ``walrus.pt`` and of
  the current public PolymathicAI/walrus code. The field projection is ``embed.*.proj1``
  (one input column per vocabulary field, plus the reserved ids of three boundary flag
  channels), no pad tokens, no layer scales, ``ff_out`` without index. Pinned down by the
  ``walrus_current_tiny2d`` fixture. Without a config or field names the released model's
  settings and 67-field vocabulary are used (:mod:`walrus.compat.released`).

Key map (official -> ours; D dim, nh heads, E head dim):

- ``blocks.i.time_mixing.input_head`` is a 1x1x1 conv with rows ordered (head, q/k/v, E); ours
  is a Linear with rows ordered (q/k/v, head, E): the rows are permuted.
- ``blocks.i.time_mixing.output_head`` (1x1x1 conv) -> Linear: reshaped.
- ``blocks.i.space_mixing.rotary_emb.freqs`` (equal in every block) -> ``rope.freqs``.
- legacy: ``encoder_dummy`` (a learned input scale) is folded into ``space_bag.linear.weight``.
- current: ``blocks.i.space_mixing.ff_out.*`` -> ``ff_out.1.*``; ``encoder_dummy`` is kept.
- Every other key keeps its name and shape.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor

from walrus.checkpoint import CHECKPOINT_FORMAT, MODEL_PREFIX, atomic_torch_save
from walrus.compat.released import (
    FLAG_FIELDS,
    RELEASED_FIELDS,
    RELEASED_MODEL,
    RELEASED_N_STEPS_INPUT,
    RESERVED_NAMES,
)
from walrus.data.normalization import MeanStdNormalizer
from walrus.data.vocab import FieldVocabulary
from walrus.model.walrus import Walrus

log = logging.getLogger(__name__)

LAYOUTS = ("legacy", "current")
COMPAT = {"legacy": "walrus_official", "current": "walrus_current"}
WRAPPER_KEYS = ("model_state_dict", "state_dict")
PREFIXES = ("module.", "_orig_mod.")
TOP_KEYS = {
    "legacy": (
        "encoder_dummy",
        "space_bag.linear.weight",
        "space_bag.linear.bias",
        "patch_jitterer.padding_tokens",
    ),
    "current": ("encoder_dummy",),
}
OFFICIAL_EMBED = ("proj1.weight", "norm1.weight", "proj2.weight", "norm2.weight")
OFFICIAL_DEBED = ("proj1.weight", "norm1.weight", "proj2.weight", "proj2.bias")
OFFICIAL_TIME = (
    "norm1.weight",
    "input_head.weight",
    "input_head.bias",
    "output_head.weight",
    "output_head.bias",
    "qnorm.weight",
    "qnorm.bias",
    "knorm.weight",
    "knorm.bias",
    "rel_pos_bias.relative_attention_bias.weight",
)
OFFICIAL_SPACE = (
    "norm1.weight",
    "fused_ff_qkv.weight",
    "fused_ff_qkv.bias",
    "attn_out.weight",
    "q_norm.weight",
    "q_norm.bias",
    "k_norm.weight",
    "k_norm.bias",
    "rotary_emb.freqs",
)
LAYOUT_TIME = {"legacy": ("gamma",), "current": ()}
LAYOUT_SPACE = {
    "legacy": ("gamma_att", "ff_out.1.weight", "ff_out.1.bias"),
    "current": ("ff_out.weight", "ff_out.bias"),
}
# Official keys that have no parameter of the same name in our model, and where they go.
FREQS_NOTE = {
    "blocks.*.space_mixing.rotary_emb.freqs": "one copy kept as rope.freqs (equal in all blocks)"
}
FOLDED = {
    "legacy": {
        "encoder_dummy": "folded into space_bag.linear.weight (input scale)",
        **FREQS_NOTE,
    },
    "current": {
        "blocks.*.space_mixing.ff_out.{weight,bias}": "renamed ff_out.1.{weight,bias}",
        **FREQS_NOTE,
    },
}
OURS_ONLY = {"rope.freqs": "set from blocks.0.space_mixing.rotary_emb.freqs"}
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


# ---------------------------------------------------------------------- reading inputs


def read_official_file(path: str | os.PathLike, *, trust_pickle: bool = False) -> Any:
    """Load an official checkpoint file, memory-mapped, as plain tensors only.

    Args:
        path: the ``.pt`` file.
        trust_pickle: allow arbitrary pickled objects (runs code from the file; warns).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a PyTorch checkpoint (or a truncated one), or it holds pickled objects
            and ``trust_pickle`` is off.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"official checkpoint {path} does not exist or is not a file")
    mmap = zipfile.is_zipfile(path)  # the legacy (non-zip) torch format cannot be mmapped
    if not mmap:
        with open(path, "rb") as f:
            head = f.read(4)
        if head.startswith(b"PK"):
            raise ValueError(
                f"{path} is not a readable PyTorch checkpoint: the zip archive has no central "
                f"directory (truncated or corrupt download? {path.stat().st_size:,} bytes)"
            )
        if head[:1] != b"\x80":  # neither a zip archive nor a pickle stream
            raise ValueError(f"{path} is not a readable PyTorch checkpoint (unknown format)")
    if trust_pickle:
        warnings.warn(
            f"unpickling {path} with weights_only=False (--trust-pickle): this can run code "
            "from the file; only do this for files you trust",
            stacklevel=2,
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "Unsupported global" in str(e):
            raise ValueError(
                f"official checkpoint {path} holds pickled Python objects besides tensors, which "
                "a safe (weights_only) load refuses. If you trust the file's source, rerun with "
                "--trust-pickle (API: trust_pickle=True)"
            ) from None
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        detail = next((ln for ln in lines if "Unsupported" in ln), lines[0])
        raise ValueError(f"{path} is not a readable PyTorch checkpoint: {detail}") from None
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
        return yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{what} file {path} is not valid YAML/JSON: {first}") from None


def _field_map(obj: Mapping[str, Any]) -> Any:
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
    if isinstance(fields, Mapping) and _field_map(fields) is not None:
        fields = _field_map(fields)
    if isinstance(fields, Mapping):
        index = {str(k): v for k, v in fields.items()}
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


# ---------------------------------------------------------------------- layout and config


def _present(state: Mapping[str, Tensor], pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return sorted({m.group(1) for k in state if (m := rx.match(k))}, key=int)


def _expected_keys(
    layout: str, blocks: list[str], embeds: list[str], debeds: list[str]
) -> set[str]:
    keys = set(TOP_KEYS[layout])
    keys |= {f"embed.{d}.{k}" for d in embeds for k in OFFICIAL_EMBED}
    keys |= {f"debed.{d}.{k}" for d in debeds for k in OFFICIAL_DEBED}
    time = OFFICIAL_TIME + LAYOUT_TIME[layout]
    space = OFFICIAL_SPACE + LAYOUT_SPACE[layout]
    keys |= {f"blocks.{i}.time_mixing.{k}" for i in blocks for k in time}
    keys |= {f"blocks.{i}.space_mixing.{k}" for i in blocks for k in space}
    return keys


def _list(keys: set[str], limit: int = 12) -> str:
    items = sorted(keys, key=lambda k: (k.startswith("blocks."), k))  # per-block keys last
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_layout(state: Mapping[str, Tensor], source: str = "input") -> str:
    """Detect the official key layout: ``"legacy"`` or ``"current"``.

    Raises:
        ValueError: keys of neither layout (the missing and unexpected keys of the closer one
            are listed, on one line).
    """
    blocks = [str(i) for i in range(len(_present(state, r"blocks\.(\d+)\.")))] or ["0"]
    embeds = _present(state, r"embed\.(\d)\.") or ["2", "3"]
    debeds = _present(state, r"debed\.(\d)\.") or embeds
    diffs = {}
    for layout in LAYOUTS:
        expected = _expected_keys(layout, blocks, embeds, debeds)
        diffs[layout] = (expected - set(state), set(state) - expected)
    layout = min(LAYOUTS, key=lambda k: len(diffs[k][0]) + len(diffs[k][1]))
    missing, extra = diffs[layout]
    if missing or extra:
        parts = [f"{source} is not an official Walrus state dict (closest: the {layout} layout)"]
        if missing:
            parts.append(f"missing keys ({len(missing)}): {_list(missing)}")
        if extra:
            parts.append(f"unexpected keys ({len(extra)}): {_list(extra)}")
        raise ValueError("; ".join(parts))
    if embeds != debeds:
        raise ValueError(f"{source}: encoder sets {embeds} and decoder sets {debeds} differ")
    return layout


def _shape(state: Mapping[str, Tensor], key: str) -> tuple[int, ...]:
    return tuple(state[key].shape)


def _check_given(given: Mapping[str, tuple[Any, int]], source: str) -> None:
    """Config values that disagree with the weights are an error naming each one."""
    bad = [f"{k}={v!r} (weights: {w})" for k, (v, w) in given.items() if v is not None and v != w]
    if bad:
        raise ValueError(
            f"official config disagrees with the weights in {source}: {', '.join(bad)}"
        )


def _rope_max_freq(state: Mapping[str, Tensor]) -> float:
    """The RoPE ``max_freq`` from the stored frequencies ``linspace(1, max/2, n) * pi``."""
    freqs = state["blocks.0.space_mixing.rotary_emb.freqs"]
    if freqs.is_meta or freqs.numel() < 2:  # no values to read: the official default
        return 256.0
    return round(2 * float(freqs.float()[-1]) / math.pi, 6)


def _processor_shapes(state: Mapping[str, Tensor], dim: int) -> tuple[int, int, int, int, int]:
    """``(head_dim, heads, rel-bias buckets, mlp_dim, depth)`` from the processor's tensors."""
    head_dim = _shape(state, "blocks.0.time_mixing.qnorm.weight")[0]
    buckets, heads = _shape(
        state, "blocks.0.time_mixing.rel_pos_bias.relative_attention_bias.weight"
    )
    mlp_dim = _shape(state, "blocks.0.space_mixing.fused_ff_qkv.weight")[0] - 3 * dim
    depth = len(_present(state, r"blocks\.(\d+)\."))
    return head_dim, heads, buckets, mlp_dim, depth


def _official_heads(official: Mapping[str, Any]) -> Any:
    """``num_heads`` of an official config, top level or under ``processor.space_mixing``."""
    space = (official.get("processor") or {}).get("space_mixing") or {}
    return official.get("num_heads", space.get("num_heads"))


def infer_config(
    state: Mapping[str, Tensor],
    official: Mapping[str, Any],
    source: str = "input",
    layout: str = "legacy",
) -> dict[str, Any]:
    """Our model config from the official tensor shapes, checked against the official config.

    Heads come from the q-norm width (head dim) and the time bias table; ``official`` (its
    ``hidden_dim``, ``num_heads``, ``processor_blocks``, ``n_states``...) must agree with them.
    Run-time settings (``causal_in_time``, ``jitter_patches``, ``drop_path``, ``groups``) are
    read from it, with the published model's values as defaults.

    Raises:
        ValueError: inconsistent shapes, or a config that disagrees with them.
    """
    if layout == "current":
        return _infer_current_config(state, official, source)
    d0 = _present(state, r"embed\.(\d)\.")[0]
    proj, n_states = _shape(state, "space_bag.linear.weight")
    inter, p1, k1 = _shape(state, f"embed.{d0}.proj1.weight")[:3]
    dim, i2, k2 = _shape(state, f"embed.{d0}.proj2.weight")[:3]
    head_dim, heads, buckets, mlp_dim, depth = _processor_shapes(state, dim)
    if p1 != proj or i2 != inter or heads * head_dim != dim or mlp_dim < 2:
        raise ValueError(
            f"{source}: inconsistent official shapes (projection {proj} vs {p1}, intermediate "
            f"{inter} vs {i2}, heads {heads} x head dim {head_dim} vs hidden {dim}, mlp {mlp_dim})"
        )
    _check_given(
        {
            "hidden_dim": (official.get("hidden_dim"), dim),
            "num_heads": (_official_heads(official), heads),
            "processor_blocks": (official.get("processor_blocks"), depth),
            "projection_dim": (official.get("projection_dim"), proj),
            "intermediate_dim": (official.get("intermediate_dim"), inter),
            "n_states": (official.get("n_states"), n_states),
        },
        source,
    )
    groups = official.get("groups")
    if not isinstance(groups, int) or dim % groups or inter % groups:
        groups = math.gcd(math.gcd(dim, inter), 16)
    include_d = [int(d) for d in _present(state, r"embed\.(\d)\.")]
    return {
        "_target_": "walrus.model.walrus.Walrus",
        "n_fields": n_states,
        "dim": dim,
        "depth": depth,
        "heads": heads,
        "projection_dim": proj,
        "intermediate_dim": inter,
        "mlp_ratio": mlp_dim / dim,
        "causal": bool(official.get("causal_in_time", True)),
        "groups": groups,
        "kernel_sizes": [k1, k2],
        "target_latent": [32, 32, 16],
        "include_d": include_d,
        "jitter": bool(official.get("jitter_patches", True)),
        "drop_path": float(official.get("drop_path", 0.0)),
        "rope_max_freq": _rope_max_freq(state),
        "rel_pos_buckets": buckets,
        "rel_pos_max_distance": 32,  # the official call never passes its 128
        "compat": COMPAT["legacy"],
    }


def _infer_current_config(
    state: Mapping[str, Tensor], official: Mapping[str, Any], source: str
) -> dict[str, Any]:
    """:func:`infer_config` for the current layout; unset settings are the released model's."""
    d0 = _present(state, r"embed\.(\d)\.")[0]
    inter, n_states, k1 = _shape(state, f"embed.{d0}.proj1.weight")[:3]
    dim, i2, k2 = _shape(state, f"embed.{d0}.proj2.weight")[:3]
    head_dim, heads, buckets, mlp_dim, depth = _processor_shapes(state, dim)
    if i2 != inter or heads * head_dim != dim or mlp_dim < 2 or n_states <= len(FLAG_FIELDS):
        raise ValueError(
            f"{source}: inconsistent official shapes (intermediate {inter} vs {i2}, heads {heads} "
            f"x head dim {head_dim} vs hidden {dim}, mlp {mlp_dim}, {n_states} field columns in "
            f"embed.{d0}.proj1.weight)"
        )
    _check_given(
        {
            "hidden_dim": (official.get("hidden_dim"), dim),
            "num_heads": (_official_heads(official), heads),
            "processor_blocks": (official.get("processor_blocks"), depth),
            "intermediate_dim": (official.get("intermediate_dim"), inter),
            "n_states": (official.get("n_states"), n_states),
        },
        source,
    )
    for key in ("override_dimensionality", "dim_key_override"):
        if official.get(key):
            raise ValueError(
                f"official config sets {key}={official[key]!r}: converting a model that picks its "
                "encoder this way is not supported (the released model leaves it unset)"
            )
    settings = {**RELEASED_MODEL, **official}
    for key in ("causal_in_time", "jitter_patches", "use_periodic_fixed_jitter"):
        if not isinstance(settings[key], bool):
            raise ValueError(f"official config {key}={settings[key]!r} must be true or false")
    drop = settings["drop_path"]
    if isinstance(drop, bool) or not isinstance(drop, int | float) or not 0 <= drop < 1:
        raise ValueError(f"official config drop_path={drop!r} must be a number in [0, 1)")
    groups = settings["groups"]  # no numerical effect: the official norms are per channel
    if not isinstance(groups, int) or dim % groups or inter % groups:
        groups = math.gcd(math.gcd(dim, inter), 16)
    jitter = settings["jitter_patches"]
    return {
        "_target_": "walrus.model.walrus.Walrus",
        "n_fields": n_states,
        "dim": dim,
        "depth": depth,
        "heads": heads,
        "intermediate_dim": inter,
        "mlp_ratio": mlp_dim / dim,
        "causal": settings["causal_in_time"],
        "groups": groups,
        "kernel_sizes": [k1, k2],
        "target_latent": [32, 32, 16],
        "include_d": [int(d) for d in _present(state, r"embed\.(\d)\.")],
        "jitter": jitter,
        "latent_roll": jitter,  # the official model rolls the latent whenever it jitters
        "drop_path": float(drop),
        "rope_max_freq": _rope_max_freq(state),
        "rel_pos_buckets": buckets,
        "rel_pos_max_distance": 32,  # the official call never passes its 128
        "compat": COMPAT["current"],
        "flag_fields": list(FLAG_FIELDS),
    }


def _check_reserved(raw: Mapping[str, Any], source: str) -> None:
    """A config's ``reserved_indices`` must be the ids the current layout's code appends."""
    reserved = raw.get("reserved_indices")
    if reserved is None:
        return
    try:
        ids = sorted(int(k) for k in reserved)
    except (TypeError, ValueError):
        ids = None
    if ids != sorted(FLAG_FIELDS):
        raise ValueError(
            f"{source}: reserved_indices {reserved!r} differ from the vocabulary ids the current "
            f"layout appends as ones / wall / open channels ({list(FLAG_FIELDS)})"
        )


def _n_steps_input(raw: Mapping[str, Any]) -> int | None:
    """``n_steps_input`` of an official config (released or training layout), if given."""
    for section in ("trainer_and_data", "data"):
        part = raw.get(section)
        value = part.get("n_steps_input") if isinstance(part, Mapping) else None
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"official config {section}.n_steps_input={value!r} must be an integer >= 1"
                )
            return value
    return None


def _is_released(cfg: Mapping[str, Any]) -> bool:
    """Whether a current-layout config has the released model's shapes."""
    shapes = {
        "dim": "hidden_dim",
        "depth": "processor_blocks",
        "heads": "num_heads",
        "intermediate_dim": "intermediate_dim",
        "n_fields": "n_states",
    }
    return all(cfg[ours] == RELEASED_MODEL[theirs] for ours, theirs in shapes.items())


# ---------------------------------------------------------------------- mapping


def _map_tensors(
    state: dict[str, Tensor], cfg: Mapping[str, Any], layout: str, source: str
) -> dict[str, Tensor]:
    """Pop official tensors one by one into our names (no second full copy is kept)."""
    dim, heads = cfg["dim"], cfg["heads"]
    hd = dim // heads
    out: dict[str, Tensor] = {}
    if layout == "legacy":
        dummy = state.pop("encoder_dummy")
        w = state.pop("space_bag.linear.weight")
        out["space_bag.linear.weight"] = w * dummy.to(w.dtype)  # x * d then W -> (W d) x
    freqs = None
    for key in sorted(state):
        t = state.pop(key)
        if key.endswith("rotary_emb.freqs"):
            if freqs is None:
                freqs = t
            elif not (t.is_meta or freqs.is_meta) and not torch.equal(freqs, t):
                raise ValueError(f"{source}: {key} differs from block 0's rotary frequencies")
            continue
        if key.endswith("time_mixing.input_head.weight"):  # rows (he, j, e) -> (j, he, e)
            t = t.reshape(heads, 3, hd, dim).transpose(0, 1).reshape(3 * dim, dim)
        elif key.endswith("time_mixing.input_head.bias"):
            t = t.reshape(heads, 3, hd).transpose(0, 1).reshape(3 * dim)
        elif key.endswith("time_mixing.output_head.weight"):
            t = t.reshape(dim, dim)
        elif layout == "current" and re.search(r"space_mixing\.ff_out\.(weight|bias)$", key):
            key = key.replace(".ff_out.", ".ff_out.1.")
        out[key] = t
    out["rope.freqs"] = freqs
    return out


def _check_shapes(out: Mapping[str, Tensor], cfg: Mapping[str, Any], source: str) -> int:
    """Compare with our model's state dict (built on the meta device); returns its size."""
    kwargs = {k: v for k, v in cfg.items() if k != "_target_"}
    with torch.device("meta"):
        model = Walrus(**kwargs)
    own = model.state_dict()
    missing, extra = set(own) - set(out), set(out) - set(own)
    if missing or extra:
        raise ValueError(
            f"{source} does not map onto our model: missing {_list(missing)}; extra {_list(extra)}"
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
    elif _field_map(raw) is not None:
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
        _check_reserved(raw, source)
        released = _is_released(cfg)
        names = _current_names(fields, raw, cfg["n_fields"], released, notes)
        n_steps = _n_steps_input(raw) or (RELEASED_N_STEPS_INPUT if released else None)
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
    out = _map_tensors(state, cfg, layout, source)
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
    kwargs = {k: v for k, v in conv.model_config.items() if k != "_target_"}
    with torch.device("meta"):
        model = Walrus(**kwargs)
    weights = {k: v.float() if v.is_floating_point() else v for k, v in conv.state_dict.items()}
    model.load_state_dict(weights, strict=True, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{source}: tensors left without values after loading: {left[:5]}")
    model.conversion_report = conv.report
    log.info("converted official Walrus weights from %s\n%s", source, conv.report)
    return model.eval(), conv.vocab


def convert_file(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    fields: Sequence[str] | Mapping[str, int] | str | os.PathLike | None = None,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    trust_pickle: bool = False,
) -> ConversionReport:
    """Convert an official checkpoint file into a walrus checkpoint at ``out`` (atomic write).

    Raises:
        FileNotFoundError, ValueError: bad input; nothing is written then.
    """
    obj = read_official_file(src, trust_pickle=trust_pickle)
    state = unwrap_state_dict(obj, str(src))
    del obj
    conv = convert_state_dict(state, fields=fields, config=config, source=str(src))
    atomic_torch_save(conv.checkpoint(), out)
    return conv.report
