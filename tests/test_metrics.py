"""Metrics against hand-computed values; window means; accumulator merging."""

from __future__ import annotations

import json
import math

import pytest
import torch

from walrus.metrics import (
    EPS,
    RolloutMetrics,
    mse,
    nrmse,
    persistence,
    radial_power_spectrum,
    spectral_error,
    vrmse,
    window_means,
)


def test_vrmse_nrmse_mse_hand_computed() -> None:
    truth = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # (B=1, C=1, X=4): mean 2.5, var 1.25, ms 7.5
    pred = torch.tensor([[[1.0, 2.0, 3.0, 6.0]]])  # squared errors 0, 0, 0, 4 -> mse 1
    assert mse(pred, truth).item() == pytest.approx(1.0)
    assert vrmse(pred, truth).item() == pytest.approx(math.sqrt(1.0 / (1.25 + EPS)), rel=1e-6)
    assert nrmse(pred, truth).item() == pytest.approx(math.sqrt(1.0 / (7.5 + EPS)), rel=1e-6)
    # predicting the spatial mean scores VRMSE 1
    mean_pred = torch.full_like(truth, 2.5)
    assert vrmse(mean_pred, truth).item() == pytest.approx(1.0, rel=1e-6)


def test_metrics_reduce_space_only_per_field() -> None:
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(2, 3, 4, 5, 6, generator=g)  # (B, T, C, H, W)
    pred = truth.clone()
    pred[:, :, 1] += 1.0  # only field 1 is wrong, by a constant 1 -> mse 1
    out = vrmse(pred, truth, n_spatial=2)
    assert out.shape == (2, 3, 4)
    assert torch.all(out[:, :, [0, 2, 3]] == 0)
    var = truth[:, :, 1].var(dim=(-2, -1), unbiased=False)
    torch.testing.assert_close(out[:, :, 1], (1.0 / (var + EPS)).sqrt())
    # inference of n_spatial assumes one leading axis: (B, C, H, W) -> 2 spatial axes
    torch.testing.assert_close(
        nrmse(pred[:, 0], truth[:, 0]), nrmse(pred[:, 0], truth[:, 0], n_spatial=2)
    )
    with pytest.raises(ValueError, match="shape"):
        vrmse(pred, truth[..., :3])


def test_power_spectrum_of_known_signals() -> None:
    n = 16
    x = torch.arange(n, dtype=torch.float64)
    sine = torch.sin(2 * math.pi * 3 * x / n).reshape(1, 1, n)  # (B, C, X)
    spec = radial_power_spectrum(sine)
    assert spec.shape == (1, 1, 8)  # shells 1..n/2
    expected = torch.zeros(8, dtype=torch.float64)
    expected[2] = 0.5  # all power (mean of sin^2) in shell 3
    torch.testing.assert_close(spec[0, 0], expected, atol=1e-12, rtol=0)
    # 2D: wavevector (3, 4) has |k| = 5; a constant offset (the mean) is left out
    gx, gy = torch.meshgrid(x, x, indexing="ij")
    wave = 2.0 + torch.cos(2 * math.pi * (3 * gx + 4 * gy) / n).reshape(1, 1, n, n)
    spec2 = radial_power_spectrum(wave)
    expected[2], expected[4] = 0.0, 0.5
    torch.testing.assert_close(spec2[0, 0], expected, atol=1e-12, rtol=0)


def test_spectral_error_known_values() -> None:
    n = 16
    x = torch.arange(n, dtype=torch.float32)
    truth = torch.sin(2 * math.pi * 3 * x / n).reshape(1, 1, n)
    assert spectral_error(truth, truth).item() == pytest.approx(0.0, abs=1e-12)
    # amplitude x2 -> power x4 in the one shell holding power, the 7 empty shells score 0
    err = spectral_error(2 * truth, truth).item()
    assert err == pytest.approx(math.log10(4.0) ** 2 / 8, rel=1e-4)
    # a phase shift leaves the power spectrum unchanged (but not the pointwise error)
    shifted = torch.roll(truth, 2, dims=-1)
    assert spectral_error(shifted, truth).item() == pytest.approx(0.0, abs=1e-9)
    assert vrmse(shifted, truth).item() > 0.5
    # white noise (power in every shell) scaled by a scores (2 log10 a)^2
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(2, 3, 8, 8, generator=g)
    out = spectral_error(0.5 * noise, noise)
    assert out.shape == (2, 3)
    torch.testing.assert_close(
        out, torch.full((2, 3), (2 * math.log10(0.5)) ** 2), rtol=1e-4, atol=0
    )


def test_persistence_repeats_last_frame() -> None:
    x = torch.randn(2, 3, 1, 4)  # (B, T, C, X)
    p = persistence(x, 5)
    assert p.shape == (2, 5, 1, 4)
    assert torch.equal(p[:, 4], x[:, -1]) and torch.equal(p[:, 0], x[:, -1])


def test_window_means() -> None:
    per_step = torch.arange(1, 71, dtype=torch.float64).unsqueeze(1).repeat(1, 2)  # value = step
    out = window_means(per_step)
    assert list(out) == ["1", "2-10", "11-30", "31-60", "61+"]
    assert out["1"].tolist() == [1.0, 1.0]
    assert out["2-10"][0].item() == pytest.approx(6.0)
    assert out["11-30"][0].item() == pytest.approx(20.5)
    assert out["31-60"][0].item() == pytest.approx(45.5)
    assert out["61+"][0].item() == pytest.approx(65.5)
    short = window_means(per_step[:12])
    assert list(short) == ["1", "2-10", "11-30"]
    assert short["11-30"][0].item() == pytest.approx(11.5)  # only the steps it has


def _random_rollout(
    b: int, steps: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(b, steps, 2, 8, 8, generator=g)  # (B, S, C, H, W)
    pred = truth + 0.1 * torch.arange(1, steps + 1).view(1, steps, 1, 1, 1) * torch.randn(
        b, steps, 2, 8, 8, generator=g
    )
    last = torch.randn(b, 2, 8, 8, generator=g)
    return pred, truth, last


def _accumulate(acc: RolloutMetrics, pred, truth, last, steps: int) -> RolloutMetrics:
    for s in range(steps):
        acc.update(s + 1, pred[:, s], truth[:, s], last)
    return acc


def test_rollout_metrics_values_and_merge() -> None:
    steps, names = 12, ["u", "v"]
    pred, truth, last = _random_rollout(4, steps, seed=0)
    whole = _accumulate(RolloutMetrics(names, steps), pred, truth, last, steps)
    d = whole.to_dict()
    expected = vrmse(pred[:, 3], truth[:, 3]).mean(dim=0)  # step 4, mean over samples, (C,)
    assert d["model"]["vrmse"]["per_step"]["v"][3] == pytest.approx(expected[1].item(), rel=1e-6)
    pers = nrmse(last, truth[:, 0]).mean(dim=0)
    assert d["persistence"]["nrmse"]["per_step"]["u"][0] == pytest.approx(pers[0].item(), rel=1e-6)
    assert d["steps"] == steps and d["count"] == [4] * steps
    assert set(d["model"]["spectral"]["windows"]["u"]) == {"1", "2-10", "11-30"}
    json.dumps(d)  # JSON-able

    # two "processes" with two samples each, merged, equal the single run
    a = _accumulate(RolloutMetrics(names, steps), pred[:2], truth[:2], last[:2], steps)
    b = _accumulate(RolloutMetrics(names, steps), pred[2:], truth[2:], last[2:], steps)
    merged = a.merge(b.state())
    torch.testing.assert_close(merged.sum, whole.sum, rtol=1e-12, atol=1e-12)
    assert torch.equal(merged.count, whole.count)
    m = merged.to_dict()
    assert m["model"]["vrmse"]["mean_over_fields"]["windows"]["2-10"] == pytest.approx(
        d["model"]["vrmse"]["mean_over_fields"]["windows"]["2-10"], rel=1e-12
    )


def test_rollout_metrics_uneven_lengths_and_errors() -> None:
    names = ["u", "v"]
    pred, truth, last = _random_rollout(2, 5, seed=3)
    acc = RolloutMetrics(names, 10)
    _accumulate(acc, pred, truth, last, 5)
    _accumulate(acc, pred[:1], truth[:1], last[:1], 3)  # a shorter trajectory
    d = acc.to_dict()
    assert d["steps"] == 5 and d["count"] == [3, 3, 3, 2, 2]
    with pytest.raises(ValueError, match="step 11"):
        acc.update(11, pred[:, 0], truth[:, 0], last)
    with pytest.raises(ValueError, match="C=2"):
        acc.update(1, pred[:, 0, :1], truth[:, 0, :1], last[:, :1])
    with pytest.raises(ValueError, match="merge"):
        acc.merge(RolloutMetrics(["u"], 10))


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    pred, truth, last = _random_rollout(4, 6, seed=0)
    part = slice(rank * 2, rank * 2 + 2)
    acc = _accumulate(RolloutMetrics(["u", "v"], 6), pred[part], truth[part], last[part], 6)
    acc.all_reduce()
    torch.save(acc.state(), f"{out_dir}/state{rank}.pt")
    dist.destroy_process_group()


def test_all_reduce_two_processes_equals_single(tmp_path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    pred, truth, last = _random_rollout(4, 6, seed=0)
    whole = _accumulate(RolloutMetrics(["u", "v"], 6), pred, truth, last, 6)
    for rank in range(2):
        state = torch.load(tmp_path / f"state{rank}.pt")
        torch.testing.assert_close(state["sum"], whole.sum, rtol=1e-12, atol=1e-12)
        assert torch.equal(state["count"], whole.count)
