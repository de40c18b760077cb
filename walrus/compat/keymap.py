"""Official Walrus key layouts: detecting which one a state dict uses, and mapping its keys.

Two layouts exist:

- **legacy** (numerics profile ``WALRUS_OFFICIAL``): separate ``space_bag`` field projection,
  ``encoder_dummy``, ``patch_jitterer.padding_tokens``, ``gamma``/``gamma_att`` layer scales,
  ``ff_out.1``. Pinned down numerically by the ``walrus_reference_tiny`` fixture.
- **current** (numerics profile ``WALRUS_CURRENT``): the layout of the released ``walrus.pt``
  and of the current public PolymathicAI/walrus code. The field projection is
  ``embed.*.proj1`` (one input column per vocabulary field, plus the reserved ids of three
  boundary flag channels), no pad tokens, no layer scales, ``ff_out`` without index. Pinned
  down by the ``walrus_current_tiny2d`` fixture.

- ``blocks.i.time_mixing.input_head`` is a 1x1x1 conv with rows ordered (head, q/k/v, E); ours
  is a Linear with rows ordered (q/k/v, head, E): the rows are permuted.
- ``blocks.i.time_mixing.output_head`` (1x1x1 conv) -> Linear: reshaped.
- ``blocks.i.space_mixing.rotary_emb.freqs`` (equal in every block) -> ``rope.freqs``.
- legacy: ``encoder_dummy`` (a learned input scale) is folded into ``space_bag.linear.weight``.
- current: ``blocks.i.space_mixing.ff_out.*`` -> ``ff_out.1.*``; ``encoder_dummy`` is kept.
- Every other key keeps its name and shape.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from walrus.model.profile import WALRUS_CURRENT, WALRUS_OFFICIAL

LAYOUTS = ("legacy", "current")
# The numerics profile (its ``compat`` name) each layout converts to.
COMPAT = {"legacy": WALRUS_OFFICIAL.name, "current": WALRUS_CURRENT.name}
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


def present(state: Mapping[str, Tensor], pattern: str) -> list[str]:
    """The distinct first groups of ``pattern`` over the keys, sorted as ints."""
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


def key_list(keys: set[str], limit: int = 12) -> str:
    items = sorted(keys, key=lambda k: (k.startswith("blocks."), k))  # per-block keys last
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_layout(state: Mapping[str, Tensor], source: str = "input") -> str:
    """Detect the official key layout: ``"legacy"`` or ``"current"``.

    Raises:
        ValueError: keys of neither layout (the missing and unexpected keys of the closer one
            are listed, on one line).
    """
    blocks = [str(i) for i in range(len(present(state, r"blocks\.(\d+)\.")))] or ["0"]
    embeds = present(state, r"embed\.(\d)\.") or ["2", "3"]
    debeds = present(state, r"debed\.(\d)\.") or embeds
    diffs = {}
    for layout in LAYOUTS:
        expected = _expected_keys(layout, blocks, embeds, debeds)
        diffs[layout] = (expected - set(state), set(state) - expected)
    layout = min(LAYOUTS, key=lambda k: len(diffs[k][0]) + len(diffs[k][1]))
    missing, extra = diffs[layout]
    if missing or extra:
        parts = [f"{source} is not an official Walrus state dict (closest: the {layout} layout)"]
        if missing:
            parts.append(f"missing keys ({len(missing)}): {key_list(missing)}")
        if extra:
            parts.append(f"unexpected keys ({len(extra)}): {key_list(extra)}")
        raise ValueError("; ".join(parts))
    if embeds != debeds:
        raise ValueError(f"{source}: encoder sets {embeds} and decoder sets {debeds} differ")
    return layout


def map_tensors(
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
