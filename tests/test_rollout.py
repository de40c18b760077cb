"""Rollout generator: exactness on identity/linear models, sliding window, memory, divergence."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import Tensor, nn

from walrus.data.batch import Batch
from walrus.data.normalization import RMSNormalizer
from walrus.errors import RolloutDivergedError
from walrus.rollout import predict_next, rollout


class ZeroModel(nn.Module):
    """Predicts a zero delta (or a zero normalised frame) for every input frame."""

    def forward(self, x: Tensor, fields: Tensor, bcs: Tensor, *, jitter_seed: int | None = None):
        return torch.zeros_like(x)


class IdentityModel(nn.Module):
    """Returns its (normalised) input: with predict_delta=False the next frame is the last one."""

    def forward(self, x: Tensor, fields: Tensor, bcs: Tensor, *, jitter_seed: int | None = None):
        return x


class ScaleModel(nn.Module):
    """Linear: out = a * x[:, -1:] (non-causal, T' = 1), with a learnable ``a``."""

    def __init__(self, a: float) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a))

    def forward(self, x: Tensor, fields: Tensor, bcs: Tensor, *, jitter_seed: int | None = None):
        return self.a * x[:, -1:]


class RecordingModel(ZeroModel):
    """Records the windows and seeds it is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.windows: list[Tensor] = []
        self.seeds: list[int | None] = []

    def forward(self, x: Tensor, fields: Tensor, bcs: Tensor, *, jitter_seed: int | None = None):
        self.windows.append(x.clone())
        self.seeds.append(jitter_seed)
        return super().forward(x, fields, bcs)


class NaNAfter(nn.Module):
    """Zero delta, then NaN in channel 1 from call ``k`` (1-based) on."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k, self.calls = k, 0

    def forward(self, x: Tensor, fields: Tensor, bcs: Tensor, *, jitter_seed: int | None = None):
        self.calls += 1
        out = torch.zeros_like(x)
        if self.calls >= self.k:
            out[:, :, 1] = float("nan")
        return out


def make_batch(b: int = 2, t: int = 3, c: int = 2, h: int = 4, w: int = 5, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, c, h, w, generator=g) + 1.0
    return Batch(
        input_fields=x,
        output_fields=torch.zeros(b, 0, c, h, w),
        field_ids=torch.arange(c),
        bcs=torch.full((2, 2), 2, dtype=torch.long),
        metadata={"field_names": [f"f{i}" for i in range(c)]},
    )


def manual_rollout(batch: Batch, steps: int, a: float, predict_delta: bool) -> list[Tensor]:
    """Reference: the model output a * x_n[-1] mapped back by hand with RMS statistics."""
    window = batch.input_fields.clone()
    outs = []
    for _ in range(steps):
        dims = (1, 3, 4)
        rms = window.square().mean(dim=dims, keepdim=True).sqrt() + 1e-4  # (B, 1, C, 1, 1)
        drms = (window[:, 1:] - window[:, :-1]).square().mean(dim=dims, keepdim=True).sqrt() + 1e-4
        last_n = window[:, -1:] / rms  # normalised last frame
        if predict_delta:
            nxt = window[:, -1:] + a * last_n * drms
        else:
            nxt = a * last_n * rms
        outs.append(nxt[:, 0])
        window = torch.cat([window[:, 1:], nxt], dim=1)
    return outs


@pytest.mark.parametrize("predict_delta", [True, False])
def test_identity_models_give_persistence(predict_delta: bool) -> None:
    batch = make_batch()
    model = ZeroModel() if predict_delta else IdentityModel()
    preds = list(rollout(model, batch, 5, predict_delta=predict_delta))
    assert len(preds) == 5
    last = batch.input_fields[:, -1]
    for p in preds:
        # predict_delta=False round-trips through normalise/denormalise: exact up to fp32 rounding
        torch.testing.assert_close(p, last, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("predict_delta", [True, False])
def test_linear_model_matches_hand_computed_sequence(predict_delta: bool) -> None:
    batch = make_batch()
    a = 0.3 if predict_delta else 0.9
    preds = list(rollout(ScaleModel(a), batch, 6, predict_delta=predict_delta))
    expected = manual_rollout(batch, 6, a, predict_delta)
    assert len(preds) == 6
    for p, e in zip(preds, expected):
        assert p.shape == (2, 2, 4, 5)
        torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)
    # the sequence is not trivially constant
    assert not torch.allclose(preds[0], preds[-1])


def test_predict_next_single_step() -> None:
    batch = make_batch()
    nxt = predict_next(
        ScaleModel(0.5), batch.input_fields, batch.field_ids, batch.bcs, normalizer=RMSNormalizer()
    )
    torch.testing.assert_close(nxt, manual_rollout(batch, 1, 0.5, True)[0], rtol=1e-5, atol=1e-6)


def test_window_slides_and_seeds_are_per_step() -> None:
    batch = make_batch(t=3)
    model = RecordingModel()
    preds = list(rollout(model, batch, 4, jitter_seed=10, normalizer=None))
    assert model.seeds == [10, 11, 12, 13]
    assert all(w.shape == batch.input_fields.shape for w in model.windows)
    # window 2 is input frames 2, 3 and prediction 1, divided by one RMS per (sample, field)
    x = batch.input_fields
    w2 = model.windows[1]
    ratio = w2 / torch.cat([x[:, 1:], preds[0].unsqueeze(1)], dim=1)
    torch.testing.assert_close(ratio, ratio[:, :1, :, :1, :1].expand_as(ratio))
    rec = RecordingModel()
    list(rollout(rec, batch, 2))
    assert rec.seeds == [None, None]


def test_batch_of_trajectories_is_independent() -> None:
    batch = make_batch(b=3)
    model = ScaleModel(0.2)
    together = torch.stack(list(rollout(model, batch, 3)), dim=1)  # (B, S, C, H, W)
    for i in range(3):
        single = Batch(
            input_fields=batch.input_fields[i : i + 1],
            output_fields=batch.output_fields[i : i + 1],
            field_ids=batch.field_ids,
            bcs=batch.bcs,
        )
        alone = torch.stack(list(rollout(model, single, 3)), dim=1)
        torch.testing.assert_close(together[i : i + 1], alone)


def test_no_grad_kept_and_caller_grad_mode_untouched() -> None:
    batch = make_batch()
    model = ScaleModel(0.5)
    gen = rollout(model, batch, 3)
    p = next(gen)
    assert not p.requires_grad and p.grad_fn is None
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert not p.is_inference()
    p.add_(1.0)  # yielded tensors are ordinary tensors the caller may modify
    assert len(list(gen)) == 2


def test_memory_flat_over_long_rollout() -> None:
    batch = make_batch(b=1, t=2, c=1, h=3, w=3)
    model = ScaleModel(0.01)

    def live_tensor_bytes() -> int:
        gc.collect()
        tensors = [o for o in gc.get_objects() if issubclass(type(o), Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors) + len(tensors)

    gen = rollout(model, batch, 200)
    counts = {}
    for step, pred in enumerate(gen, start=1):
        assert pred.grad_fn is None
        if step in (10, 200):
            del pred
            counts[step] = live_tensor_bytes()
    assert counts[200] <= counts[10]


def test_nan_raises_with_step_and_field() -> None:
    batch = make_batch()
    got = []
    with pytest.raises(RolloutDivergedError) as info:
        for p in rollout(NaNAfter(3), batch, 10):
            got.append(p)
    assert info.value.step == 3
    assert info.value.fields == ["f1"]
    assert "step 3" in str(info.value) and "f1" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert len(got) == 2
    assert len(list(rollout(NaNAfter(3), batch, 10, check_finite=False))) == 10


def test_bf16_autocast_runs_and_outputs_fp32() -> None:
    batch = make_batch()
    lin = nn.Linear(5, 5)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(5) * 0.1)
        lin.bias.zero_()

    class LinModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x, fields, bcs, *, jitter_seed=None):
            return self.lin(x)

    ref = list(rollout(LinModel(), batch, 3))
    low = list(rollout(LinModel(), batch, 3, autocast_dtype=torch.bfloat16))
    assert all(p.dtype == torch.float32 for p in low)
    for r, lo in zip(ref, low):
        torch.testing.assert_close(lo, r, rtol=2e-2, atol=2e-2)


def test_bad_inputs() -> None:
    batch = make_batch()
    with pytest.raises(ValueError, match="steps"):
        list(rollout(ZeroModel(), batch, -1))

    class WrongShape(nn.Module):
        def forward(self, x, fields, bcs, *, jitter_seed=None):
            return x[..., :2]

    with pytest.raises(ValueError, match="model output"):
        list(rollout(WrongShape(), batch, 1))
    with pytest.raises(ValueError, match="field names"):
        list(rollout(ZeroModel(), batch, 1, field_names=["a"]))
    assert list(rollout(ZeroModel(), batch, 0)) == []


def test_channel_names_from_argument_or_metadata() -> None:
    batch = make_batch()
    n = batch.input_fields.shape[2]
    assert batch.channel_names() == [f"f{i}" for i in range(n)]
    batch.metadata.pop("field_names")
    assert batch.channel_names() is None
    assert batch.channel_names([f"c{i}" for i in range(n)]) == [f"c{i}" for i in range(n)]
    batch.metadata["field_names"] = tuple(f"m{i}" for i in range(n))
    assert batch.channel_names() == [f"m{i}" for i in range(n)]
    with pytest.raises(ValueError, match=f"got 1 field names \\['a'\\] for {n} channels"):
        batch.channel_names(["a"])


class SeedNoiseModel(nn.Module):
    """Zero delta plus a small perturbation drawn from the jitter seed (a stand-in for jitter)."""

    def forward(self, x: Tensor, fields: Tensor, bcs: Tensor, *, jitter_seed: int | None = None):
        g = torch.Generator().manual_seed(int(jitter_seed))
        return 0.1 * torch.randn(x.shape, generator=g, dtype=x.dtype)


def _ens_batch() -> Batch:
    x = torch.randn(2, 3, 2, 8, 8, generator=torch.Generator().manual_seed(3))
    return Batch(x, x[:, :0], torch.tensor([0, 1]), torch.full((2, 2), 2))


def test_ensemble_mean_and_spread_are_those_of_the_member_rollouts():
    from walrus.rollout import MEMBER_SEED_STRIDE, ensemble_rollout

    model, batch = SeedNoiseModel(), _ens_batch()
    out = list(ensemble_rollout(model, batch, 4, members=3, jitter_seed=7))
    runs = [
        torch.stack(list(rollout(model, batch, 4, jitter_seed=7 + m * MEMBER_SEED_STRIDE)))
        for m in range(3)
    ]  # each (S, B, C, H, W)
    stack = torch.stack(runs)  # (M, S, B, C, H, W)
    assert len(out) == 4
    for s, (mean, spread) in enumerate(out):
        torch.testing.assert_close(mean, stack[:, s].mean(0))
        torch.testing.assert_close(spread, stack[:, s].std(0, correction=0))
        assert spread.min() >= 0 and spread.mean() > 0
    # Member 0 is the plain seeded rollout; one member has zero spread.
    ((mean1, spread1),) = list(ensemble_rollout(model, batch, 1, members=1, jitter_seed=7))
    torch.testing.assert_close(mean1, runs[0][0])
    assert torch.count_nonzero(spread1) == 0


def test_ensemble_of_a_jittered_walrus_spreads_and_is_reproducible():
    from walrus.model.walrus import Walrus
    from walrus.rollout import ensemble_rollout

    torch.manual_seed(0)
    model = Walrus(4, 32, 1, 2, projection_dim=8, intermediate_dim=16, groups=4, jitter=True)
    model.eval()
    x = torch.randn(1, 3, 2, 32, 32)
    batch = Batch(x, x[:, :0], torch.tensor([0, 1]), torch.full((2, 2), 2))
    a = list(ensemble_rollout(model, batch, 2, members=3, jitter_seed=5))
    b = list(ensemble_rollout(model, batch, 2, members=3, jitter_seed=5))
    for (ma, sa), (mb, sb) in zip(a, b):
        assert torch.equal(ma, mb) and torch.equal(sa, sb)
    assert a[-1][1].mean() > 0  # jitter makes members differ


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"members": 0, "jitter_seed": 1}, "members"), ({"members": 2, "jitter_seed": None}, "seed")],
)
def test_ensemble_bad_arguments(kwargs, match):
    from walrus.rollout import ensemble_rollout

    with pytest.raises(ValueError, match=match):
        next(ensemble_rollout(ZeroModel(), _ens_batch(), 1, **kwargs))


class ConstantDelta(nn.Module):
    """Predicts the same normalised delta ``c`` everywhere (``c > 1`` overshoots its unit)."""

    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c

    def forward(self, x: Tensor, fields: Tensor, bcs: Tensor, *, jitter_seed: int | None = None):
        return torch.full_like(x[:, -1:], self.c)


def _ramp_batch() -> Batch:
    t = torch.arange(4.0).view(1, 4, 1, 1, 1)
    x = 10.0 + 0.1 * t + torch.zeros(1, 4, 1, 8, 8)  # (1, 4, 1, 8, 8), steps of 0.1
    return Batch(x, x[:, :0], torch.tensor([0]), torch.full((2, 2), 2))


def test_delta_unit_cap_stops_an_overshoot_from_compounding():
    batch = _ramp_batch()
    steps = [p[0, 0, 0, 0].item() for p in rollout(ConstantDelta(2.0), batch, 6)]
    free = [
        p[0, 0, 0, 0].item() for p in rollout(ConstantDelta(2.0), batch, 6, cap_delta_unit=False)
    ]
    inc = torch.diff(torch.tensor([10.3, *steps]))
    inc_free = torch.diff(torch.tensor([10.3, *free]))
    unit = RMSNormalizer().fit(batch.input_fields).delta_scale.item()  # 0.1 + eps
    torch.testing.assert_close(inc, torch.full_like(inc, 2 * unit), rtol=1e-4, atol=1e-5)
    assert inc_free[-1] > 5 * inc_free[0]  # uncapped: each overshoot enlarges the next unit


def test_delta_unit_cap_lets_the_unit_shrink():
    batch = _ramp_batch()
    capped = torch.stack(list(rollout(ConstantDelta(0.5), batch, 6)))
    free = torch.stack(list(rollout(ConstantDelta(0.5), batch, 6, cap_delta_unit=False)))
    torch.testing.assert_close(capped, free)
    inc = torch.diff(capped[:, 0, 0, 0, 0])
    assert inc[-1] < inc[0]  # slowing down is followed, not blocked


def test_jitter_average_feeds_back_the_mean_of_the_draws():
    """Each step predicts with K draws (seeds s + k * DRAW_SEED_STRIDE, k = 0 the plain seed)
    and feeds their mean back: the next step's window holds the mean."""
    from walrus.rollout import DRAW_SEED_STRIDE

    batch = _ens_batch()
    window = batch.input_fields
    draws = [
        predict_next(
            SeedNoiseModel(),
            window,
            batch.field_ids,
            batch.bcs,
            jitter_seed=9 + k * DRAW_SEED_STRIDE,
        )
        for k in range(3)
    ]
    mean = predict_next(
        SeedNoiseModel(), window, batch.field_ids, batch.bcs, jitter_seed=9, jitter_average=3
    )
    torch.testing.assert_close(mean, torch.stack(draws).mean(0), rtol=1e-5, atol=1e-6)
    assert (mean - draws[0]).abs().max() > 1e-3  # the draws differ
    model = RecordingModel()
    steps = list(rollout(model, batch, 2, jitter_seed=9, jitter_average=3))
    assert model.seeds == [9 + k * DRAW_SEED_STRIDE for k in range(3)] + [
        10 + k * DRAW_SEED_STRIDE for k in range(3)
    ]
    # step 2's window ends with step 1's prediction (normalised), the same for all its draws
    assert torch.equal(model.windows[3], model.windows[5])
    assert len(steps) == 2
    # one draw is the plain seeded rollout
    one = list(rollout(SeedNoiseModel(), batch, 2, jitter_seed=9, jitter_average=1))
    plain = list(rollout(SeedNoiseModel(), batch, 2, jitter_seed=9))
    for a, b in zip(one, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"jitter_average": 0, "jitter_seed": 1}, "jitter_average must be an int >= 1"),
        ({"jitter_average": 2, "jitter_seed": None}, "jitter_average=2 needs jitter"),
    ],
)
def test_jitter_average_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        next(rollout(ZeroModel(), _ens_batch(), 1, **kwargs))


@pytest.mark.parametrize("scheme", ["rms", "meanstd"])
def test_walrus_rollout_matches_the_model_applied_by_hand(scheme: str) -> None:
    """Per-sample normalisation in a rollout: each window's own statistics in, the same ones
    out (delta unit capped at the context's), written out by hand around the bare model."""
    from walrus.data.normalization import MeanStdNormalizer
    from walrus.model.walrus import Walrus

    torch.manual_seed(0)
    model = Walrus(
        n_fields=4, dim=32, depth=1, heads=4, projection_dim=8, intermediate_dim=16, groups=4
    ).eval()
    batch = make_batch(b=2, t=3, c=2, h=16, w=16)
    batch.input_fields[1] *= 1e3  # a second system three orders of magnitude larger
    normalizer = RMSNormalizer() if scheme == "rms" else MeanStdNormalizer()
    preds = list(rollout(model, batch, 3, normalizer=normalizer, jitter_seed=None))

    def fit(w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # each (B, 1, C, 1, 1)
        d = w[:, 1:] - w[:, :-1]
        if scheme == "rms":
            rms, drms = (v.square().mean(dim=(1, 3, 4), keepdim=True).sqrt() for v in (w, d))
            return torch.zeros_like(rms), rms + 1e-4, torch.zeros_like(rms), drms + 1e-4
        std, mean = torch.std_mean(w, dim=(1, 3, 4), keepdim=True, correction=0)
        dstd, dmean = torch.std_mean(d, dim=(1, 3, 4), keepdim=True, correction=0)
        return mean, std + 1e-4, dmean, dstd + 1e-4

    window = batch.input_fields.clone()
    cap = fit(window)[3]
    for pred in preds:
        shift, scale, dshift, dscale = fit(window)
        with torch.no_grad():
            out = model((window - shift) / scale, batch.field_ids, batch.bcs)[:, -1:]
        nxt = window[:, -1:] + out * torch.minimum(dscale, cap) + dshift  # (B, 1, C, H, W)
        torch.testing.assert_close(pred, nxt[:, 0], rtol=1e-5, atol=1e-5 * scale.max().item())
        window = torch.cat([window[:, 1:], nxt], dim=1)
    assert preds[-1][1].abs().mean() > 100 * preds[-1][0].abs().mean()  # scales kept apart
