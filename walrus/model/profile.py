"""Numerics profiles: the layout and numerical choices a Walrus model is built with.

A profile is one immutable object chosen when the model is constructed (by the ``compat``
option's name, see :func:`get_profile`) and passed down as plain constructor arguments: no
module tests a compat name or is altered after construction. Three profiles exist:

- :data:`NATIVE` (``compat=None``): this project's numerics.
- :data:`WALRUS_OFFICIAL` (``compat="walrus_official"``): the legacy official Walrus layout
  (separate field embedding with a rescaled bias, learned pad tokens, symmetric padding).
- :data:`WALRUS_CURRENT` (``compat="walrus_current"``): the current (released) official layout
  (raw fields plus three boundary flag channels projected by the encoder, no pad tokens, no
  layer scale, decoder wrapping periodic axes, jitter over half a periodic axis).

Both official profiles share the official stride table, per-channel norms with eps
``finfo(float32).eps``, mean-reduced decoder kernels and an encoder set chosen by the number of
axes longer than one point. A new official variant is one more :class:`NumericsProfile`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from walrus.model.encoder import choose_strides, official_strides
from walrus.model.jitter import (
    AxisPlan,
    JitterDraws,
    plan_axis,
    plan_axis_symmetric,
    shift_within_half_patch,
    shift_within_padding,
)

PlanFn = Callable[[int, tuple[int, int], tuple[int, int], tuple[int, int], bool, int], AxisPlan]
ShiftFn = Callable[[JitterDraws, AxisPlan, int, tuple[int, int]], int]


def _table_strides(
    sizes: Sequence[int], target: int, options: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Official stride table; the model's stride options play no part."""
    return official_strides(sizes, target)


@dataclass(frozen=True)
class NumericsProfile:
    """Layout and numerics of one model family.

    Attributes:
        name: the ``compat`` name selecting it (``None`` for this project's numerics).
        field_projection: ``"embedding"``: a :class:`~walrus.model.field_embedding.FieldEmbedding`
            then learned boundary padding (:class:`~walrus.model.jitter.PatchJitterer`);
            ``"flag_channels"``: raw fields plus three boundary flag channels, projected by the
            encoder's first conv (:class:`~walrus.model.encoder.FieldEncoder`).
        embedding_scales_bias: the field embedding's ``sqrt(n_fields / C)`` rescale covers its
            bias too.
        layer_scale: residual branches have a learned layer scale.
        plan_axis: padding plan of one strided axis (:func:`~walrus.model.jitter.plan_axis`).
        jitter_shift: draws one axis' random patch-grid shift.
        pick_strides: ``(sizes, target, stride_options) -> strides`` for stride modulation.
        encoder_by_active_axes: the encoder/decoder set is chosen by the number of axes longer
            than one point (otherwise by the number of spatial axes).
        norm_per_channel: RMS norms use one group per channel (the ``groups`` option is unused).
        norm_eps: eps of every RMS group norm.
        decoder_reduce: how decoder kernels collapse over inactive axes (``"sum"`` / ``"mean"``).
        decoder_periodic_wrap: the decoder's transposed convs wrap periodic axes.
    """

    name: str | None
    field_projection: Literal["embedding", "flag_channels"]
    embedding_scales_bias: bool
    layer_scale: bool
    plan_axis: PlanFn
    jitter_shift: ShiftFn
    pick_strides: Callable[[Sequence[int], int, Sequence[tuple[int, int]]], list[tuple[int, int]]]
    encoder_by_active_axes: bool
    norm_per_channel: bool
    norm_eps: float
    decoder_reduce: Literal["sum", "mean"]
    decoder_periodic_wrap: bool

    def norm_groups(self, groups: int) -> int | None:
        """Groups to build the RMS norms with (``None``: one per channel)."""
        return None if self.norm_per_channel else groups


NATIVE = NumericsProfile(
    name=None,
    field_projection="embedding",
    embedding_scales_bias=False,
    layer_scale=True,
    plan_axis=plan_axis,
    jitter_shift=shift_within_half_patch,
    pick_strides=choose_strides,
    encoder_by_active_axes=False,
    norm_per_channel=False,
    norm_eps=1e-6,
    decoder_reduce="sum",
    decoder_periodic_wrap=False,
)

_OFFICIAL_EPS = torch.finfo(torch.float32).eps

WALRUS_OFFICIAL = NumericsProfile(
    name="walrus_official",
    field_projection="embedding",
    embedding_scales_bias=True,
    layer_scale=True,
    plan_axis=plan_axis_symmetric,
    jitter_shift=shift_within_half_patch,
    pick_strides=_table_strides,
    encoder_by_active_axes=True,
    norm_per_channel=True,
    norm_eps=_OFFICIAL_EPS,
    decoder_reduce="mean",
    decoder_periodic_wrap=False,
)

WALRUS_CURRENT = NumericsProfile(
    name="walrus_current",
    field_projection="flag_channels",
    embedding_scales_bias=False,
    layer_scale=False,
    plan_axis=plan_axis,
    jitter_shift=shift_within_padding,
    pick_strides=_table_strides,
    encoder_by_active_axes=True,
    norm_per_channel=True,
    norm_eps=_OFFICIAL_EPS,
    decoder_reduce="mean",
    decoder_periodic_wrap=True,
)

# The ``compat`` option's names (configs and checkpoints store the name, never the object).
PROFILES: dict[str | None, NumericsProfile] = {
    p.name: p for p in (NATIVE, WALRUS_OFFICIAL, WALRUS_CURRENT)
}
COMPAT_NAMES: tuple[str, ...] = tuple(n for n in PROFILES if n is not None)


def get_profile(name: str | None) -> NumericsProfile:
    """The profile a ``compat`` name selects.

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(name, str | None) and name in PROFILES:
        return PROFILES[name]
    raise ValueError(f"compat={name!r} is not known; expected None or one of {COMPAT_NAMES}")
