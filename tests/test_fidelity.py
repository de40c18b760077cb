"""Physical-fidelity measures, negligible true power, constant fields and step windows."""

from __future__ import annotations

import json
import math

import pytest
import torch

from walrus.inference.report import format_rollout_table
from walrus.metrics import (
    NEGLIGIBLE_POWER,
    RolloutMetrics,
    amplitude_ratio,
    binned_power_ratio,
    binned_spectral_mse,
    change_correlation,
    negligible_bins,
    spectral_bin_edges,
    step_windows,
)

N = 64
X = torch.arange(N, dtype=torch.float64)
LOW, MID, HIGH = 1, 8, 24  # one integer wavenumber in each bin of a 64-point grid


def wave(m: int, *, sine: bool = False) -> torch.Tensor:
    """``(B=1, C=1, X=64)`` cosine (or sine) of wavenumber ``m``: mean square 1/2."""
    phase = 2 * math.pi * m * X / N
    return (torch.sin(phase) if sine else torch.cos(phase)).reshape(1, 1, N)


def test_one_wave_per_bin() -> None:
    edges = spectral_bin_edges((N,)).double()
    for b, m in enumerate((LOW, MID, HIGH)):
        assert edges[b] <= 2 * math.pi * m / N < edges[b + 1]


def test_twice_the_truth() -> None:
    truth = 3.0 + wave(LOW) + wave(MID) + wave(HIGH)
    prev = 3.0 + wave(LOW) + 0.5 * wave(MID)
    pred, prev_pred = 2 * truth, 2 * prev
    assert amplitude_ratio(pred, truth).item() == pytest.approx(2.0, rel=1e-12)
    torch.testing.assert_close(
        binned_power_ratio(pred, truth)[0, 0], torch.full((3,), 4.0, dtype=torch.float64)
    )
    # the predicted change is twice the true one: perfectly correlated
    corr = change_correlation(pred, truth, prev_pred, prev)
    assert corr.item() == pytest.approx(1.0, rel=1e-12)
    # the opposite change is perfectly anti-correlated
    assert change_correlation(2 * prev - truth, truth, prev, prev).item() == pytest.approx(-1.0)


def test_truth_plus_a_sine_in_the_high_band() -> None:
    a = 0.1
    truth = 3.0 + wave(LOW) + wave(MID) + wave(HIGH)
    prev = truth - 0.1 * wave(MID)  # the truth changes by 0.1 cos(8 x)
    pred = truth + a * wave(HIGH, sine=True)  # orthogonal to every wave of the truth
    # variance 3 * 1/2 for the truth, plus a^2 / 2 for the prediction
    assert amplitude_ratio(pred, truth).item() == pytest.approx(math.sqrt(1 + a**2 / 3), rel=1e-12)
    # high band: (1 + a^2) / 2 over 1 / 2; the other bands are untouched
    torch.testing.assert_close(
        binned_power_ratio(pred, truth)[0, 0],
        torch.tensor([1.0, 1.0, 1 + a**2], dtype=torch.float64),
    )
    # predicted change 0.1 cos(8x) + a sin(24x) against 0.1 cos(8x): 0.1 / sqrt(0.1^2 + a^2)
    corr = change_correlation(pred, truth, prev, prev)
    assert corr.item() == pytest.approx(0.1 / math.sqrt(0.01 + a**2), rel=1e-12)
    # a sine shifted by a quarter period in the change is uncorrelated
    shifted = change_correlation(prev + 0.1 * wave(MID, sine=True), truth, prev, prev)
    assert abs(shifted.item()) < 1e-12


def test_band_limited_truth_flags_the_high_bin() -> None:
    truth = 3.0 + wave(LOW) + wave(MID)  # nothing in the high band
    pred = truth + 1e-3 * wave(HIGH)
    assert negligible_bins(truth)[0, 0].tolist() == [False, False, True]
    ratio = binned_power_ratio(pred, truth)[0, 0]
    assert ratio[:2].tolist() == pytest.approx([1.0, 1.0]) and math.isnan(ratio[2])
    # The Well's spectral MSE itself is huge there: that is what the flag keeps out of tables
    assert binned_spectral_mse(pred, truth)[0, 0, 2] > 1.0
    # a bin just above the threshold counts
    var = truth.var(correction=0).item()
    faint = truth + math.sqrt(4 * NEGLIGIBLE_POWER * var) * wave(HIGH)  # power 2x threshold
    assert not negligible_bins(faint)[0, 0, 2]


def test_undefined_values_are_nan() -> None:
    flat = torch.full((1, 1, N), 2.0, dtype=torch.float64)
    assert math.isnan(amplitude_ratio(flat + wave(MID), flat).item())
    # small fluctuations on a large offset keep their amplitude ratio; below float32 precision
    # (std under one epsilon of the RMS) they are flat
    offset = 1e4 + 1e-2 * wave(MID)
    assert amplitude_ratio(offset + 1e-2 * wave(MID), offset).item() == pytest.approx(2.0)
    tiny = (1e5 + 1e-4 * wave(MID)).float()
    assert math.isnan(amplitude_ratio(tiny + 1.0, tiny).item())
    truth = 3.0 + wave(MID)
    # persistence: no predicted change
    assert math.isnan(change_correlation(truth - 0.1, truth, truth - 0.1, truth - 0.2).item())
    # a truth that does not change
    assert math.isnan(change_correlation(truth + wave(LOW), truth, truth, truth).item())
    with pytest.raises(ValueError, match="prev_truth shape"):
        change_correlation(truth, truth, truth, truth[..., :8])


def _record(acc: RolloutMetrics, pred, truth, last) -> None:
    """pred, truth ``(B, S, C, *sp)``; last ``(B, C, *sp)``."""
    for s in range(truth.shape[1]):
        prev = (last, last) if s == 0 else (pred[:, s - 1], truth[:, s - 1])
        acc.update(s + 1, pred[:, s], truth[:, s], last, prev_pred=prev[0], prev_truth=prev[1])


def test_previous_frames_default_to_the_last_update() -> None:
    g = torch.Generator().manual_seed(1)
    truth = torch.randn(2, 3, 2, 8, 8, generator=g, dtype=torch.float64)  # (B, S, C, H, W)
    pred = truth + 0.3 * torch.randn(truth.shape, generator=g, dtype=torch.float64)
    last = torch.randn(2, 2, 8, 8, generator=g, dtype=torch.float64)
    explicit, implicit = RolloutMetrics(["u", "v"], 3), RolloutMetrics(["u", "v"], 3)
    _record(explicit, pred, truth, last)
    for s in range(3):
        implicit.update(s + 1, pred[:, s], truth[:, s], last)
    assert torch.equal(explicit.sum, implicit.sum)
    fresh = RolloutMetrics(["u", "v"], 3)
    with pytest.raises(ValueError, match="step 2: pass prev_pred"):
        fresh.update(2, pred[:, 1], truth[:, 1], last)


def test_accumulator_matches_the_functions_and_persistence_is_null() -> None:
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(3, 4, 2, 8, 8, generator=g, dtype=torch.float64)  # (B, S, C, H, W)
    pred = truth + 0.3 * torch.randn(truth.shape, generator=g, dtype=torch.float64)
    last = torch.randn(3, 2, 8, 8, generator=g, dtype=torch.float64)
    acc = RolloutMetrics(["u", "v"], 4)
    _record(acc, pred, truth, last)
    d = json.loads(json.dumps(acc.to_dict()))  # JSON-able, with null for undefined
    s = 2  # step 3
    corr = change_correlation(pred[:, s], truth[:, s], pred[:, s - 1], truth[:, s - 1]).mean(0)
    amp = amplitude_ratio(pred[:, s], truth[:, s]).mean(0)
    power = binned_power_ratio(pred[:, s], truth[:, s]).mean(0)  # (C, 3)
    assert d["model"]["change_correlation"]["per_step"]["v"][s] == pytest.approx(corr[1].item())
    assert d["model"]["amplitude_ratio"]["per_step"]["u"][s] == pytest.approx(amp[0].item())
    assert d["model"]["power_ratio_mid"]["per_step"]["v"][s] == pytest.approx(power[1, 1].item())
    step1 = change_correlation(pred[:, 0], truth[:, 0], last, last).mean(0)
    assert d["model"]["change_correlation"]["per_step"]["u"][0] == pytest.approx(step1[0].item())
    # persistence: its change is zero, so null; its amplitude is that of the last input
    pers = d["persistence"]["change_correlation"]
    assert pers["per_step"]["u"] == [None] * 4 and pers["windows"]["u"]["2-4"] is None
    assert pers["samples"]["u"] == [0] * 4
    last_amp = amplitude_ratio(last, truth[:, 3]).mean(0)
    assert d["persistence"]["amplitude_ratio"]["per_step"]["v"][3] == pytest.approx(
        last_amp[1].item()
    )
    # the window mean is the mean of its steps, the field mean the mean of the fields
    amps = d["model"]["amplitude_ratio"]
    assert amps["windows"]["u"]["2-4"] == pytest.approx(sum(amps["per_step"]["u"][1:]) / 3)
    both = (amps["per_step"]["u"][0] + amps["per_step"]["v"][0]) / 2
    assert amps["mean_over_fields"]["per_step"][0] == pytest.approx(both)


def test_negligible_bins_are_null_in_metrics_and_table() -> None:
    steps = 3
    truth = torch.stack(
        [3.0 + wave(LOW) * (1 + 0.1 * s) + wave(MID) for s in range(steps)], dim=1
    )  # (B=1, S, C=1, X): band-limited, nothing in the high band
    pred = truth + 1e-3 * wave(HIGH).unsqueeze(1)
    acc = RolloutMetrics(["u"], steps)
    _record(acc, pred, truth, truth[:, 0] - 0.1 * wave(LOW))
    d = acc.to_dict()
    assert d["negligible_true_power"]["u"] == {"low": [], "mid": [], "high": [1, 2, 3]}
    assert d["negligible_power"] == NEGLIGIBLE_POWER
    for source in ("model", "persistence"):
        for metric in ("spectral_high", "power_ratio_high"):
            block = d[source][metric]
            assert block["per_step"]["u"] == [None] * steps
            assert block["mean_over_fields"]["windows"] == {"1": None, "2-3": None}
        assert d[source]["spectral_mid"]["per_step"]["u"][0] is not None
    table = format_rollout_table("bandlimited", d)
    high_row = [ln for ln in table.splitlines() if ln.strip().startswith("2-3")][1]  # spectral
    assert high_row.split()[-2:] == ["n/a", "n/a"]
    assert "negligible true power" in table and "u: high k" in table
    assert "1.52e+03" not in table and "1520" not in table


def test_a_sample_with_power_counts_where_another_has_none() -> None:
    full = 3.0 + wave(LOW) + wave(MID) + wave(HIGH)
    limited = 3.0 + wave(LOW) + wave(MID)
    truth = torch.cat([full, limited])  # (B=2, C=1, X)
    pred = 2 * truth
    acc = RolloutMetrics(["u"], 1)
    acc.update(1, pred, truth, truth - 0.1 * wave(MID))
    d = acc.to_dict()
    assert d["model"]["power_ratio_high"]["samples"]["u"] == [1]
    assert d["model"]["power_ratio_high"]["per_step"]["u"] == [pytest.approx(4.0)]
    assert d["model"]["power_ratio_low"]["samples"]["u"] == [2]
    assert d["negligible_true_power"]["u"]["high"] == []  # not negligible in every sample


def test_constant_fields_are_named_and_left_out_of_means() -> None:
    g = torch.Generator().manual_seed(1)
    b, steps = 2, 3
    moving = torch.randn(b, steps, 1, 8, 8, generator=g)
    constant = torch.full((b, steps, 1, 8, 8), 0.5)
    uniform = (
        torch.arange(steps, dtype=torch.float32).view(1, steps, 1, 1, 1).expand(b, -1, -1, 8, 8)
    )
    truth = torch.cat([moving, constant, uniform + 1.0], dim=2)  # (B, S, C=3, H, W)
    pred = truth + 0.1 * torch.randn(truth.shape, generator=g)
    last = torch.cat([torch.randn(b, 1, 8, 8, generator=g), constant[:, 0], uniform[:, 0]], dim=1)
    acc = RolloutMetrics(["w", "c", "t"], steps)
    _record(acc, pred, truth, last)
    d = acc.to_dict()
    # "t" is uniform in space but changes in time: not constant
    assert d["constant_fields"] == ["c"] and d["fields_in_mean"] == ["w", "t"]
    v = d["model"]["vrmse"]
    assert v["per_step"]["c"][0] > 100  # variance 0: VRMSE of a constant field means nothing
    expected = (v["per_step"]["w"][0] + v["per_step"]["t"][0]) / 2
    assert v["mean_over_fields"]["per_step"][0] == pytest.approx(expected)
    table = format_rollout_table("multi", d)
    assert "mean over fields ['w', 't']" in table
    assert "constant in space and time, left out of the means over fields: c" in table
    # merged halves agree on what is constant
    halves = [RolloutMetrics(["w", "c", "t"], steps) for _ in range(2)]
    for k, half in enumerate(halves):
        _record(half, pred[k : k + 1], truth[k : k + 1], last[k : k + 1])
    assert halves[0].merge(halves[1]).to_dict()["constant_fields"] == ["c"]


@pytest.mark.parametrize(
    ("n_steps", "expected"),
    [
        (1, {"1": (1, 1)}),
        (10, {"1": (1, 1), "2-10": (2, 10)}),
        (11, {"1": (1, 1), "2-10": (2, 10), "11": (11, 11)}),
        (16, {"1": (1, 1), "2-10": (2, 10), "11-16": (11, 16)}),
        (
            70,
            {"1": (1, 1), "2-10": (2, 10), "11-30": (11, 30), "31-60": (31, 60), "61-70": (61, 70)},
        ),
    ],
)
def test_step_windows_name_the_steps_that_ran(n_steps: int, expected: dict) -> None:
    assert step_windows(n_steps) == expected


def test_sixteen_step_table_shows_11_16() -> None:
    g = torch.Generator().manual_seed(2)
    truth = torch.randn(1, 16, 1, 8, 8, generator=g)
    acc = RolloutMetrics(["u"], 16)
    _record(acc, truth + 0.1, truth, truth[:, 0] + 0.2)
    d = acc.to_dict()
    table = format_rollout_table("toy", d)
    assert "11-30" not in table
    labels = [ln.split()[0] for ln in table.splitlines() if ln[:5].strip()[:1].isdigit()]
    assert labels == ["1", "2-10", "11-16"] * 4  # four tables, the windows that ran
    assert list(d["model"]["amplitude_ratio"]["mean_over_fields"]["windows"]) == [
        "1",
        "2-10",
        "11-16",
    ]
