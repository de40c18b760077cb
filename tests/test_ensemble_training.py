"""Ensemble training: the fair CRPS loss, latent noise, and the decoder's smoothing filter."""

from __future__ import annotations

import pytest
import scoringrules
import torch
import torch.nn.functional as F
from torch import nn

from walrus.data.batch import Batch
from walrus.model.config import WalrusConfig
from walrus.model.walrus import Walrus
from walrus.training.losses import ensemble_crps, normalized_loss
from walrus.training.module import WalrusModule

PERIODIC = 2
TINY = dict(
    n_fields=8,
    dim=64,
    depth=1,
    heads=4,
    projection_dim=16,
    intermediate_dim=32,
    groups=8,
    encoder="patch",
    kernel_sizes=(4, 2),
    include_d=(2,),
)


def _model(**kwargs) -> Walrus:
    torch.manual_seed(0)
    return Walrus(**{**TINY, **kwargs})


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(2, 3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return x, torch.tensor([0, 1, 2]), torch.full((2, 2), PERIODIC)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_ensemble_crps_is_scoringrules_fair_crps(k):
    g = torch.Generator().manual_seed(k)
    members, target = torch.randn(k, 4, 6, generator=g), torch.randn(4, 6, generator=g)
    ref = scoringrules.crps_ensemble(
        target.double().numpy(), members.double().numpy(), m_axis=0, estimator="fair"
    )
    assert ensemble_crps(members, target).item() == pytest.approx(float(ref.mean()), rel=1e-5)


def test_ensemble_crps_of_identical_members_is_their_mae_and_spread_lowers_it():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    same = torch.stack([pred, pred])
    assert ensemble_crps(same, target).item() == pytest.approx(normalized_loss(pred, target).item())
    # members straddling a target at 0: CRPS = 1 - |1 - (-1)| / 2 = 0 < MAE of either (1)
    straddle = torch.stack([torch.ones(4), -torch.ones(4)])
    assert ensemble_crps(straddle, torch.zeros(4)).item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="at least 2 members"):
        ensemble_crps(pred[None], target)


def test_latent_noise_differs_by_seed_and_is_off_without_one():
    model = _model(noise_dim=4).eval()
    x, f, bcs = _inputs()
    with torch.no_grad():
        plain, again = model(x, f, bcs), model(x, f, bcs)
        a, a2, b = (model(x, f, bcs, jitter_seed=s) for s in (5, 5, 6))
        nojit = _model(noise_dim=4, jitter=False).eval()
        c, d = nojit(x, f, bcs, jitter_seed=5), nojit(x, f, bcs, jitter_seed=6)
        e = nojit(x, f, bcs)
    torch.testing.assert_close(plain, again)
    torch.testing.assert_close(a, a2)
    assert (a - b).abs().max() > 1e-3
    # without jitter the members differ by their noise alone, and no seed means no noise
    assert (c - d).abs().max() > 1e-3
    with torch.no_grad():
        nojit.noise_proj.weight.zero_()
        torch.testing.assert_close(nojit(x, f, bcs, jitter_seed=5), e)


@pytest.mark.parametrize(("scope", "shape"), [("sample", (2, 1, 1, 4)), ("token", (2, 3, 16, 4))])
def test_latent_noise_is_one_vector_per_sample_or_per_token(scope, shape):
    model = _model(noise_dim=4, noise_scope=scope)
    z = torch.zeros(2, 3, 16, 64)  # (B, T, S, D)
    noise = model._latent_noise(z, 7, None)
    assert noise.shape == shape
    torch.testing.assert_close(noise, model._latent_noise(z, 7, None))


def test_noise_and_smoothing_off_leave_the_state_dict_as_it_was():
    keys = set(_model().state_dict())
    assert not any("noise_proj" in k or "smoothing" in k for k in keys)
    with_both = set(_model(noise_dim=4, decoder_smoothing=3).state_dict())
    assert with_both - keys == {"noise_proj.weight", "debed.2.smoothing"}
    cfg = WalrusConfig(**TINY, noise_dim=4, decoder_smoothing=5)
    assert WalrusConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"decoder_smoothing": 4}, "decoder_smoothing"),
        ({"decoder_smoothing": -3}, "decoder_smoothing"),
        ({"noise_dim": -1}, "noise_dim"),
        ({"noise_dim": 4, "noise_scope": "pixel"}, "noise_scope"),
        ({"encoder": "conv", "decoder_smoothing": 3}, "decoder_smoothing"),
    ],
)
def test_bad_noise_and_smoothing_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WalrusConfig(**{**TINY, **kwargs})


def test_smoothing_starts_at_the_identity_and_filters_each_field_circularly():
    x, f, bcs = _inputs()
    plain, smooth = _model().eval(), _model(decoder_smoothing=3).eval()
    smooth.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(smooth(x, f, bcs), plain(x, f, bcs))
        dec = smooth.debed["2"]
        kernel = torch.randn(8, 1, 3, 3, generator=torch.Generator().manual_seed(2))
        dec.smoothing.copy_(kernel)
        y = torch.randn(2, 3, 16, 16)
        got = dec._smooth(y, f, [True, True], [True, True])
        ref = y + F.conv2d(F.pad(y, (1, 1, 1, 1), mode="circular"), kernel[f], groups=3)
        torch.testing.assert_close(got, ref)
        # non-periodic axes repeat their edge
        got = dec._smooth(y, f, [True, True], [False, False])
        ref = y + F.conv2d(F.pad(y, (1, 1, 1, 1), mode="replicate"), kernel[f], groups=3)
        torch.testing.assert_close(got, ref)


def test_resize_vocab_grows_the_smoothing_kernels_with_identity_rows():
    model = _model(decoder_smoothing=3)
    with torch.no_grad():
        model.debed["2"].smoothing.normal_()
    old = model.debed["2"].smoothing.detach().clone()
    model.resize_vocab(12)
    grown = model.debed["2"].smoothing
    assert grown.shape == (12, 1, 3, 3)
    torch.testing.assert_close(grown[:8], old)
    assert grown[8:].abs().max() == 0


class _NoisyStep(nn.Module):
    """A causal toy model whose output carries fresh noise on every call."""

    causal = True

    def __init__(self, noise: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.3))
        self.noise = noise

    def forward(self, x, fields, bcs):
        return self.w * x + self.noise * torch.randn_like(x)  # (B, T, C, *S)


def _batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3, 2, 8, 8, generator=g), torch.randn(2, 1, 2, 8, 8, generator=g)
    return Batch(x, y, torch.tensor([0, 1]), torch.full((2, 2), PERIODIC))


def test_crps_training_reduces_to_the_mae_for_identical_members_and_rewards_spread():
    batch = _batch()
    one = WalrusModule(_NoisyStep(0.0), optimizer=torch.optim.AdamW)
    two = WalrusModule(_NoisyStep(0.0), optimizer=torch.optim.AdamW, ensemble_members=2)
    torch.testing.assert_close(two._rollout_loss(batch), one._rollout_loss(batch))
    noisy = WalrusModule(_NoisyStep(0.5), optimizer=torch.optim.AdamW, ensemble_members=4)
    torch.manual_seed(0)
    crps = noisy._rollout_loss(batch)
    noisy.ensemble_members = 1
    torch.manual_seed(0)
    mae = noisy._rollout_loss(batch)
    assert crps < mae  # the spread term pays for members around the truth
    (grad,) = torch.autograd.grad(crps, noisy.model.w)
    assert torch.isfinite(grad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ensemble_members": 0}, "ensemble_members"),
        ({"ensemble_members": 2.5}, "ensemble_members"),
        ({"ensemble_members": 2, "loss": "mse"}, "loss=mae"),
        ({"ensemble_members": 2, "rollout_mode": "pushforward", "rollout_steps": 2}, "one_step"),
    ],
)
def test_bad_ensemble_training_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WalrusModule(_NoisyStep(0.0), optimizer=torch.optim.AdamW, **kwargs)


def test_a_noisy_model_trains_a_crps_step_end_to_end():
    model = _model(noise_dim=4, decoder_smoothing=3).train()
    module = WalrusModule(model, optimizer=torch.optim.AdamW, ensemble_members=2)
    g = torch.Generator().manual_seed(0)
    batch = Batch(
        torch.randn(2, 3, 2, 32, 32, generator=g),
        torch.randn(2, 1, 2, 32, 32, generator=g),
        torch.tensor([0, 1]),
        torch.full((2, 2), PERIODIC),
    )
    loss = module._rollout_loss(batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert model.noise_proj.weight.grad.abs().sum() > 0
    assert model.debed["2"].smoothing.grad.abs().sum() > 0


def test_noisy_members_share_their_jitter_and_differ_by_noise_alone():
    model = _model(noise_dim=4).train()
    module = WalrusModule(model, optimizer=torch.optim.AdamW, ensemble_members=3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 2, 32, 32, generator=g)
    batch = Batch(x, x[:, :1], torch.tensor([0, 1]), torch.full((2, 2), PERIODIC))
    with torch.no_grad():
        members = module._members(x, batch)  # (K, B, T, C, *S)
        assert members.shape == (3, *x.shape)
        assert (members[0] - members[1]).abs().max() > 1e-4
        model.noise_proj.weight.zero_()  # no noise left: one jitter draw, identical members
        same = module._members(x, batch)
    torch.testing.assert_close(same[0], same[1])
    torch.testing.assert_close(same[0], same[2])


def test_jitter_averaged_draws_of_a_noisy_model_share_the_steps_noise():
    from walrus.rollout import predict_next

    model = _model(noise_dim=4).eval()
    x, f, bcs = _inputs()
    calls = []
    real = model.forward

    def spy(*args, **kwargs):
        calls.append(kwargs.get("noise_seed"))
        return real(*args, **kwargs)

    model.forward = spy
    predict_next(model, x, f, bcs, jitter_seed=11, jitter_average=3)
    assert calls == [None, 11, 11]  # the first draw's noise comes from its own seed, 11


def _scores(ss: float, crps: float, mae: float) -> dict:
    """One inference seed's scores as the ensemble study stores them (three windows, one field)."""

    def block(v, v1=None):
        windows = {"1": v1 or v, "2-10": v, "11-30": v}
        return {"fields": {"u": windows}, "mean": windows}

    member = {k: block(1.0) for k in ("vrmse", "amplitude_ratio", "change_correlation")}
    member |= {"power_ratio_low": block(1.1), "power_ratio_mid": block(1.6),
               "power_ratio_high": block(3.0, v1=30.0)}  # fmt: skip
    return {
        "spread_skill": block(ss), "crps": block(crps), "rank_max_over_flat": block(1.5),
        "vrmse_ensemble_mean": block(0.2), "vrmse_deterministic": block(0.25),
        "mae_deterministic": block(mae), "vrmse_persistence": block(0.5), "member": member,
    }  # fmt: skip


def test_the_ensemble_study_reads_the_criteria_off_the_scores():
    from benchmarks.studies.ensemble_candidates import markdown, verdicts

    result = {"per_seed": {"0": _scores(0.8, 0.1, 0.2), "1": _scores(1.0, 0.1, 0.2)}}
    v = verdicts(result)
    assert v["spread_skill"]["2-10"] == pytest.approx(0.9)
    assert v["crps_over_deterministic_mae"]["2-10"] == pytest.approx(0.5)
    assert v["member_power_high_step1"] == {"u": 30.0}
    assert v["pass"]["spread_skill_0.7_1.3"] and v["pass"]["mean_no_worse"]
    assert not v["pass"]["member_power_0.7_1.4"]  # mid band 1.6 over steps 11-30
    assert not v["pass"]["high_step1_2x"]
    # against a reference model twice as accurate, the ensemble mean is worse
    ref = {"per_seed": {"0": _scores(0.8, 0.1, 0.05)}}
    ref["per_seed"]["0"]["vrmse_deterministic"] = _scores(0.8, 0.1, 0.05)["vrmse_persistence"]
    ref["per_seed"]["0"]["vrmse_deterministic"]["mean"] = {"1": 0.1, "2-10": 0.1, "11-30": 0.1}
    against = verdicts(result, ref)
    assert against["crps_over_deterministic_mae"]["2-10"] == pytest.approx(2.0)
    assert against["ensemble_mean_over_deterministic_vrmse"]["2-10"] == pytest.approx(2.0)
    assert not against["pass"]["mean_no_worse"] and not against["pass"]["crps_0.8_mae"]
    table = markdown({"candidates": {"crps": {"verdicts": v}}})
    assert "| crps | 1 | 0.9 | 1.5 | 0.5 | 0.8 | 1.6 (u mid) | 30 (u) |" in table


def test_pooled_crps_charges_grid_scale_spread_that_the_plain_crps_lets_through():
    from walrus.training.losses import pooled_ensemble_crps

    y = torch.randn(2, 1, 1, 8, 8, generator=torch.Generator().manual_seed(0))  # (B, T, C, *S)
    checker = (torch.arange(8)[:, None] + torch.arange(8)[None, :]) % 2 * 2.0 - 1.0  # mean 0
    members = torch.stack([y + 0.3 * checker, y - 0.3 * checker])  # (K, B, T, C, *S)
    # members straddling the truth at every point: the plain CRPS is 0.3 - 0.6 / 2 = 0
    assert ensemble_crps(members, y).item() == pytest.approx(0.0, abs=1e-6)
    # their 4-point block means agree with the truth's; below that scale each is 0.3 off
    assert pooled_ensemble_crps(members, y, 4).item() == pytest.approx(0.3, abs=1e-6)
    # spread in the block means is scored by the CRPS: two members 1 apart around the truth
    shift = torch.stack([y + 0.5, y - 0.5])
    assert pooled_ensemble_crps(shift, y, 4).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="crps_pool=3 must divide"):
        pooled_ensemble_crps(members, y, 3)
    with pytest.raises(ValueError, match="crps_pool"):
        WalrusModule(_NoisyStep(0.0), optimizer=torch.optim.AdamW, crps_pool=0)


def test_almost_fair_crps_charges_two_members_for_straddling_the_truth_far_apart():
    y = torch.zeros(5)
    for d in (0.5, 2.0):
        pair = torch.stack([y - d, y + d])
        assert ensemble_crps(pair, y).item() == pytest.approx(0.0)  # fair: flat in d
        assert ensemble_crps(pair, y, alpha=0.95).item() == pytest.approx(0.05 * d)
    with pytest.raises(ValueError, match="crps_alpha"):
        WalrusModule(_NoisyStep(0.0), optimizer=torch.optim.AdamW, crps_alpha=0.0)


def test_the_ensemble_study_reads_a_perturbation_off_the_candidate():
    from benchmarks.studies.ensemble_candidates import parse_perturbation
    from walrus.perturbation import Perturbation

    assert parse_perturbation("") is None
    assert parse_perturbation("0.15") == Perturbation(0.15)
    assert parse_perturbation("0.2:4:0.5") == Perturbation(0.2, 4.0, 0.5)
    with pytest.raises(SystemExit, match="is not A"):
        parse_perturbation("big")
    with pytest.raises(ValueError, match="memory must be a number in"):
        parse_perturbation("0.1:8:2")
