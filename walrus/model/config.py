"""``WalrusConfig``: the typed, self-validating configuration a Walrus model is built from.

Checkpoints store it as plain data (:meth:`WalrusConfig.to_dict`: numbers, strings, bools,
lists, plus the model's ``_target_`` name); :meth:`WalrusConfig.from_dict` reads such a dict
back field by field. Nothing in it is instantiated or resolved: a nested ``_target_``, a
``${...}`` string or a wrong type is an error naming the option.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from walrus.model.profile import NumericsProfile, get_profile
from walrus.nn.attention import KERNEL_NAMES

MODEL_TARGET = "walrus.model.walrus.Walrus"
DEFAULT_STRIDE_OPTIONS = ((2, 2), (4, 2), (4, 4), (8, 4))

# Expected kind of every option: how a stored value is checked and normalised.
_INTS = {
    "n_fields",
    "dim",
    "depth",
    "heads",
    "projection_dim",
    "intermediate_dim",
    "n_spatial_max",
    "groups",
    "rel_pos_buckets",
    "rel_pos_max_distance",
    "noise_dim",
    "decoder_smoothing",
    "output_filter_order",
}
_FLOATS = {
    "mlp_ratio",
    "drop_path",
    "input_drop",
    "layer_scale_init",
    "rope_max_freq",
    "output_filter",
}
_BOOLS = {"causal", "jitter", "latent_roll", "grad_checkpointing", "fused", "decoder_overlap"}
_STRS = {"temporal_kernel", "spatial_kernel", "compat", "encoder", "field_embedding", "noise_scope"}
_INT_LISTS = {"kernel_sizes": 2, "target_latent": 3, "include_d": None, "flag_fields": 3}
_PAIR_LISTS = {"stride_options", "strides"}
_OPTIONAL = {"intermediate_dim", "strides", "compat"}
# largest size accepted for any int option or derived width (PyTorch indexes with int64, and
# no real model comes near it); floats must be finite
MAX_SIZE = 2**31 - 1
ENCODERS = ("conv", "patch")
FIELD_EMBEDDINGS = ("columns", "shared")
NOISE_SCOPES = ("sample", "token")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(key: str, kind: str, value: Any) -> ValueError:
    return ValueError(
        f"model config entry {key!r} must be a plain value ({kind}), "
        f"got {type(value).__name__} {_short(value)}"
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _bounded(key: str, value: int) -> int:
    if abs(value) > MAX_SIZE:
        raise ValueError(
            f"model config entry {key!r} is {_short(value)}, past the largest size {MAX_SIZE}"
        )
    return int(value)


def _int_list(key: str, value: Any, length: int | None) -> tuple[int, ...]:
    kind = f"a list of {length} ints" if length else "a list of ints"
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise _bad(key, kind, value)
    if len(value) > 16 or length is not None and len(value) != length:
        raise _bad(key, kind, value)
    if not all(_is_int(v) for v in value):
        raise _bad(key, kind, value)
    return tuple(_bounded(key, v) for v in value)


def _pairs(key: str, value: Any) -> tuple[tuple[int, int], ...]:
    kind = "a list of (s1, s2) pairs of positive ints"
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
        raise _bad(key, kind, value)
    if len(value) > 64:
        raise _bad(key, "at most 64 pairs", value)
    if key == "strides" and all(_is_int(v) for v in value):
        value = [value]  # one pair for every axis
    for p in value:
        if isinstance(p, str | bytes) or not isinstance(p, Sequence) or len(p) != 2:
            raise _bad(key, kind, value)
        if not all(_is_int(v) and v >= 1 for v in p):
            raise _bad(key, kind, value)
    return tuple((_bounded(key, p[0]), _bounded(key, p[1])) for p in value)


def _normalise(key: str, value: Any) -> Any:
    """``value`` checked against ``key``'s kind and converted to its plain Python type."""
    if value is None and key in _OPTIONAL:
        return None
    if key in _INTS:
        if not _is_int(value):
            raise _bad(key, "an int", value)
        return _bounded(key, value)
    if key in _FLOATS:
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise _bad(key, "a number", value)
        try:
            number = float(value)
        except OverflowError:  # an int past 1e308
            number = math.inf
        if not math.isfinite(number):
            raise _bad(key, "a finite number", value)
        return number
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise _bad(key, "true or false", value)
        return value
    if key in _STRS:
        if not isinstance(value, str):
            raise _bad(key, "a string", value)
        return value
    if key in _INT_LISTS:
        return _int_list(key, value, _INT_LISTS[key])
    return _pairs(key, value)


@dataclass(frozen=True)
class WalrusConfig:
    """Architecture and run-time options of :class:`~walrus.model.walrus.Walrus`.

    Construction checks every value (types, ranges, cross-field constraints) and normalises it
    (lists become tuples, ``intermediate_dim=None`` becomes ``dim // 4``); a bad value raises
    ``ValueError`` naming the option.

    Attributes:
        n_fields: vocabulary size (fields the model knows).
        dim: processor width D.
        depth: number of processor blocks.
        heads: attention heads (must divide ``dim``; head dim even and >= 8).
        projection_dim: field embedding width P.
        intermediate_dim: width between the two encoder/decoder stages (default ``dim // 4``).
        mlp_ratio: feed-forward width before the SwiGLU gate, as a multiple of ``dim``.
        causal: causal time attention; the output then has one prediction per input frame.
            Otherwise only the last frame's prediction is returned.
        n_spatial_max: most spatial axes accepted (at most 3).
        groups: RMS group norm groups (must divide ``dim``, ``intermediate_dim``).
        kernel_sizes: ``(k1, k2)`` kernels of the two encoder convs; with ``encoder="patch"``
            also the strides (the latent has ``ceil(size / (k1 * k2))`` tokens per axis).
        stride_options: candidate ``(s1, s2)`` strides for stride modulation (conv encoder).
        target_latent: wanted latent tokens per axis for data with 1, 2 and 3 non-trivial axes
            (conv encoder).
        strides: explicit strides instead of stride modulation: one ``(s1, s2)`` pair for every
            axis, or one pair per spatial axis (conv encoder only).
        include_d: data dimensionalities that get their own encoder/decoder; data of dimension
            d uses the smallest included value >= d. Training derives it from the data when the
            model config leaves it out; fine-tuning grows it (:meth:`Walrus.grow_dims`).
        jitter: enable patch jittering (see :mod:`walrus.model.walrus` for when it applies).
        latent_roll: with active jitter, roll the latent grid along periodic axes before every
            block (as the official Walrus does, also at inference).
        drop_path: largest drop path probability (linear over depth), in ``[0, 1)``.
        input_drop: dropout on the embedded fields (on the raw fields with the current
            official profile), in ``[0, 1)``.
        layer_scale_init: initial layer scale of every residual branch.
        temporal_kernel: attention kernel of the temporal blocks.
        spatial_kernel: attention kernel of the spatial blocks.
        grad_checkpointing: checkpoint every processor block.
        rope_max_freq: largest axial RoPE frequency.
        rel_pos_buckets: T5 buckets of the temporal bias.
        rel_pos_max_distance: T5 max distance of the temporal bias.
        compat: name of the numerics profile (:mod:`walrus.model.profile`): ``None`` (this
            project's), ``"walrus_official"`` (legacy official layout) or ``"walrus_current"``
            (current official layout; ``projection_dim`` and ``layer_scale_init`` unused).
        flag_fields: with the current official profile, the vocabulary ids of the three
            appended channels (ones, wall flag, open flag); the batch's fields may not use them.
        fused: processor blocks run their fused forward (same results in fewer passes).
        encoder: ``"conv"``: overlapping strided convs with 3D kernels shared by every
            dimensionality, and stride modulation (the default, and the official layout);
            ``"patch"``: non-overlapping patches (kernel = stride) run as GEMMs, with weights for
            each included dimensionality only (this project's profile only).
        decoder_overlap: with ``encoder="patch"``, the decoder's last stage has a kernel twice
            its stride (``2 * kernel_sizes[0]``, centred, overlap-added, wrapped around on
            periodic axes), so neighbouring output patches blend instead of meeting at seams.
        field_embedding: ``"columns"``: one learned embedding column per vocabulary field (the
            default). ``"shared"``: one shared lift modulated by a learned identity vector per
            field (:class:`~walrus.model.field_embedding.SharedFieldEmbedding`); a field new to a
            fine-tune starts from the identities of the checkpoint's fields
            (:meth:`~walrus.model.walrus.Walrus.init_new_fields`). The decoder keeps one output
            row per field either way. This project's profile only.
        noise_dim: width of the Gaussian noise added to every latent token before the
            processor (through a learned ``noise_dim -> dim`` projection), so one network gives
            many ensemble members; 0 (default) is a deterministic model. Noise is drawn when
            jitter is (training, or a ``jitter_seed`` / ``generator`` given to ``forward``).
        noise_scope: ``"sample"``: one noise vector per sample, added to all its tokens (the
            processor turns it into spatially coherent perturbations); ``"token"``: a vector
            per token and frame (perturbations then follow the patch grid).
        decoder_smoothing: with ``encoder="patch"``, an odd kernel size ``k`` of a learned
            per-field smoothing filter after the decoder (residual, ``k^d`` taps per field,
            starting at the identity); 0 (default) is off.
        output_filter: cutoff ``c`` in ``(0, 1)`` of an exponential spectral filter on the
            predicted deltas (:func:`walrus.nn.spectral.spectral_filter`): modes with
            ``|k| <= c * pi`` (radians per cell) are kept, finer ones damped, the Nyquist
            wavenumber removed; non-periodic axes are mirrored first. It has no weights. 0
            (default) is off.
        output_filter_order: even exponent of that filter's damping (sharper when larger).
    """

    # Options a fine-tune (``init_from=``) or a resumed run may take from the current config;
    # every other option is the checkpoint's architecture.
    RUNTIME_OPTIONS: ClassVar[tuple[str, ...]] = (
        "grad_checkpointing",
        "drop_path",
        "temporal_kernel",
        "spatial_kernel",
        "jitter",
    )

    n_fields: int
    dim: int
    depth: int
    heads: int
    projection_dim: int = 48
    intermediate_dim: int | None = None
    mlp_ratio: float = 4.0
    causal: bool = True
    n_spatial_max: int = 3
    groups: int = 16
    kernel_sizes: tuple[int, int] = (8, 4)
    stride_options: tuple[tuple[int, int], ...] = DEFAULT_STRIDE_OPTIONS
    target_latent: tuple[int, int, int] = (32, 32, 16)
    strides: tuple[tuple[int, int], ...] | None = None
    include_d: tuple[int, ...] = (1, 2, 3)
    jitter: bool = True
    latent_roll: bool = False
    drop_path: float = 0.0
    input_drop: float = 0.0
    layer_scale_init: float = 0.1
    temporal_kernel: str = "sdpa"
    spatial_kernel: str = "sdpa"
    grad_checkpointing: bool = False
    rope_max_freq: float = 256.0
    rel_pos_buckets: int = 32
    rel_pos_max_distance: int = 128
    compat: str | None = None
    flag_fields: tuple[int, int, int] = (2, 0, 1)
    fused: bool = True
    encoder: str = "conv"
    decoder_overlap: bool = False
    field_embedding: str = "columns"
    noise_dim: int = 0
    noise_scope: str = "sample"
    decoder_smoothing: int = 0
    output_filter: float = 0.0
    output_filter_order: int = 8

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _normalise(f.name, getattr(self, f.name)))
        if self.intermediate_dim is None:
            object.__setattr__(self, "intermediate_dim", self.dim // 4)
        object.__setattr__(self, "include_d", tuple(sorted(self.include_d)))
        self._check()

    def _check(self) -> None:
        """Ranges and cross-field constraints (types are already checked)."""
        profile = get_profile(self.compat)
        for name in ("n_fields", "dim", "depth", "heads", "intermediate_dim", "projection_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.groups < 1:
            raise ValueError(f"groups must be a positive int, got {self.groups!r}")
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not divisible by heads {self.heads}")
        head_dim = self.dim // self.heads
        if head_dim % 2 or head_dim < 8:
            raise ValueError(
                f"head_dim = dim / heads = {head_dim} must be even and >= 8 (axial RoPE)"
            )
        for name in ("dim", "intermediate_dim"):
            if getattr(self, name) % self.groups:
                raise ValueError(
                    f"{name} {getattr(self, name)} is not divisible by groups {self.groups}"
                )
        if self.mlp_ratio * self.dim > MAX_SIZE:
            raise ValueError(
                f"mlp_ratio * dim = {self.mlp_ratio} * {self.dim} is past the largest size "
                f"{MAX_SIZE}"
            )
        if self.mlp_ratio <= 0 or self.mlp_dim % 2:
            raise ValueError(
                f"mlp_ratio * dim = {self.mlp_ratio} * {self.dim} must be a positive even "
                "int (SwiGLU halves it)"
            )
        if not 1 <= self.n_spatial_max <= 3:
            raise ValueError(f"n_spatial_max must be 1, 2 or 3, got {self.n_spatial_max}")
        if not 0.0 <= self.drop_path < 1.0 or not 0.0 <= self.input_drop < 1.0:
            raise ValueError(
                f"drop_path ({self.drop_path}) and input_drop ({self.input_drop}) must be in [0, 1)"
            )
        for name in ("temporal_kernel", "spatial_kernel"):
            if getattr(self, name) not in KERNEL_NAMES:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not an attention kernel; expected one "
                    f"of {sorted(KERNEL_NAMES)}"
                )
        if min(self.kernel_sizes) < 1:
            raise ValueError(f"kernel_sizes must be positive, got {self.kernel_sizes}")
        if self.encoder not in ENCODERS:
            raise ValueError(f"encoder={self.encoder!r} is not known; expected one of {ENCODERS}")
        if self.field_embedding not in FIELD_EMBEDDINGS:
            raise ValueError(
                f"field_embedding={self.field_embedding!r} is not known; expected one of "
                f"{FIELD_EMBEDDINGS}"
            )
        if self.field_embedding == "shared" and self.compat is not None:
            raise ValueError(
                f"field_embedding='shared' is not available with compat={self.compat!r}: the "
                "official profiles keep their per-field columns"
            )
        if self.encoder == "patch":
            self._check_patch()
        elif self.decoder_overlap or self.decoder_smoothing:
            raise ValueError("decoder_overlap and decoder_smoothing apply to encoder='patch' only")
        else:
            for s1, s2 in self.stride_options + (self.strides or ()):
                if s1 > self.kernel_sizes[0] or s2 > self.kernel_sizes[1]:
                    raise ValueError(
                        f"stride ({s1}, {s2}) exceeds kernel_sizes {self.kernel_sizes}"
                    )
        if min(self.target_latent) < 1:
            raise ValueError(f"target_latent must be positive, got {self.target_latent}")
        if not self.include_d or not set(self.include_d) <= {1, 2, 3}:
            raise ValueError(
                f"include_d must be a non-empty subset of (1, 2, 3), got {list(self.include_d)}"
            )
        if self.noise_dim < 0:
            raise ValueError(f"noise_dim must be an int >= 0, got {self.noise_dim}")
        if not 0.0 <= self.output_filter < 1.0:
            raise ValueError(
                f"output_filter must be 0 (off) or a cutoff in (0, 1), got {self.output_filter}"
            )
        k = self.output_filter_order
        if k < 2 or k > 64 or k % 2:
            raise ValueError(f"output_filter_order must be an even int in 2..64, got {k}")
        if self.noise_scope not in NOISE_SCOPES:
            raise ValueError(
                f"noise_scope={self.noise_scope!r} is not known; expected one of {NOISE_SCOPES}"
            )
        if self.rope_max_freq <= 0 or self.rel_pos_buckets < 1 or self.rel_pos_max_distance < 1:
            raise ValueError(
                "rope_max_freq, rel_pos_buckets and rel_pos_max_distance must be positive"
            )
        if profile.field_projection == "flag_channels" and (
            len(set(self.flag_fields)) != 3
            or not all(0 <= i < self.n_fields for i in self.flag_fields)
        ):
            raise ValueError(
                f"flag_fields must be 3 distinct vocabulary ids in [0, {self.n_fields}), "
                f"got {list(self.flag_fields)}"
            )

    def _check_patch(self) -> None:
        """Constraints of ``encoder="patch"`` (the others are checked before)."""
        if self.compat is not None:
            raise ValueError(
                f"encoder='patch' is not available with compat={self.compat!r}: the official "
                "profiles use the conv encoder"
            )
        if self.strides is not None:
            raise ValueError(
                "strides does not apply to encoder='patch': its kernel_sizes are the strides"
            )
        k = self.decoder_smoothing
        if k < 0 or (k and (k % 2 == 0 or k > 15)):
            raise ValueError(f"decoder_smoothing must be 0 or an odd int in 3..15, got {k}")

    @property
    def mlp_dim(self) -> int:
        """Feed-forward width before the SwiGLU gate."""
        return int(round(self.mlp_ratio * self.dim))

    @property
    def profile(self) -> NumericsProfile:
        """The numerics profile ``compat`` names."""
        return get_profile(self.compat)

    def replace(self, **changes: Any) -> WalrusConfig:
        """A copy with some options changed (validated like a new config)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint or a Hydra node: ``_target_`` plus every option."""
        out: dict[str, Any] = {"_target_": MODEL_TARGET}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = [list(v) if isinstance(v, tuple) else v for v in value]
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WalrusConfig:
        """Read a stored config (e.g. a checkpoint's ``model_config``) as data.

        ``_target_`` may be absent or :data:`MODEL_TARGET`; every other key must be an option
        of this class holding a plain value of its kind. Nothing is instantiated and no
        ``${...}`` interpolation is resolved.

        Raises:
            ValueError: naming the first unknown, missing or malformed option.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"model config must be a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in data.items():
            if key == "_target_":
                if value != MODEL_TARGET:
                    raise ValueError(
                        f"model config names {_short(value)}, not a walrus model "
                        f"(expected {MODEL_TARGET!r})"
                    )
                continue
            if not isinstance(key, str) or key not in known:
                raise ValueError(
                    f"model config has unknown option {_short(key)}; known options: "
                    f"{', '.join(sorted(known))}"
                )
            kwargs[key] = _normalise(key, value)
        missing = [f.name for f in fields(cls) if f.name not in kwargs and f.init and _required(f)]
        if missing:
            raise ValueError(f"model config lacks required option(s) {missing}")
        return cls(**kwargs)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
