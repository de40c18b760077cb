"""Official Walrus checkpoints -> this project's model and checkpoint format.

Two official key layouts exist. The *legacy* one (separate ``space_bag`` field projection,
``encoder_dummy``, ``patch_jitterer.padding_tokens``, ``gamma``/``gamma_att`` layer scales,
``ff_out.1``) is the one this converter supports and is pinned down numerically by the
reference fixture. The *current* public PolymathicAI/walrus layout (field projection inside the
encoder, ``ff_out`` without index, a different padding scheme and a periodic decoder wrap) is
detected and refused: its numerics are not reproduced here.

Key map (legacy official -> ours; D dim, nh heads, E head dim):

- ``encoder_dummy`` (a learned input scale) is folded into ``space_bag.linear.weight``.
- ``blocks.i.time_mixing.input_head`` is a 1x1x1 conv with rows ordered (head, q/k/v, E); ours
  is a Linear with rows ordered (q/k/v, head, E): the rows are permuted.
- ``blocks.i.time_mixing.output_head`` (1x1x1 conv) -> Linear: reshaped.
- ``blocks.i.space_mixing.rotary_emb.freqs`` (equal in every block) -> ``rope.freqs``.
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

from walrus.data.normalization import MeanStdNormalizer
from walrus.data.vocab import FieldVocabulary
from walrus.model.walrus import Walrus
from walrus.training.checkpoint import CHECKPOINT_FORMAT, MODEL_PREFIX, atomic_torch_save

log = logging.getLogger(__name__)

COMPAT = "walrus_official"
WRAPPER_KEYS = ("model_state_dict", "state_dict")
PREFIXES = ("module.", "_orig_mod.")
OFFICIAL_TOP = (
    "encoder_dummy",
    "space_bag.linear.weight",
    "space_bag.linear.bias",
    "patch_jitterer.padding_tokens",
)
OFFICIAL_EMBED = ("proj1.weight", "norm1.weight", "proj2.weight", "norm2.weight")
OFFICIAL_DEBED = ("proj1.weight", "norm1.weight", "proj2.weight", "proj2.bias")
OFFICIAL_TIME = (
    "gamma",
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
    "gamma_att",
    "norm1.weight",
    "fused_ff_qkv.weight",
    "fused_ff_qkv.bias",
    "ff_out.1.weight",
    "ff_out.1.bias",
    "attn_out.weight",
    "q_norm.weight",
    "q_norm.bias",
    "k_norm.weight",
    "k_norm.bias",
    "rotary_emb.freqs",
)
# Official keys that have no parameter of the same name in our model, and where they go.
FOLDED = {
    "encoder_dummy": "folded into space_bag.linear.weight (input scale)",
    "blocks.*.space_mixing.rotary_emb.freqs": "one copy kept as rope.freqs (equal in all blocks)",
}
OURS_ONLY = {"rope.freqs": "set from blocks.0.space_mixing.rotary_emb.freqs"}
# What the official model's output means (its trainer's ``prediction_type: delta``).
PREDICT_DELTA = True
NORMALIZATION_NOTE = (
    "official training normalised each sample by its mean and std over time and space (eps 1e-4 "
    "added to the std) and the output is the frame delta normalised by the deltas' mean and std; "
    "the checkpoint selects MeanStdNormalizer, which does the same"
)


@dataclass
class ConversionReport:
    """What a conversion did.

    Attributes:
        layout: the official key layout found (``"legacy"``).
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
            f"official layout: {self.layout}; {self.n_tensors} tensors read; "
            f"{self.n_params:,} parameters"
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
    """

    state_dict: dict[str, Tensor]
    model_config: dict[str, Any]
    vocab: FieldVocabulary
    report: ConversionReport

    def checkpoint(self) -> dict[str, Any]:
        """The converted weights as a walrus checkpoint dict (``load_model`` / ``init_from``)."""
        return {
            "state_dict": {MODEL_PREFIX + k: v for k, v in self.state_dict.items()},
            "walrus": {
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
            },
        }


# ---------------------------------------------------------------------- reading inputs


def read_official_file(path: str | os.PathLike, *, trust_pickle: bool = False) -> Any:
    """Load an official checkpoint file, memory-mapped, as plain tensors only.

    Args:
        path: the ``.pt`` file.
        trust_pickle: allow arbitrary pickled objects (runs code from the file; warns).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a PyTorch checkpoint, or it holds pickled objects and
            ``trust_pickle`` is off.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"official checkpoint {path} does not exist or is not a file")
    mmap = zipfile.is_zipfile(path)  # the legacy (non-zip) torch format cannot be mmapped
    if not mmap:
        with open(path, "rb") as f:
            if f.read(1) != b"\x80":  # neither a zip archive nor a pickle stream
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


def read_fields(fields: Sequence[str] | str | os.PathLike | None, n_states: int) -> list[str]:
    """Official field names, one per embedding index.

    ``fields`` is a list of names, or a YAML file holding a list of names, a ``name: index``
    mapping, or a full official config with ``data.field_index_map_override``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: malformed, or its length differs from the embedding's ``n_states``.
    """
    if fields is None:
        return [f"official_field_{i}" for i in range(n_states)]
    source = "fields"
    if isinstance(fields, str | os.PathLike):
        path = Path(fields)
        if not path.is_file():
            raise FileNotFoundError(f"fields file {path} does not exist")
        source = f"fields file {path}"
        fields = yaml.safe_load(path.read_text())
        if isinstance(fields, Mapping) and isinstance(fields.get("data"), Mapping):
            fields = fields["data"].get("field_index_map_override", fields)
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
            f"{n_states} (space_bag.linear.weight columns); give one name per embedding index"
        )
    return list(fields)


def read_config(config: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    """The official model config (``model:`` section if present) as a plain dict."""
    if config is None:
        return {}
    if isinstance(config, str | os.PathLike):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        config = yaml.safe_load(path.read_text())
        if not isinstance(config, Mapping):
            raise ValueError(f"config file {path} must hold a mapping")
    config = dict(config)
    if isinstance(config.get("model"), Mapping):
        config = dict(config["model"])
    return config


# ---------------------------------------------------------------------- layout and config


def _present(state: Mapping[str, Tensor], pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return sorted({m.group(1) for k in state if (m := rx.match(k))}, key=int)


def _expected_keys(blocks: list[str], embeds: list[str], debeds: list[str]) -> set[str]:
    keys = set(OFFICIAL_TOP)
    keys |= {f"embed.{d}.{k}" for d in embeds for k in OFFICIAL_EMBED}
    keys |= {f"debed.{d}.{k}" for d in debeds for k in OFFICIAL_DEBED}
    keys |= {f"blocks.{i}.time_mixing.{k}" for i in blocks for k in OFFICIAL_TIME}
    keys |= {f"blocks.{i}.space_mixing.{k}" for i in blocks for k in OFFICIAL_SPACE}
    return keys


def _list(keys: set[str], limit: int = 20) -> str:
    items = sorted(keys)
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_layout(state: Mapping[str, Tensor], source: str = "input") -> str:
    """Detect the official key layout; only ``"legacy"`` is accepted.

    Raises:
        ValueError: the current public layout, or keys of another architecture (missing and
            extra keys listed).
    """
    if "space_bag.linear.weight" not in state and "blocks.0.space_mixing.ff_out.weight" in state:
        raise ValueError(
            f"{source} uses the layout of the current public PolymathicAI/walrus code (field "
            "projection inside embed.*.proj1, ff_out without index, no space_bag/encoder_dummy). "
            "Only the legacy official layout (space_bag, encoder_dummy, "
            "patch_jitterer.padding_tokens, ff_out.1), whose numerics are verified against the "
            "reference fixture, can be converted"
        )
    blocks = [str(i) for i in range(len(_present(state, r"blocks\.(\d+)\.")))]
    embeds = _present(state, r"embed\.(\d)\.") or ["2", "3"]
    debeds = _present(state, r"debed\.(\d)\.") or embeds
    expected = _expected_keys(blocks or ["0"], embeds, debeds)
    missing, extra = expected - set(state), set(state) - expected
    if missing or extra:
        lines = [f"{source} is not a legacy official Walrus state dict:"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {_list(missing)}")
        if extra:
            lines.append(f"  extra keys ({len(extra)}): {_list(extra)}")
        raise ValueError("\n".join(lines))
    if embeds != debeds:
        raise ValueError(f"{source}: encoder sets {embeds} and decoder sets {debeds} differ")
    return "legacy"


def _shape(state: Mapping[str, Tensor], key: str) -> tuple[int, ...]:
    return tuple(state[key].shape)


def infer_config(
    state: Mapping[str, Tensor], official: Mapping[str, Any], source: str = "input"
) -> dict[str, Any]:
    """Our model config from the official tensor shapes, checked against the official config.

    Heads come from the q-norm width (head dim) and the time bias table; ``official`` (its
    ``hidden_dim``, ``num_heads``, ``processor_blocks``, ``n_states``...) must agree with them.
    Run-time settings (``causal_in_time``, ``jitter_patches``, ``drop_path``, ``groups``) are
    read from it, with the published model's values as defaults.

    Raises:
        ValueError: inconsistent shapes, or a config that disagrees with them.
    """
    d0 = _present(state, r"embed\.(\d)\.")[0]
    proj, n_states = _shape(state, "space_bag.linear.weight")
    inter, p1, k1 = _shape(state, f"embed.{d0}.proj1.weight")[:3]
    dim, i2, k2 = _shape(state, f"embed.{d0}.proj2.weight")[:3]
    head_dim = _shape(state, "blocks.0.time_mixing.qnorm.weight")[0]
    buckets, heads = _shape(
        state, "blocks.0.time_mixing.rel_pos_bias.relative_attention_bias.weight"
    )
    mlp_dim = _shape(state, "blocks.0.space_mixing.fused_ff_qkv.weight")[0] - 3 * dim
    depth = len(_present(state, r"blocks\.(\d+)\."))
    if p1 != proj or i2 != inter or heads * head_dim != dim or mlp_dim < 2:
        raise ValueError(
            f"{source}: inconsistent official shapes (projection {proj} vs {p1}, intermediate "
            f"{inter} vs {i2}, heads {heads} x head dim {head_dim} vs hidden {dim}, mlp {mlp_dim})"
        )
    processor = official.get("processor") or {}
    space = processor.get("space_mixing") or {}
    given = {
        "hidden_dim": (official.get("hidden_dim"), dim),
        "num_heads": (official.get("num_heads", space.get("num_heads")), heads),
        "processor_blocks": (official.get("processor_blocks"), depth),
        "projection_dim": (official.get("projection_dim"), proj),
        "intermediate_dim": (official.get("intermediate_dim"), inter),
        "n_states": (official.get("n_states"), n_states),
    }
    bad = [f"{k}={v!r} (weights: {w})" for k, (v, w) in given.items() if v is not None and v != w]
    if bad:
        raise ValueError(
            f"official config disagrees with the weights in {source}: {', '.join(bad)}"
        )
    freqs = state["blocks.0.space_mixing.rotary_emb.freqs"].float()
    max_freq = 2 * float(freqs[-1]) / math.pi if freqs.numel() > 1 else 256.0
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
        "rope_max_freq": round(max_freq, 6),
        "rel_pos_buckets": buckets,
        "rel_pos_max_distance": 32,  # the official call never passes its 128
        "compat": COMPAT,
    }


# ---------------------------------------------------------------------- mapping


def _map_tensors(
    state: dict[str, Tensor], cfg: Mapping[str, Any], source: str
) -> dict[str, Tensor]:
    """Pop official tensors one by one into our names (no second full copy is kept)."""
    dim, heads = cfg["dim"], cfg["heads"]
    hd = dim // heads
    out: dict[str, Tensor] = {}
    dummy = state.pop("encoder_dummy")
    w = state.pop("space_bag.linear.weight")
    out["space_bag.linear.weight"] = w * dummy.to(w.dtype)  # x * d then W -> (W d) x
    freqs = None
    for key in sorted(state):
        t = state.pop(key)
        if key.endswith("rotary_emb.freqs"):
            if freqs is None:
                freqs = t
            elif not torch.equal(freqs, t):
                raise ValueError(f"{source}: {key} differs from block 0's rotary frequencies")
            continue
        if key.endswith("time_mixing.input_head.weight"):  # rows (he, j, e) -> (j, he, e)
            t = t.reshape(heads, 3, hd, dim).transpose(0, 1).reshape(3 * dim, dim)
        elif key.endswith("time_mixing.input_head.bias"):
            t = t.reshape(heads, 3, hd).transpose(0, 1).reshape(3 * dim)
        elif key.endswith("time_mixing.output_head.weight"):
            t = t.reshape(dim, dim)
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


def convert_state_dict(
    state: dict[str, Tensor],
    *,
    fields: Sequence[str] | str | os.PathLike | None = None,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    source: str = "input",
) -> Converted:
    """Convert an official (legacy layout) state dict; ``state`` is emptied as it goes.

    Args:
        state: flat official ``name -> tensor`` dict (see :func:`unwrap_state_dict`).
        fields: official field names (list, or YAML file); placeholders if ``None``.
        config: official config (dict or YAML file) to check against and read settings from.
        source: name used in error messages.

    Raises:
        FileNotFoundError, ValueError: bad input, before anything is written.
    """
    layout = check_layout(state, source)
    n_tensors = len(state)
    cfg = infer_config(state, read_config(config), source)
    names = read_fields(fields, cfg["n_fields"])
    out = _map_tensors(state, cfg, source)
    n_params = _check_shapes(out, cfg, source)
    report = ConversionReport(
        layout=layout,
        n_tensors=n_tensors,
        n_params=n_params,
        official_only=dict(FOLDED),
        ours_only=dict(OURS_ONLY),
        notes=[f"heads {cfg['heads']} inferred from the head dim and the time bias table"],
    )
    if fields is None:
        report.notes.append(
            "no field names given: placeholders official_field_<i> used; pass --fields to name "
            "the official embedding indices"
        )
    return Converted(out, cfg, FieldVocabulary(names), report)


def load_official(
    path_or_state_dict: str | os.PathLike | Mapping[str, Any],
    *,
    fields: Sequence[str] | str | os.PathLike | None = None,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    trust_pickle: bool = False,
) -> tuple[Walrus, FieldVocabulary]:
    """Official Walrus weights as our model, in eval mode, with ``compat="walrus_official"``.

    The model is built on the meta device and takes the converted tensors directly (no second
    copy; a memory-mapped file stays mapped, and parameters may share memory with the tensors
    of a given state dict). The conversion report is logged at INFO and kept
    as ``model.conversion_report``.

    Args:
        path_or_state_dict: an official ``.pt`` file, or an already loaded checkpoint object
            (bare state dict or a ``model_state_dict`` / ``state_dict`` / ``app.model`` wrapper,
            optionally with a ``module.`` prefix). A given dict is not modified.
        fields: official field names, one per embedding index (list or YAML file).
        config: official config (dict or YAML file).
        trust_pickle: allow unpickling arbitrary objects from the file (warns).

    Returns:
        ``(model, vocab)``, like :func:`walrus.training.checkpoint.load_model`.

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
        raise RuntimeError(f"load_official: tensors left unset after loading: {left}")
    model.conversion_report = conv.report
    log.info("converted official Walrus weights from %s\n%s", source, conv.report)
    return model.eval(), conv.vocab


def convert_file(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    fields: Sequence[str] | str | os.PathLike | None = None,
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
