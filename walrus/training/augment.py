"""Training augmentations: grid symmetries that turn vector fields with the grid, whole-field
input dropout and input noise. They act on training samples only (``WalrusModule`` applies
them; The Well's baselines in ``benchmarks/baselines.py`` use the same symmetries and noise).

Channels follow The Well's flattening (``walrus.data.well_file``): the vector field ``velocity``
on axes ``x, y`` is the channels ``velocity_x, velocity_y``; a rank-2 tensor field ``stress`` is
``stress_xx, stress_xy, ...``. The spatial axes are taken to be named ``x, y, z`` in order, as in
every Well dataset, so a channel ``NAME_x`` is read as the x-component of vector field ``NAME``.

Shape legend: B batch, T time, C channels (field components), S spatial axes (1-3).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from walrus.data.batch import Batch

SYMMETRIES = ("none", "d4")
AXIS_NAMES = "xyz"
# Fields whose sign also flips under a reflection: 2D vorticity is the out-of-plane component of
# a pseudo-vector, and a magnetic field is a pseudo-vector.
PSEUDO_FIELDS = ("vorticity", "magnetic_field")


@dataclass(frozen=True)
class GridSymmetry:
    """A signed permutation of the spatial axes: a 90-degree rotation, a reflection or a product.

    ``matrix[j][i]`` is +1 or -1 where new axis ``j`` is old axis ``i`` (0 elsewhere): a point
    ``p`` of the grid (coordinates about the grid's centre) moves to ``matrix @ p``, and a vector
    ``v`` there becomes ``matrix @ v``.
    """

    matrix: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        m = self.matrix
        n = len(m)
        ok = 1 <= n <= 3 and all(len(row) == n for row in m)
        ok = ok and all(sorted(abs(v) for v in row) == [0] * (n - 1) + [1] for row in m)
        ok = ok and all(sum(abs(m[j][i]) for j in range(n)) == 1 for i in range(n))
        if not ok:
            raise ValueError(f"a grid symmetry needs a signed permutation matrix, got {m!r}")

    @classmethod
    def from_perm(cls, perm: Sequence[int], signs: Sequence[int]) -> GridSymmetry:
        """New axis ``j`` is old axis ``perm[j]``, multiplied by ``signs[j]`` (+1 or -1)."""
        n = len(perm)
        return cls(
            tuple(tuple(signs[j] if i == perm[j] else 0 for i in range(n)) for j in range(n))
        )

    @classmethod
    def identity(cls, n_spatial: int) -> GridSymmetry:
        return cls.from_perm(range(n_spatial), [1] * n_spatial)

    @property
    def n_spatial(self) -> int:
        return len(self.matrix)

    @property
    def perm(self) -> tuple[int, ...]:
        """``perm[j]``: the old axis that becomes axis ``j``."""
        return tuple(next(i for i, v in enumerate(row) if v) for row in self.matrix)

    @property
    def signs(self) -> tuple[int, ...]:
        """``signs[j]``: -1 where new axis ``j`` runs against old axis ``perm[j]``."""
        return tuple(row[i] for row, i in zip(self.matrix, self.perm))

    @property
    def det(self) -> int:
        """+1 for rotations, -1 for improper elements (an odd number of reflections)."""
        perm = self.perm
        inversions = sum(perm[a] > perm[b] for a, b in itertools.combinations(range(len(perm)), 2))
        return (-1) ** inversions * math.prod(self.signs)

    def compose(self, first: GridSymmetry) -> GridSymmetry:
        """The element that applies ``first``, then ``self``."""
        n = self.n_spatial
        a, b = self.matrix, first.matrix
        return GridSymmetry(
            tuple(
                tuple(sum(a[j][k] * b[k][i] for k in range(n)) for i in range(n)) for j in range(n)
            )
        )

    def inverse(self) -> GridSymmetry:
        return GridSymmetry(tuple(zip(*self.matrix)))

    def apply_grid(self, x: Tensor) -> Tensor:
        """Move the values of ``x`` ``(B, T, C, *S)`` on the grid (components are not touched)."""
        lead = x.ndim - self.n_spatial
        flipped = [lead + i for i, s in zip(self.perm, self.signs) if s < 0]
        if flipped:
            x = x.flip(flipped)
        return x.permute(*range(lead), *(lead + i for i in self.perm))  # (B, T, C, *S')

    def apply_bcs(self, bcs: Tensor) -> Tensor:
        """Boundary codes ``(S, 2)`` (lo, hi per axis) of the transformed grid."""
        rows = [bcs[i].flip(0) if s < 0 else bcs[i] for i, s in zip(self.perm, self.signs)]
        return torch.stack(rows)  # (S, 2)


def symmetry_group(shape: Sequence[int]) -> list[GridSymmetry]:
    """Every grid symmetry that maps a grid of ``shape`` onto itself: any reflections, and
    permutations among axes of equal length only (a square: the 8 elements of D4; a non-square
    2D grid: the 4 reflections; 1D: 2; a cube: 48). The identity comes first."""
    n = len(shape)
    group = []
    for perm in itertools.permutations(range(n)):
        if any(shape[p] != shape[j] for j, p in enumerate(perm)):
            continue
        for signs in itertools.product((1, -1), repeat=n):
            group.append(GridSymmetry.from_perm(perm, signs))
    return group


@dataclass(frozen=True)
class FieldLayout:
    """Which channels of a batch form vector fields, and which are pseudo-quantities.

    Attributes:
        n_channels: C.
        vectors: per vector field, its channel indices in axis order (x, y, z).
        pseudo: channels whose sign also flips under improper elements (``det == -1``).
    """

    n_channels: int
    vectors: tuple[tuple[int, ...], ...]
    pseudo: frozenset[int]

    def channel_map(self, g: GridSymmetry) -> tuple[list[int], list[int]]:
        """``(source, sign)``: new channel ``c`` is ``sign[c] *`` old channel ``source[c]``."""
        source, sign = list(range(self.n_channels)), [1] * self.n_channels
        for chans in self.vectors:
            for j, c in enumerate(chans):
                source[c], sign[c] = chans[g.perm[j]], g.signs[j]
        for c in self.pseudo:
            sign[c] *= g.det
        return source, sign


def field_layout(
    names: Sequence[str], n_spatial: int, pseudo_fields: Sequence[str] = PSEUDO_FIELDS
) -> FieldLayout:
    """Read vector fields from channel names (``velocity_x, velocity_y``); other channels are
    scalars. ``pseudo_fields`` names scalar or vector fields that are pseudo-quantities.

    Raises:
        ValueError: a channel looks like a rank-2 tensor component (``stress_xy``), which is not
            supported, or a vector field lacks some of its components in the batch.
    """
    axes = AXIS_NAMES[:n_spatial]
    index = {name: c for c, name in enumerate(names)}
    vectors: dict[str, tuple[int, ...]] = {}
    for name in names:
        base, sep, suffix = name.rpartition("_")
        if not sep or not base:
            continue
        if len(suffix) == 2 and all(a in axes for a in suffix):
            raise ValueError(
                f"module.augment_symmetry: channel {name!r} looks like a component of a rank-2 "
                "tensor field, which symmetry augmentation does not transform; set "
                "module.augment_symmetry=none for this data"
            )
        if len(suffix) == 1 and suffix in axes and base not in vectors:
            comps = [f"{base}_{a}" for a in axes]
            missing = [c for c in comps if c not in index]
            if missing:
                raise ValueError(
                    f"module.augment_symmetry: channel {name!r} is a component of vector field "
                    f"{base!r}, but the batch lacks {missing}; a rotation needs every component "
                    "(select the whole field in data.fields, or set module.augment_symmetry=none)"
                )
            vectors[base] = tuple(index[c] for c in comps)
    pseudo = {index[n] for n in names if n in pseudo_fields}
    pseudo |= {c for base, chans in vectors.items() if base in pseudo_fields for c in chans}
    return FieldLayout(len(names), tuple(vectors.values()), frozenset(pseudo))


def transform(x: Tensor, g: GridSymmetry, layout: FieldLayout) -> Tensor:
    """Apply ``g`` to frames ``x`` ``(B, T, C, *S)``: values move on the grid, vector components
    turn with it, pseudo-quantities change sign under reflections."""
    if g == GridSymmetry.identity(g.n_spatial):
        return x
    source, sign = layout.channel_map(g)
    y = g.apply_grid(x)  # (B, T, C, *S)
    if source != list(range(layout.n_channels)):
        y = y[:, :, source]
    if any(s < 0 for s in sign):
        factor = torch.tensor(sign, dtype=y.dtype, device=y.device)
        y = y * factor.view(1, 1, -1, *([1] * g.n_spatial))
    return y


def apply_symmetries(batch: Batch, elements: Sequence[GridSymmetry], layout: FieldLayout) -> Batch:
    """Apply ``elements[b]`` to sample ``b``'s input and target frames alike, and to the
    boundary codes, which must come out the same for every sample."""
    bcs = elements[0].apply_bcs(batch.bcs)
    if any(not torch.equal(g.apply_bcs(batch.bcs), bcs) for g in elements[1:]):
        raise ValueError("the samples' grid symmetries give different boundary conditions")
    t_in = batch.input_fields.shape[1]
    x = torch.cat([batch.input_fields, batch.output_fields], dim=1)  # (B, Ti+To, C, *S)
    out = torch.empty_like(x)
    for g in dict.fromkeys(elements):
        idx = torch.tensor([b for b, e in enumerate(elements) if e == g], device=x.device)
        out[idx] = transform(x[idx], g, layout)
    return replace(batch, input_fields=out[:, :t_in], output_fields=out[:, t_in:], bcs=bcs)


class SymmetryAugment:
    """Turns each training sample by a random grid symmetry (see ``symmetry_group``).

    One element ``g`` is drawn for the batch, uniform over the grid's group, and each sample then
    gets ``g`` after its own draw from the elements that leave the boundary conditions as they
    are: every sample's element is uniform over the group, and all samples keep one set of
    boundary conditions (the model takes one per batch). With periodic or identical walls on
    every side of a square, samples turn independently.

    Args:
        pseudo_fields: field names whose sign also flips under reflections.
    """

    def __init__(self, pseudo_fields: Sequence[str] = PSEUDO_FIELDS) -> None:
        self.pseudo_fields = tuple(pseudo_fields)
        self._layouts: dict[tuple[tuple[str, ...], int], FieldLayout] = {}

    def layout(self, batch: Batch) -> FieldLayout:
        """The batch's ``FieldLayout``, from ``metadata['field_names']``."""
        names = batch.channel_names()
        if names is None:
            raise ValueError(
                "module.augment_symmetry needs the batch's field names (metadata['field_names']) "
                "to find the vector components"
            )
        key = (tuple(names), batch.n_spatial)
        if key not in self._layouts:
            self._layouts[key] = field_layout(names, batch.n_spatial, self.pseudo_fields)
        return self._layouts[key]

    def draw(
        self,
        shape: Sequence[int],
        bcs: Tensor,
        batch_size: int,
        generator: torch.Generator | None = None,
    ) -> list[GridSymmetry]:
        """One element per sample for a grid of ``shape`` with boundary codes ``bcs`` ``(S, 2)``."""
        group = symmetry_group(shape)
        keep_bcs = [s for s in group if torch.equal(s.apply_bcs(bcs), bcs)]
        g = group[int(torch.randint(len(group), (), generator=generator))]
        own = torch.randint(len(keep_bcs), (batch_size,), generator=generator).tolist()
        return [g.compose(keep_bcs[i]) for i in own]

    def __call__(self, batch: Batch, generator: torch.Generator | None = None) -> Batch:
        layout = self.layout(batch)
        shape = batch.input_fields.shape[3:]
        elements = self.draw(shape, batch.bcs, batch.batch_size, generator)
        return apply_symmetries(batch, elements, layout)


def build_symmetry(mode: str, pseudo_fields: Sequence[str]) -> SymmetryAugment | None:
    """``SymmetryAugment`` for ``module.augment_symmetry`` (``None`` for ``none``).

    Raises:
        ValueError: an unknown mode, or ``module.augment_pseudo`` not a list of names.
    """
    if mode not in SYMMETRIES:
        raise ValueError(f"module.augment_symmetry must be one of {SYMMETRIES}, got {mode!r}")
    if isinstance(pseudo_fields, str) or not all(isinstance(n, str) for n in pseudo_fields):
        raise ValueError(
            f"module.augment_pseudo must be a list of field names, got {pseudo_fields!r}"
        )
    return None if mode == "none" else SymmetryAugment(pseudo_fields)


def check_field_dropout(p: float) -> float:
    """``module.field_dropout`` as a float in ``[0, 1)``."""
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p < 1.0:
        raise ValueError(f"module.field_dropout must be a number in [0, 1), got {p!r}")
    return float(p)


def field_keep_mask(x: Tensor, p: float, generator: torch.Generator | None = None) -> Tensor:
    """``(B, 1, C, 1, ...)`` mask of 0 (dropped) and 1 for the input window ``x`` ``(B, T, C, *S)``.

    Each channel of each sample is dropped with probability ``p``, for all its frames. A sample
    never loses every channel: where all were drawn, one chosen at random is kept (so the rate
    is ``p - p**C / C``, and a single-channel sample is never dropped).
    """
    b, c = x.shape[0], x.shape[2]
    drop = torch.rand(b, c, generator=generator) < p  # (B, C), drawn on the host
    every = drop.all(dim=1)  # (B,)
    spare = torch.randint(c, (b,), generator=generator)  # (B,)
    drop[every, spare[every]] = False
    keep = (~drop).to(dtype=x.dtype)  # (B, C)
    return keep.view(b, 1, c, *([1] * (x.ndim - 3))).to(x.device, non_blocking=True)


def delta_rms(x: Tensor) -> Tensor:
    """RMS of the frame-to-frame changes of ``x`` ``(B, T, C, *S)`` -> ``(B, 1, C, 1, ...)``."""
    dims = (1, *range(3, x.ndim))
    d = x[:, 1:].float() - x[:, :-1].float()  # (B, T-1, C, *S)
    return d.square().mean(dim=dims, keepdim=True).sqrt()


def input_noise(x: Tensor, scale: Tensor, level: float, units: str) -> Tensor:
    """Gaussian noise of ``level`` units for a window ``x`` ``(B, T, C, *S)``, shaped like ``x``.

    The unit is ``scale`` ``(B, 1, C, 1, ...)`` (the normaliser's input RMS) for
    ``units="input_rms"``, the RMS of the window's values about their mean (over time and
    space, per sample and field) for ``"input_std"``, or the window's change RMS for
    ``"delta_rms"``. Unlike ``input_rms``, ``input_std`` does not grow with a field's offset (a
    water height of 1 with waves of 0.05). Fields that do not change within the window (a
    steady velocity, a parameter map) get none: their delta targets are in units of a zero
    change, where any noise is huge.
    """
    if units == "input_std":
        dims = (1, *range(3, x.ndim))
        scale = x.float().std(dim=dims, keepdim=True, correction=0)  # (B, 1, C, 1, ...)
    if x.shape[1] < 2:
        return level * scale * torch.randn_like(x)
    change = delta_rms(x)  # (B, 1, C, 1, ...)
    unit = change if units == "delta_rms" else scale
    moving = change > 1e-6 * x.float().abs().amax(dim=(1, *range(3, x.ndim)), keepdim=True)
    return level * unit * moving * torch.randn_like(x)
