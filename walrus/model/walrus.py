"""The Walrus-style space-time model.

Data flow: field embedding -> patch jitter (learned boundary padding + random shift) -> hMLP
encoder -> ``depth`` x (temporal attention, spatial attention) -> hMLP decoder -> unjitter.

Notation: B batch, T frames, C fields, P projection dim, D model dim, S latent tokens.

Jitter policy: jitter is *active* only when ``jitter=True`` and either the model is in
training mode or a ``jitter_seed`` / ``generator`` is passed to ``forward``; otherwise nothing is
drawn and evaluation is deterministic. Active jitter shifts the patch grid and, with
``latent_roll=True``, rolls the latent token grid along periodic axes by a random amount before
every processor block (cumulated, rolled back after the last block). The padding layout depends
only on the configuration, so the latent grid is the same in training and evaluation. Draws
come from a CPU generator (Python ints, no device sync), in a fixed order: one patch shift per
strided axis, then one roll per periodic axis per block.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import Tensor, nn

from walrus.bcs import BoundaryType
from walrus.model.blocks import (
    InferenceWorkspace,
    ProcessorBlock,
    SpatialAttention,
    TemporalAttention,
    compute_dtype,
)
from walrus.model.encoder import (
    Decoder,
    Encoder,
    FieldEncoder,
    choose_strides,
    official_strides,
)
from walrus.model.field_embedding import FieldEmbedding
from walrus.model.jitter import (
    AxisPlan,
    JitterDraws,
    PatchJitterer,
    RecordedDraws,
    flag_jitter,
    plan_axis,
)
from walrus.nn import attention as attention_module
from walrus.nn.norms import RMSGroupNorm
from walrus.nn.rope import AxialRoPE

DEFAULT_STRIDE_OPTIONS = ((2, 2), (4, 2), (4, 4), (8, 4))
COMPAT_MODES = ("walrus_official", "walrus_current")


def _pairs(value: Sequence, name: str) -> tuple[tuple[int, int], ...]:
    pairs = tuple(tuple(int(v) for v in p) for p in value)
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise ValueError(f"{name} must be a list of (s1, s2) pairs of positive ints, got {value!r}")
    return pairs


class Walrus(nn.Module):
    """Walrus-style space-time transformer over a field vocabulary.

    Args:
        n_fields: vocabulary size (fields the model knows).
        dim: processor width D.
        depth: number of processor blocks.
        heads: attention heads (must divide ``dim``).
        projection_dim: field embedding width P.
        intermediate_dim: width between the two encoder/decoder convs (default ``dim // 4``).
        mlp_ratio: feed-forward width before the SwiGLU gate, as a multiple of ``dim``.
        causal: causal time attention; the output then has one prediction per input frame.
            Otherwise only the last frame's prediction is returned.
        n_spatial_max: most spatial axes accepted (at most 3).
        groups: RMS group norm groups (must divide ``dim``, ``intermediate_dim``).
        kernel_sizes: ``(k1, k2)`` kernels of the two encoder convs.
        stride_options: candidate ``(s1, s2)`` strides for stride modulation.
        target_latent: wanted latent tokens per axis for data with 1, 2 and 3 non-trivial axes.
        strides: explicit strides instead of stride modulation: one ``(s1, s2)`` pair for every
            axis, or one pair per spatial axis.
        include_d: data dimensionalities that get their own encoder/decoder; data of dimension
            d uses the smallest included value >= d.
        jitter: enable patch jittering (see the module docstring for when it is applied).
        latent_roll: with active jitter, roll the latent grid along periodic axes before every
            block (as the official Walrus does, also at inference).
        drop_path: largest drop path probability (linear over depth).
        input_drop: dropout on the embedded fields (on the raw fields with
            ``compat="walrus_current"``).
        layer_scale_init: initial layer scale of every residual branch.
        temporal_kernel: attention kernel of the temporal blocks.
        spatial_kernel: attention kernel of the spatial blocks.
        grad_checkpointing: checkpoint every processor block.
        rope_max_freq: largest axial RoPE frequency.
        rel_pos_buckets: T5 buckets of the temporal bias.
        rel_pos_max_distance: T5 max distance of the temporal bias.
        compat: ``"walrus_official"`` reproduces the legacy official Walrus layout and numerics
            for converted weights (see ``walrus.compat``): per-channel norms with eps
            ``finfo(float32).eps``, rescaled field-embedding bias, symmetric official padding,
            official stride table, mean-reduced decoder kernels, encoder set chosen by the number
            of axes longer than 1. ``"walrus_current"`` reproduces the current (released)
            official layout: no field embedding (``FieldEncoder`` projects raw fields plus three
            boundary flag channels, after a learned input scale ``encoder_dummy``), no learned
            pad tokens, no layer scale, the same per-channel norms, stride table, encoder-set
            choice and mean-reduced decoder kernels, a decoder that wraps periodic axes, and
            the official jitter range (periodic axes shift by up to half their length). ``projection_dim`` and
            ``layer_scale_init`` are unused then. ``None`` (default): this project's numerics.
        flag_fields: with ``compat="walrus_current"``, the vocabulary ids of the three appended
            channels (ones, wall flag, open flag); the batch's fields may not use them.
        fused: processor blocks run their fused forward (same results in fewer passes); the
            plain forward is the reference. Switch later with :meth:`set_fused`.

    Raises:
        ValueError: an inconsistent configuration.
    """

    def __init__(
        self,
        n_fields: int,
        dim: int,
        depth: int,
        heads: int,
        *,
        projection_dim: int = 48,
        intermediate_dim: int | None = None,
        mlp_ratio: float = 4.0,
        causal: bool = True,
        n_spatial_max: int = 3,
        groups: int = 16,
        kernel_sizes: Sequence[int] = (8, 4),
        stride_options: Sequence[Sequence[int]] = DEFAULT_STRIDE_OPTIONS,
        target_latent: Sequence[int] = (32, 32, 16),
        strides: Sequence[Sequence[int]] | Sequence[int] | None = None,
        include_d: Sequence[int] = (1, 2, 3),
        jitter: bool = True,
        latent_roll: bool = False,
        drop_path: float = 0.0,
        input_drop: float = 0.0,
        layer_scale_init: float = 0.1,
        temporal_kernel: str = "sdpa",
        spatial_kernel: str = "sdpa",
        grad_checkpointing: bool = False,
        rope_max_freq: float = 256.0,
        rel_pos_buckets: int = 32,
        rel_pos_max_distance: int = 128,
        compat: str | None = None,
        flag_fields: Sequence[int] = (2, 0, 1),
        fused: bool = True,
    ):
        super().__init__()
        if compat is not None and compat not in COMPAT_MODES:
            raise ValueError(
                f"compat={compat!r} is not known; expected None or one of {COMPAT_MODES}"
            )
        intermediate_dim = dim // 4 if intermediate_dim is None else intermediate_dim
        mlp_dim = int(round(mlp_ratio * dim))
        self._check_config(
            n_fields,
            dim,
            depth,
            heads,
            intermediate_dim,
            projection_dim,
            groups,
            mlp_dim,
            n_spatial_max,
            drop_path,
            input_drop,
        )
        for name, kernel in (
            ("temporal_kernel", temporal_kernel),
            ("spatial_kernel", spatial_kernel),
        ):
            known = attention_module.KERNEL_NAMES
            if kernel not in known:
                raise ValueError(
                    f"{name}={kernel!r} is not an attention kernel; expected one of {sorted(known)}"
                )
        self.kernel_sizes = tuple(int(k) for k in kernel_sizes)
        self.stride_options = _pairs(stride_options, "stride_options")
        if strides is not None:
            strides = _pairs([strides] if isinstance(strides[0], int) else strides, "strides")
        self.strides = strides
        for s1, s2 in self.stride_options + (strides or ()):
            if s1 > self.kernel_sizes[0] or s2 > self.kernel_sizes[1]:
                raise ValueError(f"stride ({s1}, {s2}) exceeds kernel_sizes {self.kernel_sizes}")
        self.target_latent = tuple(int(t) for t in target_latent)
        if len(self.target_latent) != 3:
            raise ValueError(
                f"target_latent must give 3 values (1D, 2D, 3D), got {target_latent!r}"
            )
        self.include_d = tuple(sorted(int(d) for d in include_d))
        if not self.include_d or not set(self.include_d) <= {1, 2, 3}:
            raise ValueError(
                f"include_d must be a non-empty subset of (1, 2, 3), got {include_d!r}"
            )

        self.dim, self.depth, self.heads, self.causal = dim, depth, heads, causal
        self.projection_dim, self.intermediate_dim, self.mlp_dim = (
            projection_dim,
            intermediate_dim,
            mlp_dim,
        )
        self.n_spatial_max, self.jitter, self.groups = n_spatial_max, jitter, groups
        self.latent_roll = latent_roll
        current = compat == "walrus_current"
        self.flag_fields = tuple(int(i) for i in flag_fields)
        if current and (
            len(self.flag_fields) != 3
            or len(set(self.flag_fields)) != 3
            or not all(0 <= i < n_fields for i in self.flag_fields)
        ):
            raise ValueError(
                f"flag_fields must be 3 distinct vocabulary ids in [0, {n_fields}), "
                f"got {flag_fields!r}"
            )
        self.layer_scale_init = None if current else layer_scale_init
        self._draws: RecordedDraws | None = None

        self.input_drop = nn.Dropout(input_drop)
        if current:
            self.space_bag, self.patch_jitterer = None, None
            self.encoder_dummy = nn.Parameter(torch.ones(1))  # learned input scale
            self.embed = nn.ModuleDict(
                {
                    str(d): FieldEncoder(
                        n_fields, intermediate_dim, dim, self.kernel_sizes, groups, flag_fields
                    )
                    for d in self.include_d
                }
            )
        else:
            self.encoder_dummy = None
            self.space_bag = FieldEmbedding(n_fields, projection_dim)
            self.patch_jitterer = PatchJitterer(projection_dim)
            self.embed = nn.ModuleDict(
                {
                    str(d): Encoder(
                        projection_dim, intermediate_dim, dim, self.kernel_sizes, groups
                    )
                    for d in self.include_d
                }
            )
        rates = [drop_path * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.ModuleList(
            ProcessorBlock(
                TemporalAttention(
                    dim,
                    heads,
                    groups,
                    causal=causal,
                    kernel=temporal_kernel,
                    drop_path=r,
                    layer_scale_init=self.layer_scale_init,
                    rel_pos_buckets=rel_pos_buckets,
                    rel_pos_max_distance=rel_pos_max_distance,
                    fused=fused,
                ),
                SpatialAttention(
                    dim,
                    heads,
                    groups,
                    mlp_dim,
                    kernel=spatial_kernel,
                    drop_path=r,
                    layer_scale_init=self.layer_scale_init,
                    fused=fused,
                ),
                grad_checkpointing=grad_checkpointing,
            )
            for r in rates
        )
        self.debed = nn.ModuleDict(
            {
                str(d): Decoder(dim, intermediate_dim, n_fields, self.kernel_sizes, groups)
                for d in self.include_d
            }
        )
        self.rope = AxialRoPE(dim // heads, rope_max_freq)
        self.initialize_weights()
        self.compat = compat
        if compat == "walrus_official":
            self.space_bag.scale_bias = True
        if compat is not None:
            for m in self.modules():
                if isinstance(m, RMSGroupNorm):
                    m.use_official_statistics()
            for dec in self.debed.values():
                dec.kernel_reduce = "mean"
                dec.periodic_wrap = current

    @staticmethod
    def _check_config(
        n_fields,
        dim,
        depth,
        heads,
        inter,
        proj,
        groups,
        mlp_dim,
        n_spatial_max,
        drop_path,
        input_drop,
    ):
        for name, v in (
            ("n_fields", n_fields),
            ("dim", dim),
            ("depth", depth),
            ("heads", heads),
            ("intermediate_dim", inter),
            ("projection_dim", proj),
            ("groups", groups),
        ):
            if int(v) < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        head_dim = dim // heads
        if head_dim % 2 or head_dim < 8:
            raise ValueError(
                f"head_dim = dim / heads = {head_dim} must be even and >= 8 (axial RoPE)"
            )
        for name, v in (("dim", dim), ("intermediate_dim", inter)):
            if v % groups:
                raise ValueError(f"{name} {v} is not divisible by groups {groups}")
        if mlp_dim % 2:
            raise ValueError(f"mlp_ratio * dim = {mlp_dim} must be even (SwiGLU halves it)")
        if not 1 <= n_spatial_max <= 3:
            raise ValueError(f"n_spatial_max must be 1, 2 or 3, got {n_spatial_max}")
        if not 0.0 <= drop_path < 1.0 or not 0.0 <= input_drop < 1.0:
            raise ValueError(
                f"drop_path ({drop_path}) and input_drop ({input_drop}) must be in [0, 1)"
            )

    # ------------------------------------------------------------------ init and vocabulary

    @property
    def n_fields(self) -> int:
        """Vocabulary size."""
        if self.space_bag is None:
            return next(iter(self.embed.values())).proj1.in_channels
        return self.space_bag.n_fields

    def num_params(self) -> int:
        """Number of parameters."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """All initialisation in one place.

        Linear layers: truncated normal (std 0.02), zero bias; residual output projections
        (``output_head``, ``attn_out``, ``ff_out``) std ``0.02 / sqrt(2 * depth)`` so a deep stack
        starts near the identity; layer scales at ``layer_scale_init``. Field embedding: std
        ``1 / sqrt(n_fields)`` (unit-variance output with the ``sqrt(n_fields / C)`` rescale).
        Convs: std ``1 / sqrt(fan_in)``, except the decoder's field rows (std 0.02: predictions
        start near zero delta). Norms: ones (and zero LayerNorm bias). ``encoder_dummy``
        (current official layout): one.
        """
        small = 0.02 / math.sqrt(2 * self.depth)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02, a=-0.04, b=0.04)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, RMSGroupNorm | PatchJitterer) or hasattr(
                m, "relative_attention_bias"
            ):
                m.reset_parameters()
            elif isinstance(m, nn.Conv3d | nn.ConvTranspose3d):
                fan_in = m.weight[0].numel() if isinstance(m, nn.Conv3d) else m.weight[:, 0].numel()
                nn.init.normal_(m.weight, std=fan_in**-0.5)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if self.space_bag is not None:
            nn.init.normal_(self.space_bag.linear.weight, std=self.n_fields**-0.5)
        if self.encoder_dummy is not None:
            nn.init.ones_(self.encoder_dummy)
        for blk in self.blocks:
            tm, sm = blk.time_mixing, blk.space_mixing
            for lin in (tm.output_head, sm.attn_out, sm.ff_out[1]):
                nn.init.trunc_normal_(lin.weight, std=small, a=-2 * small, b=2 * small)
            for gamma in (tm.gamma, sm.gamma_att):
                if gamma is not None:
                    gamma.fill_(self.layer_scale_init)
        for dec in self.debed.values():
            nn.init.trunc_normal_(dec.proj2.weight, std=0.02, a=-0.04, b=0.04)

    @torch.no_grad()
    def resize_vocab(self, n_fields: int) -> None:
        """Grow the field vocabulary to ``n_fields`` keeping what the model knows.

        Old embedding columns are kept (rescaled by ``sqrt(old / new)`` so that, with the
        ``sqrt(n_fields / C)`` factor, outputs on old fields are unchanged); old decoder rows and
        biases are kept as they are. New columns and rows get the usual init. Parameters are
        replaced: rebuild the optimizer afterwards. With ``compat="walrus_current"`` the field
        columns of every encoder's first conv grow instead; old columns are rescaled by
        ``sqrt((old - 3) / (new - 3))`` except the wall and open flag columns, which the
        official rescale leaves out.

        Raises:
            ValueError: ``n_fields`` is smaller than the current vocabulary.
        """
        old = self.n_fields
        if n_fields < old:
            raise ValueError(f"resize_vocab: cannot shrink the vocabulary from {old} to {n_fields}")
        if n_fields == old:
            return
        if self.space_bag is None:
            self._resize_field_encoders(old, n_fields)
        else:
            lin = self.space_bag.linear
            w = lin.weight.new_empty(lin.out_features, n_fields).normal_(std=n_fields**-0.5)
            w[:, :old] = lin.weight * math.sqrt(old / n_fields)
            if self.space_bag.scale_bias:  # compat: the rescale covers the bias too
                lin.bias.mul_(math.sqrt(old / n_fields))
            lin.weight = nn.Parameter(w)
            lin.in_features = n_fields
        for dec in self.debed.values():
            p = dec.proj2
            w = p.weight.new_empty(p.weight.shape[0], n_fields, *p.weight.shape[2:])
            nn.init.trunc_normal_(w, std=0.02, a=-0.04, b=0.04)
            w[:, :old] = p.weight
            b = p.bias.new_zeros(n_fields)
            b[:old] = p.bias
            p.weight, p.bias = nn.Parameter(w), nn.Parameter(b)
            p.out_channels = n_fields

    def _resize_field_encoders(self, old: int, n_fields: int) -> None:
        """:meth:`resize_vocab` for the current official layout's :class:`FieldEncoder` s."""
        n_flags = len(self.flag_fields)
        keep = torch.full((old,), math.sqrt((old - n_flags) / (n_fields - n_flags)))
        keep[list(self.flag_fields[1:])] = 1.0  # wall and open columns are never rescaled
        for enc in self.embed.values():
            p = enc.proj1
            fan_in = n_fields * math.prod(p.weight.shape[2:])
            w = p.weight.new_empty(p.weight.shape[0], n_fields, *p.weight.shape[2:])
            nn.init.normal_(w, std=fan_in**-0.5)
            scale = keep.to(p.weight).view(1, old, *(1,) * (p.weight.ndim - 2))
            w[:, :old] = p.weight * scale
            p.weight = nn.Parameter(w)
            p.in_channels = n_fields

    @contextmanager
    def replay_jitter(self, draws: Sequence[int]) -> Iterator[RecordedDraws]:
        """Take jitter draws from ``draws`` (in order) inside the ``with`` block.

        Jitter must still be active (training, or a ``jitter_seed`` / ``generator`` given to
        ``forward``); its random integers are then these values instead of the generator's,
        in the model's draw order (see the module docstring). Used to replay the draws another
        implementation recorded.

        Raises:
            ValueError: a value outside the range drawn from, too few values, or values left
                over when the block ends.
        """
        recorded = RecordedDraws(draws)
        self._draws = recorded
        try:
            yield recorded
        finally:
            self._draws = None
        if recorded.used != len(recorded.values):
            raise ValueError(
                f"replay_jitter: {len(recorded.values) - recorded.used} of "
                f"{len(recorded.values)} recorded draws were not used"
            )

    def set_fused(self, enabled: bool = True) -> None:
        """Switch the processor blocks between their fused and plain forward passes."""
        for blk in self.blocks:
            blk.time_mixing.fused = blk.space_mixing.fused = bool(enabled)

    def set_grad_checkpointing(self, enabled: bool | Sequence[bool] = True) -> None:
        """Switch gradient checkpointing for all blocks, or per block with one flag each."""
        flags = (
            [bool(enabled)] * self.depth
            if isinstance(enabled, bool)
            else [bool(f) for f in enabled]
        )
        if len(flags) != self.depth:
            raise ValueError(
                f"set_grad_checkpointing: got {len(flags)} flags for {self.depth} blocks"
            )
        for blk, flag in zip(self.blocks, flags):
            blk.grad_checkpointing = flag

    # ------------------------------------------------------------------ input checks

    def _check_inputs(
        self, x: Tensor, fields: Tensor | Sequence[int], bcs: Tensor | Sequence
    ) -> tuple[Tensor, list]:
        if x.ndim < 4:
            raise ValueError(
                f"x must be (B, T, C, *spatial) with 1-3 spatial axes, got shape {tuple(x.shape)}"
            )
        n_sp = x.ndim - 3
        if n_sp > self.n_spatial_max:
            raise ValueError(
                f"x has {n_sp} spatial axes (shape {tuple(x.shape)}); this model takes at most {self.n_spatial_max}"
            )
        if not x.is_floating_point():
            raise ValueError(f"x must be a floating point tensor, got {x.dtype}")
        fields = torch.as_tensor(fields)
        if (
            fields.ndim != 1
            or fields.numel() != x.shape[2]
            or fields.dtype not in (torch.int64, torch.int32)
        ):
            raise ValueError(
                f"fields must be a 1-D integer tensor with one vocabulary id per channel ({x.shape[2]}), "
                f"got {fields.dtype} of shape {tuple(fields.shape)}"
            )
        if fields.device.type == "cpu" and fields.numel():
            lo, hi = int(fields.min()), int(fields.max())
            if lo < 0 or hi >= self.n_fields:
                raise ValueError(
                    f"fields holds id {lo if lo < 0 else hi}, outside the vocabulary [0, {self.n_fields}); "
                    "call resize_vocab to add fields"
                )
            flags = self.space_bag is None and sorted(set(fields.tolist()) & set(self.flag_fields))
            if flags:
                raise ValueError(
                    f"fields holds ids {flags}, reserved for the boundary flag channels "
                    f"(flag_fields={list(self.flag_fields)}); a field vocabulary for this model "
                    "must keep them for those channels (e.g. the released Walrus vocabulary)"
                )
        bc_list = bcs.tolist() if isinstance(bcs, Tensor) else [list(b) for b in bcs]
        if len(bc_list) != n_sp or any(len(b) != 2 for b in bc_list):
            raise ValueError(f"bcs must be ({n_sp}, 2) (lo, hi per spatial axis), got {bc_list!r}")
        codes = {int(t) for t in BoundaryType}
        for axis, (lo, hi) in enumerate(bc_list):
            if int(lo) not in codes or int(hi) not in codes:
                raise ValueError(
                    f"bcs axis {axis} = {(lo, hi)}: codes must be in {sorted(codes)} (BoundaryType)"
                )
            if (int(lo) == BoundaryType.PERIODIC) != (int(hi) == BoundaryType.PERIODIC):
                raise ValueError(
                    f"bcs axis {axis} = {(lo, hi)}: periodic must hold on both sides or neither"
                )
        device = next(iter(self.embed.values())).proj1.weight.device
        return fields.to(device=device, dtype=torch.long, non_blocking=True), [
            (int(a), int(b)) for a, b in bc_list
        ]

    def _pick_strides(self, sizes: list[int], n_sp: int) -> list[tuple[int, int]]:
        """Strides for the axes longer than one point."""
        active = [s for s in sizes if s > 1]
        if not active:
            raise ValueError(
                f"spatial grid {tuple(sizes[:n_sp])} is a single point, smaller than one patch"
            )
        if self.strides is None:
            target = self.target_latent[len(active) - 1]
            if self.compat is not None:
                return official_strides(active, target)
            return choose_strides(active, target, self.stride_options)
        if len(self.strides) == 1:
            per_axis = list(self.strides) * 3
        elif len(self.strides) >= n_sp:
            per_axis = list(self.strides)
        else:
            raise ValueError(f"strides gives {len(self.strides)} pairs for {n_sp} spatial axes")
        out = []
        for axis, n in enumerate(sizes):
            if n > 1:
                s1, s2 = per_axis[axis]
                if n < s1 * s2:
                    raise ValueError(
                        f"spatial axis {axis} has {n} points, smaller than one patch ({s1 * s2})"
                    )
                out.append((s1, s2))
        return out

    def _jitter_draws(
        self, seed: int | None, generator: torch.Generator | None
    ) -> JitterDraws | None:
        """Where this forward's jitter draws come from; ``None`` when jitter is not active."""
        if not self.jitter or not (self.training or seed is not None or generator is not None):
            return None
        if self._draws is not None:
            return self._draws
        if generator is None and seed is not None:
            generator = torch.Generator().manual_seed(int(seed))
        if generator is not None and generator.device.type != "cpu":
            raise ValueError(
                f"jitter generator must be a CPU torch.Generator, got one on {generator.device}"
            )
        return JitterDraws(generator)

    def _shift(self, draws: JitterDraws, plan: AxisPlan, size: int, stride: tuple[int, int]) -> int:
        """A random patch-grid shift for one strided axis.

        Ours: less than half a patch. Current official layout: less than half the axis on a
        periodic axis, less than its padding on the others (no draw for a patch of 1).
        """
        patch = stride[0] * stride[1]
        if self.compat == "walrus_current":
            if patch <= 1:
                return 0
            half = size // 2 if plan.periodic else plan.lo
            return draws.randint(-(half - 1), half)
        half = patch // 2
        return draws.randint(-(half - 1), half) if half > 1 else 0

    def _block_ropes(
        self,
        rope: tuple[Tensor, Tensor],
        grid: list[int],
        periodic: list[int],
        draws: JitterDraws | None,
    ) -> list[tuple[Tensor, Tensor]]:
        """RoPE tables for each block, with the latent rolls applied.

        Rolling the tokens by ``r`` before a block and back after it equals running the block
        with its RoPE tables rolled by ``-r``: everything else in a block acts per token or
        symmetrically over tokens. The rolls therefore cost no copy of the token stream, and
        the in-place inference path needs no change.

        Args:
            rope: ``(cos, sin)`` each ``(S, 1, E)`` over the ``grid`` (3 axes).
            periodic: grid axes that are periodic (and strided).
            draws: the jitter draws (``None``: no rolls).
        """
        if draws is None or not self.latent_roll or not periodic:
            return [rope] * self.depth
        total = [0, 0, 0]
        out = []
        for _ in range(self.depth):
            for ax in periodic:
                total[ax] += draws.randint(0, grid[ax])
            dims = [ax for ax in periodic if total[ax] % grid[ax]]
            shifts = [-total[ax] for ax in dims]
            out.append(
                tuple(t.view(*grid, *t.shape[1:]).roll(shifts, dims).view(t.shape) for t in rope)
                if dims
                else rope
            )
        return out

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        x: Tensor,
        fields: Tensor,
        bcs: Tensor,
        *,
        jitter_seed: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Predict normalised frame deltas.

        Args:
            x: ``(B, T, C, *spatial)`` with 1-3 spatial axes (normalised fields).
            fields: ``(C,)`` long vocabulary ids of the channels (keep it on the CPU to have the
                ids checked without a device sync).
            bcs: ``(n_spatial, 2)`` long :class:`~walrus.bcs.BoundaryType` codes (lo, hi) per axis,
                or a nested list. Best kept on the CPU (a device tensor costs one sync).
            jitter_seed: activate jitter (also in eval mode) and draw it from this seed.
            generator: activate jitter (also in eval mode) and draw it from this CPU generator.

        Returns:
            Causal: ``(B, T, C, *spatial)``, output ``t`` is the normalised delta from frame ``t``
            to frame ``t + 1``. Non-causal: ``(B, 1, C, *spatial)`` for the last frame.

        Raises:
            ValueError: malformed input, before any compute.
        """
        fields, bc_list = self._check_inputs(x, fields, bcs)
        b, t, c = x.shape[:3]
        n_sp = x.ndim - 3
        spatial = list(x.shape[3:])
        sizes = spatial + [1] * (3 - n_sp)
        active = [s > 1 for s in sizes]
        n_key = sum(active) if self.compat is not None else n_sp
        key = next((d for d in self.include_d if d >= n_key), None)
        if key is None:
            raise ValueError(f"no encoder for {n_sp}-D data: include_d is {self.include_d}")
        strides = self._pick_strides(sizes, n_sp)
        draws = self._jitter_draws(jitter_seed, generator)
        act_axes = [i for i in range(3) if active[i]]
        plans = [
            plan_axis(sizes[i], s, self.kernel_sizes, bc_list[i], self.jitter, 0, self.compat)
            for i, s in zip(act_axes, strides)
        ]
        if draws is not None:
            plans = [
                replace(p, shift=self._shift(draws, p, sizes[i], s))
                for i, p, s in zip(act_axes, plans, strides)
            ]

        x = x.reshape(b * t, c, *[sizes[i] for i in act_axes])  # (B*T, C, *sp)
        if self.space_bag is None:  # current official layout: raw fields + flag channels
            h = flag_jitter(self.input_drop(x * self.encoder_dummy), plans)  # (B*T, C+3, *pad)
            z = self.embed[str(key)](h, fields, active, strides)  # (B*T, D, *latent)
        else:
            h = self.space_bag(x, fields)  # (B*T, P, *sp)
            h = self.input_drop(self.patch_jitterer.jitter(h, plans))  # (B*T, P, *padded)
            z = self.embed[str(key)](h, active, strides)  # (B*T, D, *latent)
        latent = list(z.shape[2:])
        grid = [1, 1, 1]
        for i, n in zip(act_axes, latent):
            grid[i] = n
        s = math.prod(latent)
        z = z.movedim(1, -1).contiguous().view(b, t, s, self.dim)  # (B, T, S, D) contiguous
        rope = self.rope.tables(tuple(grid), z.device, z.dtype)
        periodic = [i for i, p in zip(act_axes, plans) if p.periodic]
        ropes = self._block_ropes(rope, grid, periodic, draws)
        if not torch.is_grad_enabled() and all(blk.inference_ready() for blk in self.blocks):
            ws = InferenceWorkspace(z, self.heads, self.mlp_dim, compute_dtype(z))
            for blk, r in zip(self.blocks, ropes):
                blk.forward_inference(ws, r)  # z updated in place
        else:
            for blk, r in zip(self.blocks, ropes):
                z = blk(z, r)  # (B, T, S, D)
        if not self.causal:
            z = z[:, -1:]  # (B, 1, S, D)
        t_out = z.shape[1]
        z = z.reshape(b * t_out, *latent, self.dim).movedim(-1, 1)  # (B*T', D, *latent)
        periodic_axes = [p.periodic for p in plans]
        y = self.debed[str(key)](z, fields, active, strides, periodic_axes)  # (B*T', C, *padded)
        y = PatchJitterer.unjitter(y, plans)  # (B*T', C, *sp)
        return y.reshape(b, t_out, c, *spatial)
