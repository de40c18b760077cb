"""hMLP encoders and decoders: the conv form with stride modulation, and the patch form.

The encoder is two strided convolutions (norm + SiLU after each); the decoder mirrors it with
transposed convolutions. Kernels are stored 3D, ``(k, k, k)``. Only the spatial axes longer
than one point are convolved: for the others the kernel is summed over that axis (stride 1),
so 1D, 2D and 3D data share the weights and one code path (``conv{1,2,3}d`` on the squeezed
tensor).

Stride modulation: the kernels are fixed; per axis, strides ``(s1, s2)`` are picked from a list
so that ``size / (s1*s2)`` lands near a target latent size. ``official_strides`` is the official
Walrus lookup table instead (used by both official profiles, :mod:`walrus.model.profile`).

The current official layout has no separate field embedding:
:class:`FieldEncoder`'s first conv takes the raw fields plus three boundary flag channels,
with one input column per vocabulary field. Its decoder wraps periodic axes around before each
transposed conv (:attr:`Decoder.periodic_wrap`).

The patch form (:class:`PatchEncoder`, :class:`PatchDecoder`, ``encoder="patch"``) uses
kernel = stride: non-overlapping patches, weights only for the dimensionality they serve,
computed as reshapes and matrix products (this project's profile only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from walrus.nn.norms import RMSGroupNorm

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}

# Official Walrus stride table: ``size // target`` -> (s1, s2).
OFFICIAL_STRIDE_TABLE = {
    0: (1, 1),
    1: (1, 1),
    2: (2, 2),
    4: (2, 2),
    8: (4, 2),
    12: (6, 2),
    16: (4, 4),
    24: (6, 4),
    32: (8, 4),
}


def choose_strides(
    sizes: Sequence[int], target: int, options: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Pick ``(s1, s2)`` per axis so ``size / (s1*s2)`` is nearest ``target`` (log scale).

    Ties go to the larger patch. Only patches no larger than the axis qualify.

    Args:
        sizes: lengths of the strided axes (all > 1).
        target: wanted latent tokens per axis.
        options: candidate stride pairs.

    Raises:
        ValueError: an axis is smaller than the smallest patch.
    """
    out = []
    for axis, n in enumerate(sizes):
        fits = [s for s in options if s[0] * s[1] <= n]
        if not fits:
            smallest = min(s[0] * s[1] for s in options)
            raise ValueError(
                f"spatial axis {axis} has {n} points, smaller than one patch ({smallest} points); "
                "use a larger grid or smaller strides"
            )
        out.append(
            min(fits, key=lambda s: (abs(math.log(n / (s[0] * s[1]) / target)), -s[0] * s[1]))
        )
    return out


def official_strides(sizes: Sequence[int], target: int) -> list[tuple[int, int]]:
    """Strides of the official Walrus: ``OFFICIAL_STRIDE_TABLE[size // target]`` per axis.

    The official code also requires ``size % target == 0``; here other sizes are accepted (the
    padding plan tiles any size), but the quotient must be in the table.

    Raises:
        ValueError: ``size // target`` is not in the table.
    """
    out = []
    for axis, n in enumerate(sizes):
        key = n // target
        if key not in OFFICIAL_STRIDE_TABLE:
            ok = sorted(k * target for k in OFFICIAL_STRIDE_TABLE if k)
            raise ValueError(
                f"spatial axis {axis} has {n} points; the official Walrus stride table "
                f"(official profiles) takes sizes with size // {target} in "
                f"{sorted(OFFICIAL_STRIDE_TABLE)}, e.g. {ok}"
            )
        out.append(OFFICIAL_STRIDE_TABLE[key])
    return out


def _squeeze_kernel(w: Tensor, active: Sequence[bool], reduce: str = "sum") -> Tensor:
    """Reduce a ``(O, I, k, k, k)`` kernel over the inactive axes (sum or mean) and drop them."""
    inactive = [2 + i for i, a in enumerate(active) if not a]
    if not inactive:
        return w
    return w.sum(dim=inactive) if reduce == "sum" else w.mean(dim=inactive)


class Encoder(nn.Module):
    """Two strided convs with RMS group norm and SiLU: ``proj_dim -> inter_dim -> dim``.

    Args:
        proj_dim: input channels (field embedding width).
        inter_dim: channels between the two convs.
        dim: output channels (processor width).
        kernels: ``(k1, k2)`` kernel sizes of the two convs.
        groups: norm groups; ``None``: one group per channel.
        norm_eps: added to the norms' mean square.
    """

    def __init__(
        self,
        proj_dim: int,
        inter_dim: int,
        dim: int,
        kernels: tuple[int, int],
        groups: int | None,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        k1, k2 = kernels
        self.proj1 = nn.Conv3d(proj_dim, inter_dim, k1, bias=False)
        self.norm1 = RMSGroupNorm(inter_dim, groups or inter_dim, norm_eps, channels_last=False)
        self.proj2 = nn.Conv3d(inter_dim, dim, k2, bias=False)
        self.norm2 = RMSGroupNorm(dim, groups or dim, norm_eps, channels_last=False)

    def forward(
        self, x: Tensor, active: Sequence[bool], strides: Sequence[tuple[int, int]]
    ) -> Tensor:
        """Encode.

        Args:
            x: ``(N, proj_dim, *padded)`` over the active axes only.
            active: which of the 3 axes are present in ``x``.
            strides: ``(s1, s2)`` per present axis.

        Returns:
            ``(N, dim, *latent)``.
        """
        return self._encode(x, self.proj1.weight, active, strides)

    def _encode(
        self, x: Tensor, w1: Tensor, active: Sequence[bool], strides: Sequence[tuple[int, int]]
    ) -> Tensor:
        """Both convs, the first with kernel ``w1`` ``(inter, x channels, k1, k1, k1)``."""
        conv = CONV[len(strides)]
        x = conv(x, _squeeze_kernel(w1, active), stride=[s[0] for s in strides])
        x = F.silu(self.norm1(x))
        x = conv(x, _squeeze_kernel(self.proj2.weight, active), stride=[s[1] for s in strides])
        return F.silu(self.norm2(x))


class FieldEncoder(Encoder):
    """Encoder of the current official layout: the field projection is its first conv.

    ``proj1`` has one input column per vocabulary field. The input is the batch's C fields
    followed by three flag channels (ones, wall flag, open flag: see
    :func:`walrus.model.jitter.flag_jitter`), projected by the columns ``fields`` and
    ``flag_fields``. The field and ones columns are rescaled by
    ``sqrt((n_fields - 3) / C)``; the two boundary flag columns are not.

    Args:
        n_fields: vocabulary size (input columns of ``proj1``).
        inter_dim, dim, kernels, groups, norm_eps: as :class:`Encoder`.
        flag_fields: vocabulary ids of the ones, wall and open channels.
    """

    def __init__(
        self,
        n_fields: int,
        inter_dim: int,
        dim: int,
        kernels: tuple[int, int],
        groups: int | None,
        norm_eps: float = 1e-6,
        flag_fields: Sequence[int] = (2, 0, 1),
    ):
        super().__init__(n_fields, inter_dim, dim, kernels, groups, norm_eps)
        self.flag_fields = tuple(int(i) for i in flag_fields)

    def forward(
        self,
        x: Tensor,
        fields: Tensor,
        active: Sequence[bool],
        strides: Sequence[tuple[int, int]],
    ) -> Tensor:
        """Encode.

        Args:
            x: ``(N, C + 3, *padded)`` over the active axes: fields, then the flag channels.
            fields: ``(C,)`` long vocabulary ids on the weight's device.
            active: which of the 3 axes are present in ``x``.
            strides: ``(s1, s2)`` per present axis.

        Returns:
            ``(N, dim, *latent)``.
        """
        w = self.proj1.weight  # (inter, n_fields, k, k, k)
        c = x.shape[1] - len(self.flag_fields)
        scale = math.sqrt((w.shape[1] - len(self.flag_fields)) / c)
        ones, wall, open_ = (w[:, i : i + 1] for i in self.flag_fields)  # python ints: no copy
        # (inter, C + 3, k1, k1, k1): fields and ones rescaled, boundary flags as they are
        w1 = torch.cat([w[:, fields] * scale, ones * scale, wall, open_], dim=1)
        return self._encode(x, w1, active, strides)


class Decoder(nn.Module):
    """Mirror of :class:`Encoder`: ``dim -> inter_dim -> n_fields`` with transposed convs.

    The last layer holds one output channel (and bias) per vocabulary field; only the batch's
    fields are computed.

    Args:
        dim, inter_dim, kernels, groups, norm_eps: as :class:`Encoder`.
        n_fields: vocabulary size (output channels of the last conv).
        kernel_reduce: how kernels collapse over inactive axes: ``"sum"`` (like the encoder) or
            ``"mean"`` (official Walrus).
        periodic_wrap: each transposed conv sees its input wrapped around periodic axes by
            ``(k - s) // s`` tokens per side, and the extra output is cropped: the borders of a
            periodic axis get the contributions of the tokens across the boundary (current
            official layout).
    """

    def __init__(
        self,
        dim: int,
        inter_dim: int,
        n_fields: int,
        kernels: tuple[int, int],
        groups: int | None,
        norm_eps: float = 1e-6,
        *,
        kernel_reduce: str = "sum",
        periodic_wrap: bool = False,
    ):
        super().__init__()
        if kernel_reduce not in ("sum", "mean"):
            raise ValueError(f"kernel_reduce must be 'sum' or 'mean', got {kernel_reduce!r}")
        self.kernel_reduce, self.periodic_wrap = kernel_reduce, periodic_wrap
        k1, k2 = kernels
        self.proj1 = nn.ConvTranspose3d(dim, inter_dim, k2, bias=False)
        self.norm1 = RMSGroupNorm(inter_dim, groups or inter_dim, norm_eps, channels_last=False)
        self.proj2 = nn.ConvTranspose3d(inter_dim, n_fields, k1)

    def forward(
        self,
        x: Tensor,
        fields: Tensor,
        active: Sequence[bool],
        strides: Sequence[tuple[int, int]],
        periodic: Sequence[bool] | None = None,
    ) -> Tensor:
        """Decode.

        Args:
            x: ``(N, dim, *latent)`` over the active axes.
            fields: ``(C,)`` long vocabulary ids on the weight's device.
            active: which of the 3 axes are present.
            strides: ``(s1, s2)`` per present axis.
            periodic: per present axis, whether it is periodic (used with ``periodic_wrap``).

        Returns:
            ``(N, C, *padded)``.
        """
        red = self.kernel_reduce
        wrap = list(periodic) if self.periodic_wrap and periodic else [False] * len(strides)
        w1 = _squeeze_kernel(self.proj1.weight, active, red)  # (dim, inter, *k)
        x = self._conv_t(x, w1, None, [s[1] for s in strides], wrap)
        x = F.silu(self.norm1(x))
        w = _squeeze_kernel(self.proj2.weight[:, fields], active, red)  # (inter, C, *k)
        return self._conv_t(x, w, self.proj2.bias[fields], [s[0] for s in strides], wrap)

    @staticmethod
    def _conv_t(
        x: Tensor, w: Tensor, bias: Tensor | None, strides: list[int], wrap: list[bool]
    ) -> Tensor:
        """Transposed conv; wrapped axes get ``p = (k - s) // s`` input tokens per side, and the
        ``p * s`` extra outputs per side are cropped (same output length as without wrap)."""
        pads = [
            (w.shape[2 + i] - s) // s if on else 0 for i, (s, on) in enumerate(zip(strides, wrap))
        ]
        if any(pads):
            x = F.pad(x, [p for pad in reversed(pads) for p in (pad, pad)], mode="circular")
        y = CONV_T[len(strides)](x, w, bias, stride=strides)
        for i, (pad, s) in enumerate(zip(pads, strides)):
            if pad:
                y = y.narrow(2 + i, pad * s, y.shape[2 + i] - 2 * pad * s)
        return y


# ---------------------------------------------------------------------- patch form (kernel = stride)

CONV_ND = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONV_T_ND = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


def _patch_kernel(w: Tensor, active: Sequence[bool]) -> Tensor:
    """A ``(O, I, *[k] * d)`` kernel summed over the axes ``active`` (length d) marks absent."""
    return _squeeze_kernel(w, list(active), "sum")


class PatchEncoder(nn.Module):
    """Two non-overlapping patch stages (kernel = stride) with RMS group norm and SiLU, as GEMMs.

    Stage 1 is ``Linear(P * s1^d -> inter)`` on each ``s1^d`` patch, stage 2
    ``Linear(inter * s2^d -> dim)`` on each ``s2^d`` patch of stage-1 tokens: the same map as
    two convs with kernel = stride, whose layout the weights keep (``proj1`` / ``proj2`` are
    ``Conv{d}d`` modules holding the weights; their forward is not used). The input is
    rearranged once so that both stages are plain matrix products over contiguous rows.
    Data with fewer axes than ``d`` (axes of one point dropped) sums the kernel over the
    missing axes, like :class:`Encoder`.

    Args:
        proj_dim: input channels P (field embedding width).
        inter_dim: channels between the stages.
        dim: output channels (processor width).
        kernels: ``(s1, s2)`` patch sizes (kernels and strides) of the two stages.
        n_dims: data dimensionality d the weights are for (1-3).
        groups: norm groups.
        norm_eps: added to the norms' mean square.
    """

    def __init__(
        self,
        proj_dim: int,
        inter_dim: int,
        dim: int,
        kernels: tuple[int, int],
        n_dims: int,
        groups: int,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        s1, s2 = kernels
        self.kernels, self.n_dims = (s1, s2), n_dims
        conv = CONV_ND[n_dims]
        self.proj1 = conv(proj_dim, inter_dim, s1, stride=s1, bias=False)
        self.norm1 = RMSGroupNorm(inter_dim, groups, norm_eps, channels_last=True)
        self.proj2 = conv(inter_dim, dim, s2, stride=s2, bias=False)
        self.norm2 = RMSGroupNorm(dim, groups, norm_eps, channels_last=True)

    def forward(self, x: Tensor, active: Sequence[bool], embed: Tensor | None = None) -> Tensor:
        """Encode.

        Args:
            x: ``(N, P, *padded)`` over the k active axes; each padded length a multiple of
                ``s1 * s2``. With ``embed``: ``(N, E, *padded)``.
            active: per axis of the weights (at least ``d`` entries), whether it is present.
            embed: ``(P, E)``, a per-point linear map applied to ``x`` first, folded into the
                stage-1 weight (``E * s1^d`` columns instead of ``P * s1^d``: a narrow input
                is rearranged and multiplied far cheaper than its embedding).

        Returns:
            ``(N, dim, *latent)`` with ``latent = padded // (s1 * s2)``: a channels-last
            tensor seen through ``movedim`` (``movedim(1, -1)`` of it is contiguous).
        """
        (s1, s2), (n, p), k = self.kernels, x.shape[:2], x.ndim - 2
        grid = [length // (s1 * s2) for length in x.shape[2:]]
        act = active[: self.n_dims]
        # (N, P, g1, s2, s1, g2, s2, s1, ...) -> (N, *g, *[s2] * k, P, *[s1] * k)
        x = x.reshape(n, p, *[v for g in grid for v in (g, s2, s1)])
        perm = [0, *(2 + 3 * i for i in range(k)), *(3 + 3 * i for i in range(k)), 1]
        x = x.permute(*perm, *(4 + 3 * i for i in range(k)))
        x = x.reshape(-1, p * s1**k)  # (N * G * s2^k, P * s1^k) contiguous
        w1 = _patch_kernel(self.proj1.weight, act)  # (inter, P, *[s1] * k)
        if embed is not None:
            w1 = torch.einsum("op...,pe->oe...", w1, embed)  # (inter, E, *[s1] * k)
        h = x @ w1.reshape(w1.shape[0], -1).t()  # (N * G * s2^k, inter)
        h = F.silu(self.norm1(h.view(n, -1, h.shape[-1])))  # (N, G * s2^k, inter)
        # stage 2 input per latent token: its s2^k stage-1 tokens, channels last
        w2 = _patch_kernel(self.proj2.weight, act)  # (dim, inter, *[s2] * k)
        w2 = w2.permute(0, *range(2, 2 + k), 1).reshape(w2.shape[0], -1)  # (dim, s2^k * inter)
        z = h.view(-1, w2.shape[1]) @ w2.t()  # (N * G, dim)
        z = F.silu(self.norm2(z.view(n, -1, z.shape[-1])))  # (N, G, dim)
        return z.view(n, *grid, -1).movedim(-1, 1)  # (N, dim, *grid)


class PatchDecoder(nn.Module):
    """Mirror of :class:`PatchEncoder`: ``dim -> inter * s2^d`` (norm, SiLU), then
    ``inter -> n_fields * s1^d`` with one row block and bias per vocabulary field; only the
    batch's fields are computed. The weights keep the layout of transposed convs with
    kernel = stride (``ConvTranspose{d}d`` modules hold them); the output is rearranged once.

    With ``overlap`` the last stage's kernel is ``2 * s1`` at stride ``s1``: each stage-1 token
    writes a ``(2 s1)^d`` patch centred on its own ``s1^d`` cell (offset ``s1 // 2``), the
    ``2^d`` halves are overlap-added, and what falls past an axis is wrapped around where that
    axis is periodic, dropped elsewhere (a transposed conv with padding ``s1 // 2``, circular
    on periodic axes). Neighbouring patches then blend instead of meeting at seams.

    With ``smoothing = k`` (odd), each field's output is then filtered by its own learned
    ``k^d`` kernel, residually (``y + conv(y, w_field)``; ``w`` starts at zero, so the decoder
    starts as without it); periodic unpadded axes wrap around, the others repeat their edge.
    On an axis of size 1 the kernel is summed over that axis.

    Args:
        dim, inter_dim, kernels, n_dims, groups, norm_eps: as :class:`PatchEncoder`.
        n_fields: vocabulary size.
        overlap: last-stage kernel ``2 * s1`` instead of ``s1``.
        smoothing: kernel size of the per-field smoothing filter (0: none).
    """

    def __init__(
        self,
        dim: int,
        inter_dim: int,
        n_fields: int,
        kernels: tuple[int, int],
        n_dims: int,
        groups: int,
        norm_eps: float = 1e-6,
        overlap: bool = False,
        smoothing: int = 0,
    ):
        super().__init__()
        s1, s2 = kernels
        self.kernels, self.n_dims, self.overlap = (s1, s2), n_dims, overlap
        # (n_fields, 1, *[k] * d) residual depthwise kernels, zero: the identity at start
        self.smoothing = (
            nn.Parameter(torch.zeros(n_fields, 1, *[smoothing] * n_dims)) if smoothing else None
        )
        conv_t = CONV_T_ND[n_dims]
        self.proj1 = conv_t(dim, inter_dim, s2, stride=s2, bias=False)
        self.norm1 = RMSGroupNorm(inter_dim, groups, norm_eps, channels_last=True)
        self.proj2 = conv_t(inter_dim, n_fields, 2 * s1 if overlap else s1, stride=s1)

    def forward(
        self,
        x: Tensor,
        fields: Tensor,
        active: Sequence[bool],
        wrap: Sequence[bool] | None = None,
    ) -> Tensor:
        """Decode.

        Args:
            x: ``(N, dim, *latent)`` over the k active axes (best a channels-last tensor seen
                through ``movedim``, as :class:`PatchEncoder` returns: then no copy is made).
            fields: ``(C,)`` long vocabulary ids on the weight's device.
            active: per axis of the weights (at least ``d`` entries), whether it is present.
            wrap: per active axis, whether an overlapping patch wraps around it (periodic,
                unpadded); default none. Unused without ``overlap``.

        Returns:
            ``(N, C, *padded)`` with ``padded = latent * s1 * s2``.
        """
        (s1, s2), n, k = self.kernels, x.shape[0], x.ndim - 2
        grid = list(x.shape[2:])
        act = active[: self.n_dims]
        z = x.movedim(1, -1).reshape(-1, x.shape[1])  # (N * G, dim)
        w1 = _patch_kernel(self.proj1.weight, act)  # (dim, inter, *[s2] * k)
        inter = w1.shape[1]
        w1 = w1.permute(0, *range(2, 2 + k), 1).reshape(w1.shape[0], -1)  # (dim, s2^k * inter)
        h = (z @ w1).view(n, -1, inter)  # (N, G * s2^k, inter)
        h = F.silu(self.norm1(h)).view(-1, inter)  # (N * G * s2^k, inter)
        w2 = _patch_kernel(self.proj2.weight[:, fields], act)  # (inter, C, *[s1 or 2 s1] * k)
        c = w2.shape[1]
        if self.overlap:
            # stage-1 tokens back on their grid, (N, inter, *[g * s2]), then one transposed conv
            perm = [0, 1 + 2 * k, *(v for i in range(k) for v in (1 + i, 1 + k + i))]
            h = h.view(n, *grid, *[s2] * k, inter).permute(*perm)
            h = h.reshape(n, inter, *[g * s2 for g in grid])
            wrap = [False] * k if wrap is None else wrap
            y = _overlap_transposed(h, w2, self.proj2.bias[fields], s1, wrap)
            return self._smooth(y, fields, act, wrap)
        bias = self.proj2.bias[fields].repeat_interleave(s1**k)  # (C * s1^k,)
        y = torch.addmm(bias, h, w2.reshape(inter, -1))  # (N * G * s2^k, C * s1^k)
        # (N, *g, *[s2] * k, C, *[s1] * k) -> (N, C, g1, s2, s1, g2, s2, s1, ...)
        y = y.view(n, *grid, *[s2] * k, c, *[s1] * k)
        perm = [v for i in range(k) for v in (1 + i, 1 + k + i, 2 + 2 * k + i)]
        y = y.permute(0, 1 + 2 * k, *perm)
        y = y.reshape(n, c, *[g * s1 * s2 for g in grid])  # (N, C, *padded)
        return self._smooth(y, fields, act, wrap)

    def _smooth(
        self, y: Tensor, fields: Tensor, active: Sequence[bool], wrap: Sequence[bool] | None
    ) -> Tensor:
        """``y + conv(y, w_field)`` per field (``y`` ``(N, C, *L)``); ``y`` without smoothing."""
        if self.smoothing is None:
            return y
        k = y.ndim - 2
        w = _squeeze_kernel(self.smoothing[fields], active)  # (C, 1, *[ks] * k)
        half = w.shape[-1] // 2
        wrap = [False] * k if wrap is None else wrap
        padded = y
        for i, w_i in enumerate(wrap):  # pad axis 2 + i only (F.pad lists the last axis first)
            pad = [0] * (2 * k)
            pad[2 * (k - 1 - i)] = pad[2 * (k - 1 - i) + 1] = half
            padded = F.pad(padded, pad, mode="circular" if w_i else "replicate")
        return y + CONV[k](padded, w.to(y.dtype), groups=y.shape[1])  # (N, C, *L)


def _overlap_transposed(
    h: Tensor, w: Tensor, bias: Tensor, s1: int, wrap: Sequence[bool]
) -> Tensor:
    """Transposed conv with kernel ``2 s1`` at stride ``s1``, centred (offset ``s1 // 2``),
    circular on the ``wrap`` axes.

    Args:
        h: ``(N, inter, *Lt)`` tokens on their grid.
        w: ``(inter, C, *[2 s1] * k)``.
        bias: ``(C,)``.
        s1: the stride.
        wrap: per axis, circular (the overhang wraps around) instead of dropped.

    Returns:
        ``(N, C, *L)`` with ``L = Lt * s1`` per axis.
    """
    k = h.ndim - 2
    lengths = [n * s1 for n in h.shape[2:]]
    for i, w_i in enumerate(wrap):  # one token of circular padding on each wrapped side
        if w_i:
            ax = 2 + i
            h = torch.cat([h.narrow(ax, h.shape[ax] - 1, 1), h, h.narrow(ax, 0, 1)], dim=ax)
    y = CONV_T[k](h, w, bias, stride=s1)  # (N, C, *(Lt + 1 [+ 2]) * s1)
    for i, (length, w_i) in enumerate(zip(lengths, wrap)):
        y = y.narrow(2 + i, s1 // 2 + (s1 if w_i else 0), length)
    return y
