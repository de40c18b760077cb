"""Walrus model: shapes, gradients, checkpointing, causality, jitter, field routing, errors."""

from __future__ import annotations

import pytest
import torch

from walrus.bcs import BoundaryType
from walrus.model.encoder import choose_strides
from walrus.model.jitter import PatchJitterer, plan_axis
from walrus.model.walrus import Walrus

W, OP, P = int(BoundaryType.WALL), int(BoundaryType.OPEN), int(BoundaryType.PERIODIC)


def tiny(**kw) -> Walrus:
    torch.manual_seed(0)
    args = dict(projection_dim=8, intermediate_dim=16, groups=4)
    args.update(kw)
    return Walrus(
        kw.pop("n_fields", 6), 32, 2, 4, **{k: v for k, v in args.items() if k != "n_fields"}
    )


@pytest.mark.parametrize(
    "shape, bcs",
    [
        ((2, 3, 2, 32), [[W, OP]]),  # 1D
        ((2, 2, 2, 32, 32), [[P, P], [W, OP]]),  # 2D
        ((1, 1, 3, 48, 80), [[W, W], [P, P]]),  # non-square, B=1, T=1
        ((1, 2, 2, 100, 100), [[P, P], [OP, OP]]),  # not a power of two
        ((1, 2, 1, 8, 12, 8), [[P, P], [W, OP], [W, W]]),  # 3D
        ((1, 2, 2, 32, 1), [[W, W], [P, P]]),  # size-1 axis is skipped
    ],
)
def test_forward_shapes(shape, bcs):
    model = tiny().train()
    x = torch.randn(shape)
    fields = torch.tensor([5, 0, 2][: shape[2]])
    y = model(x, fields, torch.tensor(bcs))
    assert y.shape == x.shape
    assert torch.isfinite(y).all()


def test_non_causal_returns_last_frame():
    model = tiny(causal=False).eval()
    x = torch.randn(2, 3, 2, 32, 32)
    y = model(x, torch.tensor([0, 1]), [[P, P], [P, P]])
    assert y.shape == (2, 1, 2, 32, 32)
    assert torch.isfinite(y).all()


def test_every_parameter_gets_a_gradient():
    model = tiny(include_d=(2,), drop_path=0.1).train()
    x = torch.randn(2, 3, 6, 32, 24)
    y = model(x, torch.arange(6), [[W, OP], [OP, W]], jitter_seed=1)
    y.square().mean().backward()
    missing = [
        n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0
    ]
    assert not missing, f"no gradient for {missing}"


def test_grad_checkpointing_matches():
    x = torch.randn(2, 3, 2, 32, 32)
    out = []
    for ckpt in (False, True):
        model = tiny(drop_path=0.2, input_drop=0.1, grad_checkpointing=ckpt).train()
        torch.manual_seed(7)
        y = model(x, torch.tensor([1, 4]), [[P, P], [W, W]], jitter_seed=3)
        y.square().mean().backward()
        out.append((y.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (y0, g0), (y1, g1) = out
    torch.testing.assert_close(y0, y1, rtol=1e-5, atol=1e-6)
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], rtol=1e-4, atol=1e-6, msg=n)


def test_causality():
    model = tiny().eval()
    x = torch.randn(1, 4, 2, 32, 32)
    fields, bcs = torch.tensor([0, 1]), [[W, W], [P, P]]
    y = model(x, fields, bcs)
    x2 = x.clone()
    x2[:, 2] += torch.randn_like(x2[:, 2])
    y2 = model(x2, fields, bcs)
    torch.testing.assert_close(y[:, :2], y2[:, :2], rtol=0, atol=1e-6)
    assert (y[:, 2:] - y2[:, 2:]).abs().amax() > 1e-3


def test_jitter_determinism():
    x = torch.randn(1, 2, 2, 32, 32)
    fields, bcs = torch.tensor([0, 1]), [[W, OP], [P, P]]
    model = tiny().eval()
    torch.testing.assert_close(model(x, fields, bcs), model(x, fields, bcs), rtol=0, atol=0)
    off = tiny(jitter=False).train()
    torch.testing.assert_close(off(x, fields, bcs), off(x, fields, bcs), rtol=0, atol=0)
    model.train()
    a, b = model(x, fields, bcs, jitter_seed=5), model(x, fields, bcs, jitter_seed=5)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    others = [
        model(x, fields, bcs, generator=torch.Generator().manual_seed(s)) for s in range(6, 10)
    ]
    assert any((o - a).abs().amax() > 1e-4 for o in others), "jitter seed has no effect"


@pytest.mark.parametrize("size", [5, 32, 50])
@pytest.mark.parametrize("bc", [(W, OP), (P, P)])
def test_jitter_unjitter_identity(size, bc):
    jit = PatchJitterer(3)
    torch.nn.init.normal_(jit.padding_tokens)
    x = torch.randn(2, 3, size, 7)
    for shift in (-3, 0, 2):
        plans = [
            plan_axis(size, (2, 4), (8, 4), bc, True, shift),
            plan_axis(7, (2, 2), (8, 4), (W, W), True, 1),
        ]
        padded = jit.jitter(x, plans)
        assert padded.shape[2] == size + plans[0].lo + plans[0].hi
        n_pad = padded.shape[2]  # the two strided convs (k 8, 4; s 2, 4) tile it exactly
        assert (n_pad - 8) % 2 == 0 and ((n_pad - 8) // 2 + 1 - 4) % 4 == 0
        assert torch.equal(PatchJitterer.unjitter(padded, plans), x)


def test_stride_modulation():
    opts = ((2, 2), (4, 2), (4, 4), (8, 4))
    assert choose_strides([128, 256, 512, 1024], 32, opts) == [(2, 2), (4, 2), (4, 4), (8, 4)]
    assert choose_strides([128, 64], 16, opts) == [(4, 2), (2, 2)]
    model = tiny(strides=(4, 2)).eval()
    y = model(torch.randn(1, 1, 2, 40, 24), torch.tensor([0, 1]), [[W, W], [W, W]])
    assert y.shape == (1, 1, 2, 40, 24)


def test_field_subsets_use_their_rows():
    model = tiny().eval()
    x = torch.randn(1, 2, 2, 32, 32)
    bcs = [[P, P], [P, P]]
    y = model(x, torch.tensor([3, 1]), bcs)
    # Permuting channels and ids permutes the output: each field keeps its own row/column.
    y_swapped = model(x.flip(2), torch.tensor([1, 3]), bcs)
    torch.testing.assert_close(y_swapped, y.flip(2), rtol=1e-5, atol=1e-6)
    # Decoder row 3 alone produces field 3's output.
    with torch.no_grad():
        for dec in model.debed.values():
            dec.proj2.weight[:, 3] = 0.0
            dec.proj2.bias[3] = 5.0
    y = model(x, torch.tensor([3, 1]), bcs)
    assert torch.all(y[:, :, 0] == 5.0) and not torch.all(y[:, :, 1] == 5.0)
    # The embedding reads only the batch's columns, scaled by sqrt(vocab / used).
    emb = model.space_bag
    xe = torch.randn(2, 2, 4, 4)
    ref = torch.einsum("pc,nchw->nphw", emb.linear.weight[:, [3, 1]], xe) * (6 / 2) ** 0.5
    ref = ref + emb.linear.bias[:, None, None]
    torch.testing.assert_close(emb(xe, torch.tensor([3, 1])), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, shape, fields, bcs, match",
    [
        ({}, (1, 1, 2, 8, 8, 8, 8), [0, 1], [[W, W]] * 4, "4 spatial axes"),
        ({}, (1, 1, 2, 32, 32), [0, 6], [[W, W]] * 2, "outside the vocabulary"),
        ({}, (1, 1, 2, 32, 32), [0, 1], [[W, W]], r"bcs must be \(2, 2\)"),
        ({}, (1, 1, 2, 32, 32), [0, 1], [[W, W, W], [W, W, W]], r"bcs must be \(2, 2\)"),
        ({}, (1, 1, 2, 32, 32), [0, 1], [[W, P], [W, W]], "periodic"),
        ({}, (1, 1, 2, 3, 32), [0, 1], [[W, W]] * 2, "smaller than one patch"),
        ({"strides": [8, 4]}, (1, 1, 2, 16, 64), [0, 1], [[W, W]] * 2, "smaller than one patch"),
        ({}, (1, 1, 2, 32, 32), [0], [[W, W]] * 2, "one vocabulary id per channel"),
    ],
)
def test_clear_input_errors(kwargs, shape, fields, bcs, match):
    model = tiny(**kwargs)
    with pytest.raises(ValueError, match=match):
        model(torch.randn(shape), torch.tensor(fields), bcs)


def test_clear_config_errors():
    with pytest.raises(ValueError, match="not divisible by heads"):
        Walrus(6, 36, 1, 8)
    with pytest.raises(ValueError, match="groups"):
        Walrus(6, 32, 1, 4, groups=5)
    with pytest.raises(ValueError, match="temporal_kernel"):
        Walrus(6, 32, 1, 4, groups=4, temporal_kernel="nope")


@pytest.mark.parametrize(
    ("n", "lo", "hi", "shift"),
    [(16, 6, 6, -1), (16, 3, 5, 7), (16, 0, 2, 0), (16, 4, 4, 16), (4, 6, 9, -3), (5, 5, 5, 2)],
)
def test_periodic_padding_equals_a_wrapped_gather(n, lo, hi, shift):
    """Periodic axes are shifted and wrapped: value and gradient equal the index gather."""
    from walrus.bcs import BoundaryType
    from walrus.model.jitter import AxisPlan, pad_axes

    per = int(BoundaryType.PERIODIC)
    wall = int(BoundaryType.WALL)
    plans = [AxisPlan(lo, hi, shift, per, per), AxisPlan(2, 1, 0, wall, wall)]
    x = torch.randn(2, 3, n, 7, dtype=torch.float64, requires_grad=True)
    idx = (torch.arange(-lo, n + hi) - shift) % n
    expected = torch.nn.functional.pad(x.index_select(2, idx), [2, 1])  # (2, 3, n+lo+hi, 10)
    got = pad_axes(x, plans)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    w = torch.randn_like(got)
    (g_got,) = torch.autograd.grad((got * w).sum(), x)
    (g_exp,) = torch.autograd.grad((expected * w).sum(), x)
    torch.testing.assert_close(g_got, g_exp)
