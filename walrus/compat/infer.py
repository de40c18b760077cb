"""Our model config inferred from official tensor shapes, checked against an official config."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from walrus.compat.keymap import COMPAT, present
from walrus.compat.released import FLAG_FIELDS, RELEASED_MODEL
from walrus.model.config import MODEL_TARGET


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
    depth = len(present(state, r"blocks\.(\d+)\."))
    return head_dim, heads, buckets, mlp_dim, depth


def _official_heads(official: Mapping[str, Any]) -> Any:
    """``num_heads`` of an official config, top level or under ``processor.space_mixing``."""
    processor = official.get("processor") or {}
    if not isinstance(processor, Mapping):
        raise ValueError(f"official config processor={processor!r} must be a mapping")
    space = processor.get("space_mixing") or {}
    if not isinstance(space, Mapping):
        raise ValueError(f"official config processor.space_mixing={space!r} must be a mapping")
    return official.get("num_heads", space.get("num_heads"))


def _flag(settings: Mapping[str, Any], key: str, default: bool) -> bool:
    """A true/false setting of an official config (``default`` when unset)."""
    value = settings.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"official config {key}={value!r} must be true or false")
    return value


def _drop_path(settings: Mapping[str, Any], default: float) -> float:
    drop = settings.get("drop_path", default)
    if isinstance(drop, bool) or not isinstance(drop, int | float) or not 0 <= drop < 1:
        raise ValueError(f"official config drop_path={drop!r} must be a number in [0, 1)")
    return float(drop)


def _groups(settings: Mapping[str, Any], dim: int, inter: int) -> int:
    """Norm groups: the config's when they divide both widths, else the largest of at most 16
    that does (no numerical effect: the official norms are per channel)."""
    groups = settings.get("groups")
    if groups is not None and (
        isinstance(groups, bool) or not isinstance(groups, int) or groups < 1
    ):
        raise ValueError(f"official config groups={groups!r} must be an integer >= 1")
    if groups is None or dim % groups or inter % groups:
        groups = math.gcd(math.gcd(dim, inter), 16)
    return groups


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
    d0 = present(state, r"embed\.(\d)\.")[0]
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
    groups = _groups(official, dim, inter)
    include_d = [int(d) for d in present(state, r"embed\.(\d)\.")]
    return {
        "_target_": MODEL_TARGET,
        "n_fields": n_states,
        "dim": dim,
        "depth": depth,
        "heads": heads,
        "projection_dim": proj,
        "intermediate_dim": inter,
        "mlp_ratio": mlp_dim / dim,
        "causal": _flag(official, "causal_in_time", True),
        "groups": groups,
        "kernel_sizes": [k1, k2],
        "target_latent": [32, 32, 16],
        "include_d": include_d,
        "jitter": _flag(official, "jitter_patches", True),
        "drop_path": _drop_path(official, 0.0),
        "rope_max_freq": _rope_max_freq(state),
        "rel_pos_buckets": buckets,
        "rel_pos_max_distance": 32,  # the official call never passes its 128
        "compat": COMPAT["legacy"],
    }


def _infer_current_config(
    state: Mapping[str, Tensor], official: Mapping[str, Any], source: str
) -> dict[str, Any]:
    """:func:`infer_config` for the current layout; unset settings are the released model's."""
    d0 = present(state, r"embed\.(\d)\.")[0]
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
        _flag(settings, key, True)
    drop = _drop_path(settings, 0.0)
    groups = _groups(settings, dim, inter)
    jitter = settings["jitter_patches"]
    return {
        "_target_": MODEL_TARGET,
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
        "include_d": [int(d) for d in present(state, r"embed\.(\d)\.")],
        "jitter": jitter,
        "latent_roll": jitter,  # the official model rolls the latent whenever it jitters
        "drop_path": drop,
        "rope_max_freq": _rope_max_freq(state),
        "rel_pos_buckets": buckets,
        "rel_pos_max_distance": 32,  # the official call never passes its 128
        "compat": COMPAT["current"],
        "flag_fields": list(FLAG_FIELDS),
    }


def check_reserved(raw: Mapping[str, Any], source: str) -> None:
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


def n_steps_input(raw: Mapping[str, Any]) -> int | None:
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


def is_released(cfg: Mapping[str, Any]) -> bool:
    """Whether a current-layout config has the released model's shapes."""
    shapes = {
        "dim": "hidden_dim",
        "depth": "processor_blocks",
        "heads": "num_heads",
        "intermediate_dim": "intermediate_dim",
        "n_fields": "n_states",
    }
    return all(cfg[ours] == RELEASED_MODEL[theirs] for ours, theirs in shapes.items())
