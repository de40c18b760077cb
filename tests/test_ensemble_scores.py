"""Ensemble scores (walrus.metrics.ensemble_scores, RolloutMetrics(members=K)) on constructed
ensembles whose spread-skill ratio, CRPS and rank histogram are known in closed form."""

import json
import math

import pytest
import scoringrules
import torch

from walrus.metrics import (
    ENSEMBLE,
    EPS,
    SPATIAL_MEAN,
    RolloutMetrics,
    ensemble_scores,
    spread_skill_ratio,
    vrmse,
)


def _truth(b: int = 2, c: int = 2, n: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, c, n, n, generator=g, dtype=torch.float64)  # (B, C, n, n)


def test_two_member_ensemble_closed_form() -> None:
    # members truth + d +- a: mean error d, unbiased variance 2 a^2, the truth below both
    truth = _truth()
    a, d = 1.0, math.sqrt(3.0)
    members = torch.stack([truth + d + a, truth + d - a])  # (2, B, C, n, n)
    s = ensemble_scores(members, truth)
    torch.testing.assert_close(s["variance"], torch.full((2, 2), 2 * a * a, dtype=torch.float64))
    torch.testing.assert_close(s["mse"], torch.full((2, 2), d * d, dtype=torch.float64))
    # sqrt(3/2) * sqrt(2 a^2) / d = sqrt(3) a / d = 1
    torch.testing.assert_close(s["spread_skill"], torch.ones(2, 2, dtype=torch.float64))
    # fair CRPS: E|X - y| - E|X - X'| / 2 with the pair mean over K (K - 1): d - a
    scale = (truth.var(dim=(-2, -1)) + EPS).sqrt()  # (B, C)
    torch.testing.assert_close(s["crps"], (d - a) / scale)
    # the truth lies below both members: every point at rank 0
    expected = torch.tensor([64.0, 0.0, 0.0], dtype=torch.float64).expand(2, 2, 3)
    torch.testing.assert_close(s["rank_counts"], expected)


def test_ties_spread_over_the_ranks_they_could_take() -> None:
    truth = _truth(b=1, c=1, n=4)
    members = torch.stack([truth, truth, truth + 1.0])  # two members equal the truth
    counts = ensemble_scores(members, truth)["rank_counts"][0, 0]  # (4,)
    torch.testing.assert_close(counts, torch.tensor([16 / 3, 16 / 3, 16 / 3, 0.0]).double())


def test_crps_is_scoringrules_fair_estimator() -> None:
    g = torch.Generator().manual_seed(1)
    truth = torch.randn(3, 2, 5, 6, generator=g, dtype=torch.float64)
    members = truth + torch.randn(5, 3, 2, 5, 6, generator=g, dtype=torch.float64)
    fair = scoringrules.crps_ensemble(truth, members, m_axis=0, estimator="fair", backend="torch")
    scale = (truth.var(dim=(-2, -1)) + EPS).sqrt()
    expected = fair.mean(dim=(-2, -1)) / scale  # (3, 2)
    torch.testing.assert_close(ensemble_scores(members, truth)["crps"], expected)
    # one member against the truth: the CRPS of a point forecast is its absolute error
    point = scoringrules.crps_ensemble(truth, members[:1], m_axis=0, estimator="nrg")
    torch.testing.assert_close(torch.as_tensor(point), (members[0] - truth).abs())


def test_calibrated_ensemble_scores_one_and_flat_ranks() -> None:
    # truth and K members drawn from one distribution: corrected ratio 1, ranks flat
    k = 4
    g = torch.Generator().manual_seed(2)
    draws = torch.randn(k + 1, 4, 1, 64, 64, generator=g, dtype=torch.float64)
    truth, members = draws[0], draws[1:]
    acc = RolloutMetrics(["u"], 1, members=k)
    acc.update(1, members.mean(0), truth, truth, members=members, prev_pred=truth, prev_truth=truth)
    ens = acc.to_dict()[ENSEMBLE]
    assert ens["spread_skill"]["per_step"]["u"][0] == pytest.approx(1.0, abs=0.03)
    # without the finite-ensemble factor it would be sqrt(K / (K + 1)) = 0.894
    hist = ens["rank_histogram"]["per_step"]["u"][0]
    assert len(hist) == k + 1 and sum(hist) == pytest.approx(1.0)
    assert hist == pytest.approx([1 / (k + 1)] * (k + 1), abs=0.01)
    assert ens["rank_max_over_flat"]["windows"]["u"]["1"] == pytest.approx(1.0, abs=0.05)


def test_windows_pool_steps_and_accumulators_merge() -> None:
    truth = _truth(b=2, c=2, n=8)
    names = ["u", "v"]

    def members_at(step: int, t: torch.Tensor) -> torch.Tensor:  # error step, spread 1 member
        return torch.stack([t + (step + 1.0), t + (step - 1.0)])  # variance 2, mse step^2

    whole = RolloutMetrics(names, 3, members=2)
    halves = [RolloutMetrics(names, 3, members=2) for _ in range(2)]
    for step in (1, 2, 3):
        whole.update(step, truth + step, truth, truth, members=members_at(step, truth),
                     prev_pred=truth, prev_truth=truth)  # fmt: skip
        for half, rows in zip(halves, (slice(0, 1), slice(1, 2))):
            t = truth[rows]
            half.update(step, t + step, t, t, members=members_at(step, t), prev_pred=t,
                        prev_truth=t)  # fmt: skip
    d = whole.to_dict()
    ens = d[ENSEMBLE]
    ratio = math.sqrt(1.5)
    assert ens["members"] == 2
    assert ens["spread_skill"]["per_step"]["v"] == pytest.approx(
        [ratio * math.sqrt(2) / s for s in (1, 2, 3)]
    )
    # window 2-3 pools the steps: mean variance 2 over mean squared error (4 + 9) / 2
    assert ens["spread_skill"]["windows"]["u"]["2-3"] == pytest.approx(ratio * math.sqrt(4 / 13))
    assert ens["spread_skill"]["mean_over_fields"]["windows"]["1"] == pytest.approx(ratio * 2**0.5)
    scale = (truth.var(dim=(-2, -1)) + EPS).sqrt()  # (B, C): fair CRPS is step - 1 per point
    assert ens["crps"]["per_step"]["u"][2] == pytest.approx((2.0 / scale[:, 0]).mean().item())
    assert ens["rank_histogram"]["windows"]["u"]["2-3"] == [1.0, 0.0, 0.0]
    assert ens["rank_max_over_flat"]["mean_over_fields"]["windows"]["2-3"] == pytest.approx(3.0)
    assert d["spread"]["vrmse"]["per_step"]["u"][0] > 0  # the spread comes from the members
    json.dumps(d)
    merged = halves[0].merge(halves[1])
    for key, value in whole.state().items():
        torch.testing.assert_close(merged.state()[key], value, rtol=1e-12, atol=1e-12)
    again = merged.to_dict()[ENSEMBLE]
    for key in ("spread_skill", "crps", "rank_max_over_flat"):
        assert again[key]["per_step"]["v"] == pytest.approx(ens[key]["per_step"]["v"])
    # at step 1 the member truth + 0 ties with the truth: half its points at rank 0, half at 1
    assert ens["rank_histogram"]["per_step"]["u"][0] == pytest.approx([0.5, 0.5, 0.0])


def test_ensemble_score_errors() -> None:
    truth = _truth(b=1, c=2, n=4)
    with pytest.raises(ValueError, match="at least 2 members"):
        ensemble_scores(truth.unsqueeze(0), truth)
    with pytest.raises(ValueError, match="members must be"):
        ensemble_scores(torch.stack([truth, truth])[:, :, :1], truth)
    acc = RolloutMetrics(["u", "v"], 2, members=3)
    with pytest.raises(ValueError, match="members=3"):
        acc.update(1, truth, truth, truth, members=torch.stack([truth, truth]))
    with pytest.raises(ValueError, match="ensemble size"):
        acc.merge(RolloutMetrics(["u", "v"], 2, members=2))
    with pytest.raises(ValueError, match="members must be an int"):
        RolloutMetrics(["u"], 2, members=0)
    assert math.isnan(spread_skill_ratio(torch.tensor(1.0), torch.tensor(0.0), 2).item())
    assert ENSEMBLE not in RolloutMetrics(["u"], 2).to_dict()


def test_spatial_mean_reference() -> None:
    truth = _truth(b=3, c=2, n=8)
    acc = RolloutMetrics(["u", "v"], 1)
    acc.update(1, truth + 0.1, truth, truth + 1.0)
    d = acc.to_dict()
    flat = truth.mean(dim=(-2, -1), keepdim=True).expand_as(truth)
    expected = vrmse(flat, truth).mean(dim=0)  # (C,) = sqrt((N - 1) / N) up to eps
    assert d[SPATIAL_MEAN]["vrmse"]["per_step"]["u"][0] == pytest.approx(expected[0].item())
    assert expected[0].item() == pytest.approx(math.sqrt(63 / 64), rel=1e-6)
    assert set(d[SPATIAL_MEAN]) == {"vrmse", "nrmse", "spectral_low", "spectral_mid",
                                    "spectral_high"}  # fmt: skip
