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

Latent noise (``noise_dim > 0``): Gaussian noise (one vector per sample, or per token with
``noise_scope="token"``), projected to ``D``, is added to every latent token before the processor under the same condition (training, or a seed / generator given),
so each seed gives one ensemble member; without a seed evaluation stays deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from walrus.bcs import BoundaryType
from walrus.model.blocks import ProcessorBlock, SpatialAttention, TemporalAttention
from walrus.model.config import WalrusConfig
from walrus.model.encoder import Decoder, Encoder, FieldEncoder, PatchDecoder, PatchEncoder
from walrus.model.fast_blocks import run_processor
from walrus.model.field_embedding import FieldEmbedding, SharedFieldEmbedding
from walrus.model.jitter import AxisPlan, JitterDraws, PatchJitterer, RecordedDraws, flag_jitter
from walrus.nn.norms import RMSGroupNorm
from walrus.nn.rope import AxialRoPE
from walrus.nn.spectral import spectral_filter


class Walrus(nn.Module):
    """Walrus-style space-time transformer over a field vocabulary.

    Built from a :class:`~walrus.model.config.WalrusConfig`: ``Walrus(config)``, or
    ``Walrus(n_fields, dim, depth, heads, **options)`` with that class's options as arguments
    (what a Hydra ``_target_: walrus.model.walrus.Walrus`` config does). The config's ``compat``
    name selects the numerics profile (:mod:`walrus.model.profile`), which decides the layout
    and numerics once, here; the validated config is kept as :attr:`config`.

    Raises:
        ValueError: an inconsistent configuration (naming the option).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()
        if len(args) == 1 and not kwargs and isinstance(args[0], WalrusConfig):
            cfg = args[0]
        else:
            cfg = WalrusConfig(*args, **kwargs)
        self.config = cfg
        self.profile = profile = cfg.profile
        dim, depth, heads, groups = cfg.dim, cfg.depth, cfg.heads, cfg.groups
        inter = cfg.intermediate_dim
        self.kernel_sizes, self.stride_options = cfg.kernel_sizes, cfg.stride_options
        self.strides, self.target_latent, self.include_d = (
            cfg.strides,
            cfg.target_latent,
            cfg.include_d,
        )
        self.dim, self.depth, self.heads, self.causal = dim, depth, heads, cfg.causal
        self.projection_dim, self.intermediate_dim, self.mlp_dim = (
            cfg.projection_dim,
            inter,
            cfg.mlp_dim,
        )
        self.n_spatial_max, self.jitter, self.groups = cfg.n_spatial_max, cfg.jitter, groups
        self.latent_roll, self.flag_fields = cfg.latent_roll, cfg.flag_fields
        self.patch = cfg.encoder == "patch"
        self.layer_scale_init = cfg.layer_scale_init if profile.layer_scale else None
        self._draws: RecordedDraws | None = None

        norm_groups, eps = profile.norm_groups(groups), profile.norm_eps
        self.input_drop = nn.Dropout(cfg.input_drop)
        if profile.field_projection == "flag_channels":
            self.space_bag, self.patch_jitterer = None, None
            self.encoder_dummy = nn.Parameter(torch.ones(1))  # learned input scale
        else:
            self.encoder_dummy = None
            self.space_bag = (
                SharedFieldEmbedding(cfg.n_fields, cfg.projection_dim)
                if self.shared_fields
                else FieldEmbedding(
                    cfg.n_fields, cfg.projection_dim, scale_bias=profile.embedding_scales_bias
                )
            )
            self.patch_jitterer = PatchJitterer(cfg.projection_dim)
        # one encoder/decoder set per included data dimensionality
        self.embed = nn.ModuleDict({str(d): self._new_encoder(d) for d in self.include_d})
        rates = [cfg.drop_path * i / max(depth - 1, 1) for i in range(depth)]
        self.fused = cfg.fused
        block_groups = norm_groups or dim
        self.blocks = nn.ModuleList(
            ProcessorBlock(
                TemporalAttention(
                    dim,
                    heads,
                    block_groups,
                    causal=cfg.causal,
                    kernel=cfg.temporal_kernel,
                    drop_path=r,
                    layer_scale_init=self.layer_scale_init,
                    norm_eps=eps,
                    rel_pos_buckets=cfg.rel_pos_buckets,
                    rel_pos_max_distance=cfg.rel_pos_max_distance,
                ),
                SpatialAttention(
                    dim,
                    heads,
                    block_groups,
                    self.mlp_dim,
                    kernel=cfg.spatial_kernel,
                    drop_path=r,
                    layer_scale_init=self.layer_scale_init,
                    norm_eps=eps,
                ),
                grad_checkpointing=cfg.grad_checkpointing,
            )
            for r in rates
        )
        self.debed = nn.ModuleDict({str(d): self._new_decoder(d) for d in self.include_d})
        self.noise_proj = nn.Linear(cfg.noise_dim, dim, bias=False) if cfg.noise_dim else None
        self.rope = AxialRoPE(dim // heads, cfg.rope_max_freq)
        self.initialize_weights()

    @property
    def compat(self) -> str | None:
        """Name of the numerics profile (the ``compat`` option)."""
        return self.profile.name

    # ------------------------------------------------------------------ init and vocabulary

    @property
    def n_fields(self) -> int:
        """Vocabulary size."""
        return self.config.n_fields

    @property
    def shared_fields(self) -> bool:
        """Whether fields enter through a shared lift and identity vectors
        (``field_embedding="shared"``) instead of per-field embedding columns (the decoder keeps
        one output row per field either way)."""
        return self.config.field_embedding == "shared"

    def num_params(self) -> int:
        """Number of parameters."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """All initialisation in one place.

        Linear layers: truncated normal (std 0.02), zero bias; residual output projections
        (``output_head``, ``attn_out``, ``ff_out``) std ``0.02 / sqrt(2 * depth)`` so a deep stack
        starts near the identity; layer scales at ``layer_scale_init``. Field embedding: std
        ``1 / sqrt(n_fields)`` (unit-variance output with the ``sqrt(n_fields / C)`` rescale);
        the shared one as :meth:`SharedFieldEmbedding.reset_parameters` says.
        Convs (and the patch form's weights): std ``1 / sqrt(fan_in)`` (a transposed conv's
        fan-in counts the inputs reaching one output), except the decoder's field rows (std
        0.02: predictions start near zero delta). Norms: ones (and zero LayerNorm bias). ``encoder_dummy``
        (current official layout): one.
        """
        small = 0.02 / math.sqrt(2 * self.depth)
        for m in self.modules():
            _init_leaf(m)
        if isinstance(self.space_bag, FieldEmbedding):
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

    def _new_encoder(self, n_dims: int) -> Encoder | PatchEncoder:
        """A fresh (uninitialised) encoder for ``n_dims``-D data."""
        cfg = self.config
        args = (cfg.intermediate_dim, cfg.dim, self.kernel_sizes)
        groups, eps = self.profile.norm_groups(cfg.groups), self.profile.norm_eps
        if self.patch:
            return PatchEncoder(cfg.projection_dim, *args, n_dims, cfg.groups, eps)
        if self.space_bag is None:
            return FieldEncoder(cfg.n_fields, *args, groups, eps, cfg.flag_fields)
        return Encoder(cfg.projection_dim, *args, groups, eps)

    def _new_decoder(self, n_dims: int) -> Decoder | PatchDecoder:
        """A fresh (uninitialised) decoder for ``n_dims``-D data."""
        cfg, profile = self.config, self.profile
        if self.patch:
            args = (cfg.dim, cfg.intermediate_dim, cfg.n_fields, self.kernel_sizes, n_dims)
            return PatchDecoder(
                *args,
                cfg.groups,
                profile.norm_eps,
                overlap=cfg.decoder_overlap,
                smoothing=cfg.decoder_smoothing,
            )
        return Decoder(
            cfg.dim,
            cfg.intermediate_dim,
            cfg.n_fields,
            self.kernel_sizes,
            profile.norm_groups(cfg.groups),
            profile.norm_eps,
            kernel_reduce=profile.decoder_reduce,
            periodic_wrap=profile.decoder_periodic_wrap,
        )

    def _unused_tie(self, key: int, plans: Sequence[AxisPlan]) -> Tensor | None:
        """Zero times the sum of the parameters this forward leaves unused.

        Added to the output in training, it gives those parameters a zero gradient (instead of
        none) on every step: the other encoder/decoder sets, and the learned padding tokens
        when every axis is periodic. DDP then needs no ``find_unused_parameters``. ``None``
        when nothing is unused.
        """
        unused = [p for d in self.include_d if d != key for p in self.embed[str(d)].parameters()]
        unused += [p for d in self.include_d if d != key for p in self.debed[str(d)].parameters()]
        if self.patch_jitterer is not None and all(p.periodic for p in plans):
            unused.append(self.patch_jitterer.padding_tokens)
        unused = [p for p in unused if p.requires_grad]
        if not unused:
            return None
        return torch.stack([p.sum().float() for p in unused]).sum() * 0.0  # ()

    def encoder_key(self, n_dims: int) -> int | None:
        """The included dimensionality whose encoder/decoder serve ``n_dims``-D data: the
        smallest one ``>= n_dims`` (``None``: no set can)."""
        return next((d for d in self.include_d if d >= n_dims), None)

    @torch.no_grad()
    def grow_dims(self, dims: Sequence[int]) -> list[int]:
        """Add fresh encoder/decoder sets so data of every dimensionality in ``dims`` is served.

        Only dimensionalities no existing set can serve (see :meth:`encoder_key`) get a new
        set (the usual init, on the model's device and dtype); ``include_d`` grows with them
        and the config records it. Parameters are added: rebuild the optimizer afterwards.

        Returns:
            The dimensionalities added (sorted; empty if none was needed).

        Raises:
            ValueError: a dimensionality outside 1-3 or above ``n_spatial_max``.
        """
        new = sorted({int(d) for d in dims if self.encoder_key(int(d)) is None})
        if any(not 1 <= d <= self.n_spatial_max for d in new):
            raise ValueError(
                f"grow_dims: data dimensionalities must be in 1..{self.n_spatial_max}, got "
                f"{sorted(set(dims))}"
            )
        if not new:
            return []
        ref = next(iter(self.embed.values())).proj1.weight
        for d in new:
            enc, dec = self._new_encoder(d), self._new_decoder(d)
            for m in [*enc.modules(), *dec.modules()]:
                _init_leaf(m)
            nn.init.trunc_normal_(dec.proj2.weight, std=0.02, a=-0.04, b=0.04)
            self.embed[str(d)] = enc.to(ref)
            self.debed[str(d)] = dec.to(ref)
        self.include_d = tuple(sorted({*self.include_d, *new}))
        self.config = self.config.replace(include_d=self.include_d)
        return new

    @torch.no_grad()
    def resize_vocab(self, n_fields: int) -> None:
        """Grow the field vocabulary to ``n_fields`` keeping what the model knows.

        Old embedding columns are kept (rescaled by ``sqrt(old / new)`` so that, with the
        ``sqrt(n_fields / C)`` factor, outputs on old fields are unchanged); old decoder rows and
        biases are kept as they are. New columns and rows get the usual init. Parameters are
        replaced: rebuild the optimizer afterwards. With the current official profile the field
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
        if self.shared_fields:
            self.space_bag.grow(n_fields)
        elif self.space_bag is None:
            self._resize_field_encoders(old, n_fields)
        else:
            lin = self.space_bag.linear
            w = lin.weight.new_empty(lin.out_features, n_fields).normal_(std=n_fields**-0.5)
            w[:, :old] = lin.weight * math.sqrt(old / n_fields)
            if self.space_bag.scale_bias:  # legacy official: the rescale covers the bias too
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
            sm = getattr(dec, "smoothing", None)
            if sm is not None:  # new fields start unsmoothed
                grown = sm.new_zeros(n_fields, *sm.shape[1:])
                grown[:old] = sm
                dec.smoothing = nn.Parameter(grown)
        self.config = self.config.replace(n_fields=n_fields)

    @torch.no_grad()
    def init_new_fields(
        self, new: Sequence[int], known: Sequence[int], spread: float = 1.0
    ) -> None:
        """Start the ``new`` vocabulary ids from the identity vectors of the ``known`` ones
        (``field_embedding="shared"``): their mean plus ``spread`` times their per-entry
        standard deviation times a standard normal draw (torch's global generator), so a
        fine-tune's new fields start inside the cloud of fields the checkpoint knows, read by
        its trained lift, and several new fields still start apart (at one point the encoder
        would see only their sum). ``spread=0``: exactly the mean. Their decoder rows keep the
        usual init (predictions start near a zero delta).

        Raises:
            ValueError: the model has per-field columns, ``known`` is empty, or an id is
                outside the vocabulary.
        """
        if not self.shared_fields:
            raise ValueError(
                "init_new_fields needs field_embedding='shared'; per-field columns keep their init"
            )
        ids = [int(i) for i in (*new, *known)]
        if any(not 0 <= i < self.n_fields for i in ids):
            raise ValueError(f"init_new_fields: ids must be in [0, {self.n_fields}), got {ids}")
        device = self.space_bag.identity.device
        new_ids = torch.tensor([int(i) for i in new], dtype=torch.long, device=device)  # (K,)
        known_ids = torch.tensor([int(i) for i in known], dtype=torch.long, device=device)  # (K',)
        self.space_bag.init_fields(new_ids, known_ids, spread)

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
        self.fused = bool(enabled)
        self.config = self.config.replace(fused=self.fused)

    def set_output_filter(self, cutoff: float, order: int | None = None) -> None:
        """Set the spectral filter on the predicted deltas (``output_filter``; 0: off). It has
        no weights, so any checkpoint can be rolled out with or without it."""
        order = self.config.output_filter_order if order is None else order
        self.config = self.config.replace(output_filter=cutoff, output_filter_order=order)

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
        # value checks read the ids on the host: eager only (a graph break under torch.compile)
        if fields.device.type == "cpu" and fields.numel() and not torch.compiler.is_compiling():
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
        bc_list = bcs.tolist() if isinstance(bcs, Tensor) else list(map(list, bcs))
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
        if self.patch:  # kernel = stride; a short axis is padded up to one patch
            return [self.kernel_sizes] * len(active)
        if self.strides is None:
            target = self.target_latent[len(active) - 1]
            return self.profile.pick_strides(active, target, self.stride_options)
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

    def _layout(
        self, sizes: list[int], n_sp: int, bc_list: list[tuple[int, int]]
    ) -> tuple[list[tuple[int, int]], list[AxisPlan]]:
        """Strides and unshifted padding plans of the axes longer than one point."""
        strides = self._pick_strides(sizes, n_sp)
        act_axes = [i for i in range(3) if sizes[i] > 1]
        plans = [
            self.profile.plan_axis(sizes[i], s, self.kernel_sizes, bc_list[i], self.jitter, 0)
            for i, s in zip(act_axes, strides)
        ]
        if self.patch:  # whole patches: an odd patch leaves one point over on jittered walls
            plans = [
                replace(p, hi=p.hi + (-(sizes[i] + p.lo + p.hi)) % (s[0] * s[1]))
                for i, p, s in zip(act_axes, plans, strides)
            ]
        return strides, plans

    def encoder_layout(
        self, spatial: Sequence[int], bcs: Tensor | Sequence
    ) -> tuple[list[int], list[tuple[int, int]], list[bool]]:
        """How data of this spatial shape is tiled: padded lengths, strides and periodicity of
        the axes longer than one point, as :meth:`forward` uses them (e.g. for FLOP counts).

        Args:
            spatial: the data's spatial shape (1-3 axes).
            bcs: ``(n_spatial, 2)`` boundary codes, as for :meth:`forward`.
        """
        n_sp = len(spatial)
        sizes = [int(v) for v in spatial] + [1] * (3 - n_sp)
        bc_list = bcs.tolist() if isinstance(bcs, Tensor) else list(map(list, bcs))
        strides, plans = self._layout(sizes, n_sp, [(int(a), int(b)) for a, b in bc_list])
        lengths = [n for n in sizes if n > 1]
        padded = [n + p.lo + p.hi for n, p in zip(lengths, plans)]
        return padded, strides, [p.periodic for p in plans]

    @property
    def noisy(self) -> bool:
        """Whether the model draws latent noise (``noise_dim > 0``)."""
        return self.noise_proj is not None

    def _latent_noise(
        self, z: Tensor, seed: int | None, generator: torch.Generator | None
    ) -> Tensor:
        """Standard normal ``(B, 1, 1, noise_dim)`` (``noise_scope="sample"``) or
        ``(B, T, S, noise_dim)`` (``"token"``) for the latent ``z`` ``(B, T, S, D)``: from
        ``seed`` (its own stream, apart from the jitter's), else ``generator``, else the global
        generator."""
        lead = z.shape[:-1] if self.config.noise_scope == "token" else (z.shape[0], 1, 1)
        shape = (*lead, self.noise_proj.in_features)
        if seed is not None:
            generator = torch.Generator().manual_seed(seed ^ NOISE_SEED_SALT)
        if generator is None:
            return torch.randn(shape, device=z.device, dtype=z.dtype)
        return torch.randn(shape, generator=generator).to(z)

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

    def embedding_folded(self) -> bool:
        """Whether a forward now folds the field embedding into the patch encoder's first GEMM
        (patch encoder with a field embedding, input dropout off or in eval mode)."""
        active_drop = self.training and self.input_drop.p > 0
        return self.patch and self.space_bag is not None and not active_drop

    def forward(
        self,
        x: Tensor,
        fields: Tensor,
        bcs: Tensor,
        *,
        jitter_seed: int | None = None,
        generator: torch.Generator | None = None,
        noise_seed: int | None = None,
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
            noise_seed: with ``noise_dim > 0``, draw the latent noise from this seed (also in
                eval mode) instead of from the jitter's seed or generator: calls that share it
                share their noise whatever their jitter (one ensemble member averaged over
                jitter draws).

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
        n_key = sum(active) if self.profile.encoder_by_active_axes else n_sp
        key = self.encoder_key(n_key)
        if key is None:
            raise ValueError(
                f"no encoder for {n_sp}-D data: include_d is {self.include_d} "
                "(grow_dims adds sets; fine-tuning on such data does it)"
            )
        strides, plans = self._layout(sizes, n_sp, bc_list)
        draws = self._jitter_draws(jitter_seed, generator)
        act_axes = [i for i in range(3) if active[i]]
        if draws is not None:
            plans = [
                replace(p, shift=self.profile.jitter_shift(draws, p, sizes[i], s))
                for i, p, s in zip(act_axes, plans, strides)
            ]

        x = x.reshape(b * t, c, *[sizes[i] for i in act_axes])  # (B*T, C, *sp)
        if self.space_bag is None:  # current official layout: raw fields + flag channels
            h = flag_jitter(self.input_drop(x * self.encoder_dummy), plans)  # (B*T, C+3, *pad)
            z = self.embed[str(key)](h, fields, active, strides)  # (B*T, D, *latent)
        elif self.embedding_folded():
            # Embedding, boundary tokens and the first patch GEMM are all linear: pad the raw
            # fields with flag channels and fold [weight | bias | wall | open] into the GEMM.
            w, bias = self.space_bag.weight_and_bias(fields)  # (P, C), (P,)
            tokens = self.patch_jitterer.padding_tokens.view(2, -1)  # (2, P): wall, open
            embed = torch.cat([w, bias[:, None], tokens.t()], dim=1)  # (P, C + 3)
            h = flag_jitter(x, plans)  # (B*T, C + 3, *padded)
            z = self.embed[str(key)](h, active, embed=embed)  # (B*T, D, *latent)
        else:
            h = self.space_bag(x, fields)  # (B*T, P, *sp)
            h = self.input_drop(self.patch_jitterer.jitter(h, plans))  # (B*T, P, *padded)
            enc = self.embed[str(key)]
            z = enc(h, active) if self.patch else enc(h, active, strides)  # (B*T, D, *latent)
        latent = list(z.shape[2:])
        grid = [1, 1, 1]
        for i, n in zip(act_axes, latent):
            grid[i] = n
        s = math.prod(latent)
        z = z.movedim(1, -1).contiguous().view(b, t, s, self.dim)  # (B, T, S, D) contiguous
        if self.noise_proj is not None and (
            self.training
            or jitter_seed is not None
            or generator is not None
            or noise_seed is not None
        ):
            seed = noise_seed if noise_seed is not None else jitter_seed
            z = z + self.noise_proj(self._latent_noise(z, seed, generator))
        rope = self.rope.tables(tuple(grid), z.device, z.dtype)
        periodic = [i for i, p in zip(act_axes, plans) if p.periodic]
        ropes = self._block_ropes(rope, grid, periodic, draws)
        z = run_processor(self.blocks, z, ropes, fused=self.fused)  # (B, T, S, D)
        if not self.causal:
            z = z[:, -1:]  # (B, 1, S, D)
        t_out = z.shape[1]
        z = z.reshape(b * t_out, *latent, self.dim).movedim(-1, 1)  # (B*T', D, *latent)
        periodic_axes = [p.periodic for p in plans]
        dec = self.debed[str(key)]
        if self.patch:
            wrap = [p.periodic and not (p.lo or p.hi) for p in plans]
            y = dec(z, fields, active, wrap)  # (B*T', C, *padded)
        else:
            y = dec(z, fields, active, strides, periodic_axes)  # (B*T', C, *padded)
        tie = self._unused_tie(key, plans) if self.training and torch.is_grad_enabled() else None
        if tie is not None:
            y = y + tie.to(y.dtype)
        y = PatchJitterer.unjitter(y, plans)  # (B*T', C, *sp)
        if self.config.output_filter:
            cut, order = self.config.output_filter, self.config.output_filter_order
            y = spectral_filter(y, cut, order, [p.periodic for p in plans])  # (B*T', C, *sp)
        return y.reshape(b, t_out, c, *spatial)


NOISE_SEED_SALT = 0x5EED_0F_2  # latent noise of jitter seed s is drawn from seed s ^ this


def _init_leaf(m: nn.Module) -> None:
    """The generic init of one module (see :meth:`Walrus.initialize_weights`)."""
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02, a=-0.04, b=0.04)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)
    elif isinstance(m, RMSGroupNorm | PatchJitterer | SharedFieldEmbedding) or hasattr(
        m, "relative_attention_bias"
    ):
        m.reset_parameters()
    elif isinstance(m, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        nn.init.normal_(m.weight, std=m.weight[0].numel() ** -0.5)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d):
        # inputs reaching one output: in channels times ceil(k / s) taps per axis
        taps = math.prod(-(-k // s) for k, s in zip(m.kernel_size, m.stride))
        nn.init.normal_(m.weight, std=(m.in_channels * taps) ** -0.5)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
