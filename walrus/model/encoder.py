"""hMLP encoder and decoder with stride modulation.

The encoder is two strided convolutions (norm + SiLU after each); the decoder mirrors it with
transposed convolutions. Kernels are stored 3D, ``(k, k, k)``. Only the spatial axes longer
than one point are convolved: for the others the kernel is summed over that axis (stride 1),
so 1D, 2D and 3D data share the weights and one code path (``conv{1,2,3}d`` on the squeezed
tensor).

Stride modulation: the kernels are fixed; per axis, strides ``(s1, s2)`` are picked from a list
so that ``size / (s1*s2)`` lands near a target latent size. ``official_strides`` is the official
Walrus lookup table instead (used with ``compat="walrus_official"``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
                f"(compat='walrus_official') takes sizes with size // {target} in "
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
        groups: norm groups.
    """

    def __init__(
        self, proj_dim: int, inter_dim: int, dim: int, kernels: tuple[int, int], groups: int
    ):
        super().__init__()
        k1, k2 = kernels
        self.proj1 = nn.Conv3d(proj_dim, inter_dim, k1, bias=False)
        self.norm1 = RMSGroupNorm(inter_dim, groups, channels_last=False)
        self.proj2 = nn.Conv3d(inter_dim, dim, k2, bias=False)
        self.norm2 = RMSGroupNorm(dim, groups, channels_last=False)

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
        conv = CONV[len(strides)]
        x = conv(x, _squeeze_kernel(self.proj1.weight, active), stride=[s[0] for s in strides])
        x = F.silu(self.norm1(x))
        x = conv(x, _squeeze_kernel(self.proj2.weight, active), stride=[s[1] for s in strides])
        return F.silu(self.norm2(x))


class Decoder(nn.Module):
    """Mirror of :class:`Encoder`: ``dim -> inter_dim -> n_fields`` with transposed convs.

    The last layer holds one output channel (and bias) per vocabulary field; only the batch's
    fields are computed. ``kernel_reduce`` says how kernels collapse over inactive axes:
    ``"sum"`` (default, like the encoder) or ``"mean"`` (official Walrus).
    """

    kernel_reduce: str = "sum"

    def __init__(
        self, dim: int, inter_dim: int, n_fields: int, kernels: tuple[int, int], groups: int
    ):
        super().__init__()
        k1, k2 = kernels
        self.proj1 = nn.ConvTranspose3d(dim, inter_dim, k2, bias=False)
        self.norm1 = RMSGroupNorm(inter_dim, groups, channels_last=False)
        self.proj2 = nn.ConvTranspose3d(inter_dim, n_fields, k1)

    def forward(
        self, x: Tensor, fields: Tensor, active: Sequence[bool], strides: Sequence[tuple[int, int]]
    ) -> Tensor:
        """Decode.

        Args:
            x: ``(N, dim, *latent)`` over the active axes.
            fields: ``(C,)`` long vocabulary ids on the weight's device.
            active: which of the 3 axes are present.
            strides: ``(s1, s2)`` per present axis.

        Returns:
            ``(N, C, *padded)``.
        """
        conv_t = CONV_T[len(strides)]
        red = self.kernel_reduce
        w1 = _squeeze_kernel(self.proj1.weight, active, red)  # (dim, inter, *k)
        x = conv_t(x, w1, stride=[s[1] for s in strides])
        x = F.silu(self.norm1(x))
        w = _squeeze_kernel(self.proj2.weight[:, fields], active, red)  # (inter, C, *k)
        return conv_t(x, w, self.proj2.bias[fields], stride=[s[0] for s in strides])
