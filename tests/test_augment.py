"""Training augmentations: grid symmetries with vector components, whole-field input dropout,
and the long-horizon levers (time stride range, pushforward) running together."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from tests.conftest import TINY_GEN, tiny_train_overrides
from walrus.bcs import BoundaryType
from walrus.data.batch import Batch, collate
from walrus.data.synthetic import generate
from walrus.data.synthetic.navier_stokes import solve_vorticity, velocity_from_vorticity
from walrus.data.well_dataset import WellDataset
from walrus.model.walrus import Walrus
from walrus.training.augment import (
    GridSymmetry,
    SymmetryAugment,
    apply_symmetries,
    field_keep_mask,
    field_layout,
    symmetry_group,
    transform,
)
from walrus.training.losses import normalized_loss
from walrus.training.module import WalrusModule
from walrus.training.train import train

W, OP, P = (int(b) for b in (BoundaryType.WALL, BoundaryType.OPEN, BoundaryType.PERIODIC))
ROT90 = GridSymmetry(((0, -1), (1, 0)))  # counter-clockwise: (x, y) -> (-y, x)
FLIP_X = GridSymmetry(((-1, 0), (0, 1)))
NAMES = ("vorticity", "velocity_x", "velocity_y", "tracer")


def _centred(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n, n)`` coordinates about the grid's centre, axis 0 is x."""
    c = torch.arange(n, dtype=torch.float64) - (n - 1) / 2
    return torch.meshgrid(c, c, indexing="ij")


def _frames(fields: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(fields)[None, None]  # (1, 1, C, N, N)


def _layout(names=NAMES, n_spatial: int = 2):
    return field_layout(names, n_spatial)


def test_rotating_a_shear_flow_turns_its_components_and_moves_scalars():
    x, y = _centred(6)
    f = lambda s: torch.sin(s) + 0.1 * s**3  # noqa: E731  (odd and even parts both matter)
    s = lambda a, b: a + 0.3 * b**2 + 0.05 * a * b  # noqa: E731  an asymmetric scalar
    shear = _frames([torch.zeros_like(x), f(y), torch.zeros_like(x), s(x, y)])
    out = transform(shear, ROT90, _layout())[0, 0]
    # u'(p) = R u(R^-1 p), R^-1 (x, y) = (y, -x): the shear (f(y), 0) becomes (0, f(-x))
    torch.testing.assert_close(out[1], torch.zeros_like(x))
    torch.testing.assert_close(out[2], f(-x))
    torch.testing.assert_close(out[3], s(y, -x))
    # ... and the shear (0, f(x)) becomes (-f(y), 0)
    other = transform(
        _frames([torch.zeros_like(x), torch.zeros_like(x), f(x), s(x, y)]), ROT90, _layout()
    )
    torch.testing.assert_close(other[0, 0, 1], -f(y))
    torch.testing.assert_close(other[0, 0, 2], torch.zeros_like(x))


def test_solid_body_rotation_is_invariant_under_rotations_and_reverses_under_reflections():
    x, y = _centred(8)
    omega = 0.7
    # u = omega (-y, x) has vorticity 2 omega everywhere
    flow = _frames([torch.full_like(x, 2 * omega), -omega * y, omega * x, x * y**2])
    layout = _layout()
    rotated = transform(flow, ROT90, layout)
    torch.testing.assert_close(rotated[:, :, :3], flow[:, :, :3])
    assert not torch.allclose(rotated[:, :, 3], flow[:, :, 3])  # the scalar did move
    mirrored = transform(flow, FLIP_X, layout)
    torch.testing.assert_close(mirrored[:, :, :3], -flow[:, :, :3])  # vorticity is pseudo
    plain = transform(flow, FLIP_X, field_layout(NAMES, 2, pseudo_fields=()))
    torch.testing.assert_close(plain[:, :, 0], flow[:, :, 0])


def test_group_laws_and_sizes():
    g = torch.Generator().manual_seed(0)
    data = torch.randn(2, 3, 4, 5, 5, generator=g, dtype=torch.float64)  # (B, T, C, H, W)
    layout = _layout()
    four = data
    for _ in range(4):
        four = transform(four, ROT90, layout)
    torch.testing.assert_close(four, data)
    assert not torch.allclose(transform(data, ROT90, layout), data)
    group = symmetry_group((5, 5))
    assert len(group) == len(set(group)) == 8 and group[0] == GridSymmetry.identity(2)
    for a in group:
        torch.testing.assert_close(transform(transform(data, a, layout), a.inverse(), layout), data)
        if a.det < 0:  # every reflection is its own inverse
            torch.testing.assert_close(transform(transform(data, a, layout), a, layout), data)
        for b in group:  # the array action is a group action: a(b(x)) = (a b)(x)
            torch.testing.assert_close(
                transform(transform(data, b, layout), a, layout),
                transform(data, a.compose(b), layout),
            )
    assert sum(e.det < 0 for e in group) == 4
    non_square = symmetry_group((4, 6))
    assert len(non_square) == 4 and all(e.perm == (0, 1) for e in non_square)
    assert len(symmetry_group((9,))) == 2
    assert len(symmetry_group((4, 4, 4))) == 48
    assert len(symmetry_group((4, 4, 2))) == 16


def test_3d_vector_components_follow_an_axis_permutation():
    g = torch.Generator().manual_seed(1)
    data = torch.randn(1, 2, 4, 3, 3, 3, generator=g)  # (B, T, C, X, Y, Z)
    names = ("u_x", "u_y", "u_z", "c")
    e = GridSymmetry.from_perm((2, 0, 1), (1, -1, 1))  # new x = old z, new y = -old x, new z = y
    out = transform(data, e, field_layout(names, 3))
    moved = data.flip(3).permute(0, 1, 2, 5, 3, 4)  # values moved on the grid
    torch.testing.assert_close(out[:, :, 0], moved[:, :, 2])
    torch.testing.assert_close(out[:, :, 1], -moved[:, :, 0])
    torch.testing.assert_close(out[:, :, 2], moved[:, :, 1])
    torch.testing.assert_close(out[:, :, 3], moved[:, :, 3])


def test_1d_reflection_flips_velocity():
    data = torch.arange(8.0).view(1, 1, 1, 8)  # (B, T, C, X)
    out = transform(data, GridSymmetry(((-1,),)), field_layout(("velocity_x",), 1))
    torch.testing.assert_close(out, -data.flip(-1))


def test_boundary_conditions_turn_with_the_axes():
    bcs = torch.tensor([[W, OP], [OP, W]])  # x: wall at lo, open at hi; y: open at lo, wall at hi
    # (x, y) -> (-y, x): new x runs against old y, new y is old x
    torch.testing.assert_close(ROT90.apply_bcs(bcs), torch.tensor([[W, OP], [W, OP]]))
    torch.testing.assert_close(FLIP_X.apply_bcs(bcs), torch.tensor([[OP, W], [OP, W]]))
    swap = GridSymmetry(((0, 1), (1, 0)))  # the diagonal reflection
    torch.testing.assert_close(swap.apply_bcs(bcs), torch.tensor([[OP, W], [W, OP]]))


def _batch(b: int, bcs, names=NAMES, n: int = 6) -> Batch:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, len(names), n, n, generator=g).expand(b, -1, -1, -1, -1)
    y = torch.randn(1, 3, len(names), n, n, generator=g).expand(b, -1, -1, -1, -1)
    meta = {"field_names": names}
    return Batch(x.clone(), y.clone(), torch.arange(len(names)), torch.tensor(bcs), meta)


def test_samples_turn_independently_when_boundaries_allow_and_share_bcs_otherwise():
    aug = SymmetryAugment()
    gen = torch.Generator().manual_seed(0)
    periodic = _batch(64, [[P, P], [P, P]])
    elems = aug.draw((6, 6), periodic.bcs, 64, gen)
    counts = Counter(elems)
    assert len(counts) == 8 and max(counts.values()) < 20  # uniform over D4 (8 per element)
    out = apply_symmetries(periodic, elems, aug.layout(periodic))
    for b in (0, 17, 63):  # sample b is its own element applied to the same frames
        ref = transform(periodic.output_fields[b : b + 1], elems[b], aug.layout(periodic))
        torch.testing.assert_close(out.output_fields[b : b + 1], ref)

    mixed = _batch(64, [[W, W], [P, OP]])
    draws = [aug.draw((6, 6), mixed.bcs, 64, gen) for _ in range(50)]
    per_sample = Counter(e for d in draws for e in d)
    assert len(per_sample) == 8  # every element still reaches each sample
    for d in draws:
        turned = {tuple(e.apply_bcs(mixed.bcs).flatten().tolist()) for e in d}
        assert len(turned) == 1  # one set of boundary conditions per batch
    out = aug(mixed, gen)
    assert out.bcs.shape == (2, 2)


def test_augmented_pairs_are_what_the_solver_makes_from_the_turned_initial_condition():
    """Every element of D4 applied to a Navier–Stokes trajectory (inputs and targets alike) gives
    the trajectory the solver computes from the turned initial vorticity."""
    n, steps = 16, 4
    rng = np.random.default_rng(0)
    w0 = np.fft.irfft2(np.fft.rfft2(rng.standard_normal((n, n))) * (np.arange(n // 2 + 1) < 4))
    group = symmetry_group((n, n))
    layout = field_layout(("vorticity", "velocity_x", "velocity_y"), 2)
    ic = torch.from_numpy(w0)[None, None, None]  # (1, 1, 1, N, N)
    # vorticity is a pseudo-scalar: the turned initial condition is det(g) * w0 moved on the grid
    starts = np.stack([g.det * g.apply_grid(ic)[0, 0, 0].numpy() for g in group])  # (8, N, N)
    w = solve_vorticity(starts, nu=0.01, save_dt=0.05, steps=steps)  # (8, T, N, N)
    vel = velocity_from_vorticity(np.fft.rfft2(w), n)  # (8, T, N, N, 2)
    frames = torch.from_numpy(np.concatenate([w[:, :, None], np.moveaxis(vel, -1, 2)], axis=2))
    base = Batch(
        frames[:1, :2],
        frames[:1, 2:],
        torch.arange(3),
        torch.full((2, 2), P),
        {"field_names": ("vorticity", "velocity_x", "velocity_y")},
    )
    batch = collate([base] * len(group))
    out = apply_symmetries(batch, group, layout)
    torch.testing.assert_close(out.input_fields, frames[:, :2], atol=1e-9, rtol=1e-7)
    torch.testing.assert_close(out.output_fields, frames[:, 2:], atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize(
    ("names", "match"),
    [
        (("stress_xx", "stress_xy", "stress_yx", "stress_yy"), "rank-2 tensor"),
        (("velocity_x", "p"), r"lacks \['velocity_y'\]"),
    ],
)
def test_fields_the_augmentation_cannot_turn_are_refused(names, match):
    with pytest.raises(ValueError, match=match):
        SymmetryAugment()(_batch(2, [[P, P], [P, P]], names))


def test_batches_without_field_names_are_refused():
    batch = _batch(2, [[P, P], [P, P]])
    batch.metadata.clear()
    with pytest.raises(ValueError, match="field_names"):
        SymmetryAugment()(batch)


class LinearStep(nn.Module):
    """A causal toy model: a learned scale of the normalised input."""

    causal = True

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.3))

    def forward(self, x, fields, bcs):
        return self.w * x  # (B, T, C, *S)


def test_dropout_rate_and_never_all_fields():
    x = torch.zeros(20000, 2, 3, 1, 1)  # (B, T, C, H, W)
    keep = field_keep_mask(x, 0.3, torch.Generator().manual_seed(0))  # (B, 1, C, 1, 1)
    assert keep.shape == (20000, 1, 3, 1, 1)
    assert bool((keep.sum(dim=2) > 0).all())  # never every field of a sample
    expected = 0.3 - 0.3**3 / 3  # all-dropped samples keep one field
    assert (1 - keep.mean()).item() == pytest.approx(expected, abs=0.01)
    single = field_keep_mask(torch.zeros(500, 2, 1, 4), 0.9, torch.Generator().manual_seed(1))
    assert bool((single == 1).all())


def test_dropout_zeroes_inputs_leaves_targets_and_is_off_in_eval():
    batch = _batch(8, [[P, P], [P, P]])
    module = WalrusModule(LinearStep(), optimizer=torch.optim.AdamW, field_dropout=0.5)
    torch.manual_seed(3)
    loss = module._rollout_loss(batch)
    torch.manual_seed(3)
    keep = field_keep_mask(batch.input_fields, 0.5)
    assert 0 < keep.sum() < keep.numel()
    frames = torch.cat([batch.input_fields, batch.output_fields], dim=1)
    x_n, target, _ = module._targets(batch.input_fields, frames, 0, None)
    torch.testing.assert_close(loss, normalized_loss(module.model(x_n * keep, None, None), target))
    clean = normalized_loss(module.model(x_n, None, None), target)
    assert not torch.allclose(loss, clean)
    module.eval()
    torch.testing.assert_close(module._rollout_loss(batch), clean)


def test_symmetry_in_the_training_step_only():
    batch = _batch(8, [[P, P], [P, P]])
    module = WalrusModule(LinearStep(), optimizer=torch.optim.AdamW, augment_symmetry="d4")
    torch.manual_seed(0)
    elems = SymmetryAugment().draw((6, 6), batch.bcs, 8)
    turned = apply_symmetries(batch, elems, field_layout(NAMES, 2))
    plain = WalrusModule(LinearStep(), optimizer=torch.optim.AdamW)
    torch.manual_seed(0)
    torch.testing.assert_close(module._rollout_loss(batch), plain._rollout_loss(turned))
    module.eval()
    torch.testing.assert_close(module._rollout_loss(batch), plain._rollout_loss(batch))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"augment_symmetry": "c4"}, "module.augment_symmetry"),
        ({"augment_pseudo": "vorticity"}, "module.augment_pseudo"),
        ({"field_dropout": 1.0}, "module.field_dropout"),
        ({"field_dropout": -0.1}, "module.field_dropout"),
    ],
)
def test_bad_augmentation_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WalrusModule(LinearStep(), optimizer=torch.optim.AdamW, **kwargs)


@pytest.fixture(scope="module")
def long_data_root(tmp_path_factory):
    """Navier–Stokes with 30 frames, long enough for 6-frame windows at time stride 5."""
    root = tmp_path_factory.mktemp("long")
    generate("navier_stokes_2d", root, **{**TINY_GEN, "steps": 30, "progress": False})
    return root


def test_stride_range_and_four_step_pushforward_run_together(long_data_root):
    ds = WellDataset(long_data_root, "navier_stokes_2d", "train", 2, 4, (1, 5), train=True)
    torch.manual_seed(0)
    strides = set()
    for i in itertools.chain(range(4), range(len(ds) // 2, len(ds) // 2 + 4)):
        for _ in range(8):
            strides.add(int(ds[i].metadata["stride"]))
    assert strides == {1, 2, 3, 4, 5}
    batch = collate([ds[i] for i in (0, 1, 2, 3)])
    assert batch.output_fields.shape[1] == 4
    torch.manual_seed(0)
    model = Walrus(3, 32, 2, 4, projection_dim=8, intermediate_dim=16, groups=4)
    module = WalrusModule(
        model,
        optimizer=torch.optim.AdamW,
        rollout_mode="pushforward",
        rollout_steps=4,
        augment_symmetry="d4",
        field_dropout=0.2,
        input_noise=0.1,
    )
    loss = module._rollout_loss(batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


LEVERS = [
    "module.augment_symmetry=d4",
    "module.field_dropout=0.2",
    "module.rollout_mode=pushforward",
    "module.rollout_steps=4",
    "data.n_steps_output=4",
    "data.time_stride=[1,5]",
]


def test_levers_are_command_line_options_and_off_by_default(compose_cfg, tmp_path):
    paths = [f"paths.output_dir={tmp_path}", f"paths.data_dir={tmp_path}"]
    default = instantiate(compose_cfg("train", paths).module)(LinearStep(), torch.optim.AdamW)
    assert default.symmetry is None and default.field_dropout == 0.0
    cfg = compose_cfg("train", [*paths, *LEVERS, "module.augment_pseudo=[vorticity,omega]"])
    module = instantiate(cfg.module)(LinearStep(), torch.optim.AdamW)
    assert module.symmetry.pseudo_fields == ("vorticity", "omega")
    assert module.field_dropout == 0.2 and module.rollout_steps == 4
    assert list(cfg.data.time_stride) == [1, 5]


@pytest.mark.slow
def test_training_run_with_every_lever_on(compose_cfg, tiny_data_root, tmp_path):
    overrides = [*tiny_train_overrides(tiny_data_root, tmp_path), *LEVERS]
    metrics, objects = train(compose_cfg("train", overrides))
    module = objects["module"]
    assert module.symmetry is not None and module.field_dropout == 0.2
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
