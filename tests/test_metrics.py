"""Metrics against hand-computed values and The Well's own package; window means; accumulators."""

from __future__ import annotations

import functools
import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from walrus.data.synthetic import SYSTEMS
from walrus.metrics import (
    ALL_METRICS,
    EPS,
    METRICS,
    SPECTRAL_BINS,
    RolloutMetrics,
    binned_spectral_mse,
    mse,
    nrmse,
    persistence,
    spectral_bin_edges,
    vrmse,
    window_means,
)


def test_vrmse_nrmse_mse_hand_computed() -> None:
    truth = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # (B=1, C=1, X=4): mean 2.5, ms 7.5
    pred = torch.tensor([[[1.0, 2.0, 3.0, 6.0]]])  # squared errors 0, 0, 0, 4 -> mse 1
    var = 5.0 / 3.0  # unbiased: sum of squared deviations 5 over N - 1 = 3
    assert mse(pred, truth).item() == pytest.approx(1.0)
    assert vrmse(pred, truth).item() == pytest.approx(math.sqrt(1.0 / (var + EPS)), rel=1e-6)
    assert nrmse(pred, truth).item() == pytest.approx(math.sqrt(1.0 / (7.5 + EPS)), rel=1e-6)
    # predicting the spatial mean scores sqrt((N - 1) / N) with the unbiased variance
    mean_pred = torch.full_like(truth, 2.5)
    assert vrmse(mean_pred, truth).item() == pytest.approx(math.sqrt(3 / 4), rel=1e-6)
    # float64 in, float64 out (no silent float32 rounding)
    assert vrmse(pred.double(), truth.double()).dtype == torch.float64
    with pytest.raises(ValueError, match="2 grid points"):
        vrmse(pred[..., :1], truth[..., :1])


def test_metrics_reduce_space_only_per_field() -> None:
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(2, 3, 4, 5, 6, generator=g)  # (B, T, C, H, W)
    pred = truth.clone()
    pred[:, :, 1] += 1.0  # only field 1 is wrong, by a constant 1 -> mse 1
    out = vrmse(pred, truth, n_spatial=2)
    assert out.shape == (2, 3, 4)
    assert torch.all(out[:, :, [0, 2, 3]] == 0)
    var = truth[:, :, 1].var(dim=(-2, -1), correction=1)
    torch.testing.assert_close(out[:, :, 1], (1.0 / (var + EPS)).sqrt())
    spec = binned_spectral_mse(pred, truth, n_spatial=2)
    assert spec.shape == (2, 3, 4, 3)
    assert torch.all(spec[:, :, [0, 2, 3]] == 0)
    # a constant offset is all in the mean mode, which the low bin holds
    assert torch.all(spec[:, :, 1, 0] > 1) and spec[:, :, 1, 1:].max() < 1e-12
    # inference of n_spatial assumes one leading axis: (B, C, H, W) -> 2 spatial axes
    torch.testing.assert_close(
        nrmse(pred[:, 0], truth[:, 0]), nrmse(pred[:, 0], truth[:, 0], n_spatial=2)
    )
    with pytest.raises(ValueError, match="shape"):
        vrmse(pred, truth[..., :3])
    with pytest.raises(ValueError, match="shape"):
        binned_spectral_mse(pred, truth[..., :3])


def test_spectral_bin_edges() -> None:
    edges = spectral_bin_edges((64, 64)).double()
    top = math.pi * math.sqrt(2) + 1e-6
    lowest = 2 * math.pi / 64
    assert edges[0] == 0 and edges[3].item() == pytest.approx(top, rel=1e-6)
    # e1, e2 split [2 pi / max(grid), top] in three equal log steps
    ratio = (top / lowest) ** (1 / 3)
    assert edges[1].item() == pytest.approx(lowest * ratio, rel=1e-6)
    assert edges[2].item() == pytest.approx(lowest * ratio**2, rel=1e-6)
    # the largest axis sets the lowest edge; d sets the top
    assert spectral_bin_edges((32, 128))[1] < spectral_bin_edges((32, 32))[1]
    assert spectral_bin_edges((16, 16, 16))[3].item() == pytest.approx(
        math.pi * math.sqrt(3) + 1e-6, rel=1e-6
    )
    with pytest.raises(ValueError, match="grid"):
        spectral_bin_edges((4, 4, 4, 4))


def test_binned_spectral_mse_known_values() -> None:
    n = 64
    x = torch.arange(n, dtype=torch.float64)
    edges = spectral_bin_edges((n,)).double()  # radians per cell

    def wave(m: int) -> torch.Tensor:
        return torch.cos(2 * math.pi * m * x / n).reshape(1, 1, n)  # (B, C, X)

    # one integer wavenumber per bin: |k| = 2 pi m / n
    low, mid, high = 1, 8, 24
    for m, b in ((low, 0), (mid, 1), (high, 2)):
        assert edges[b] <= 2 * math.pi * m / n < edges[b + 1]
    truth = 3.0 + wave(low) + wave(mid) + wave(high)
    assert binned_spectral_mse(truth, truth).abs().max().item() == 0.0
    # doubling the mid wave: residual = the mid wave, as much power as the truth holds there
    out = binned_spectral_mse(truth + wave(mid), truth)
    torch.testing.assert_close(out[0, 0], torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    # low bin: the mean (9) plus the low wave (1/2) hold the power; the wave alone is 1/19 of it
    out = binned_spectral_mse(truth - wave(low), truth)
    assert out[0, 0, 0].item() == pytest.approx(0.5 / (9.5 + EPS), rel=1e-12)
    # predicting zero scores 1 in every bin that holds power; a phase shift is an error too
    torch.testing.assert_close(
        binned_spectral_mse(torch.zeros_like(truth), truth)[0, 0],
        torch.ones(3, dtype=torch.float64),
        rtol=1e-6,
        atol=0,
    )
    assert binned_spectral_mse(torch.roll(truth, 1, dims=-1), truth)[0, 0, 2] > 0.5
    # residual power summed over the bins is the mse (Parseval; no mode left out)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 12, 10, 8, generator=g, dtype=torch.float64).unbind(0)
    sq = torch.fft.fftn(a, dim=(-3, -2, -1)).abs().square().flatten(-3) / (12 * 10 * 8) ** 2
    index = _exact_bins((12, 10, 8))
    true_power = torch.stack([sq[..., index == k].sum(-1) for k in range(3)], -1)  # (3, 3)
    spec = binned_spectral_mse(b.unsqueeze(0), a.unsqueeze(0), n_spatial=3)[0]  # (C, 3)
    torch.testing.assert_close(
        (spec * (true_power + EPS)).sum(-1), mse(b, a, n_spatial=3), rtol=1e-10, atol=0
    )


def _exact_bins(spatial: tuple[int, ...]) -> torch.Tensor:
    """Bin of every mode, from the edges and the exact wavenumbers (no edge ties on this grid)."""
    grids = torch.meshgrid(
        *[2 * math.pi * torch.fft.fftfreq(n, dtype=torch.float64) for n in spatial],
        indexing="ij",
    )
    k = torch.sqrt(sum(g.square() for g in grids)).flatten()
    return torch.bucketize(k, spectral_bin_edges(spatial).double(), right=True) - 1


def _import_the_well_metrics() -> SimpleNamespace:
    """The Well's metric classes; skips without the package, except under CI, where it fails."""
    if not os.environ.get("CI"):
        pytest.importorskip(
            "the_well.benchmark.metrics",
            reason="the-well is not installed (make install adds it: pip install --no-deps "
            "the-well==1.2.0)",
        )
    from the_well.benchmark.metrics import NRMSE, VRMSE
    from the_well.benchmark.metrics import binned_spectral_mse as well_bsm

    return SimpleNamespace(vrmse=VRMSE(), nrmse=NRMSE(), spectral=well_bsm())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "spatial",
    # 54, 32^2, 256^2 and 6^3 have modes on a bin edge to float rounding
    [(54,), (64,), (32, 32), (48, 40), (256, 256), (6, 6, 6), (12, 10, 8)],
)
def test_agrees_with_the_well(spatial: tuple[int, ...], dtype: torch.dtype) -> None:
    well = _import_the_well_metrics()
    g = torch.Generator().manual_seed(len(spatial) * 1000 + spatial[0])
    d = len(spatial)
    # (B, C, *spatial): smooth-ish fields with a mean, three fields of different scales
    truth = torch.randn(2, 3, *spatial, generator=g, dtype=torch.float64).cumsum(-1)
    truth = truth * torch.tensor([1.0, 1e-2, 30.0]).view(1, 3, *[1] * d) + 2.0
    pred = truth + 0.3 * truth.std() * torch.randn(truth.shape, generator=g, dtype=torch.float64)
    truth, pred = truth.to(dtype), pred.to(dtype)
    meta = SimpleNamespace(n_spatial_dims=d)  # all The Well's metrics read from its metadata

    def channels_last(x: torch.Tensor) -> torch.Tensor:  # The Well's layout (..., *spatial, C)
        return x.movedim(1, -1)

    ref = well.spectral(channels_last(pred), channels_last(truth), meta)
    ref_bins = torch.stack([ref[f"spectral_error_nmse_per_bin_{i}"] for i in range(3)], -1)
    pairs = [
        (vrmse(pred, truth), well.vrmse(channels_last(pred), channels_last(truth), meta)),
        (nrmse(pred, truth), well.nrmse(channels_last(pred), channels_last(truth), meta)),
        (binned_spectral_mse(pred, truth), ref_bins),
    ]
    # float32: The Well's FFT runs in float32, ours in float64, so its low-power bins carry
    # float32 rounding of the large modes (up to ~1e-5 relative here)
    rtol = 1e-6 if dtype == torch.float64 else 1e-4
    for ours, theirs in pairs:
        assert ours.shape == theirs.shape and ours.dtype == dtype
        torch.testing.assert_close(ours.double(), theirs.double(), rtol=rtol, atol=1e-12)


@functools.cache
def _solver_frames(system: str, regime: str, resolution: int, steps: int) -> torch.Tensor:
    """``(steps, C, *spatial)`` float64 frames of one trajectory of a built-in solver."""
    spec = SYSTEMS[system]
    params = {k: np.array([v]) for k, v in spec.regimes[regime].items()}
    sim = spec.simulate(params, resolution, steps, np.random.default_rng(0))
    parts = [torch.from_numpy(f[0]).unsqueeze(1) for f in sim.fields.values()]
    for v in sim.vector_fields.values():
        if v.ndim == spec.n_spatial + 3:  # (traj, T, *spatial, D): time-varying vector field
            parts.append(torch.from_numpy(np.moveaxis(v[0], -1, 1)))
    return torch.cat(parts, dim=1)


# (system, regime, resolution, steps): smooth fields from our solvers; Navier-Stokes is
# dealiased, so the modes beyond the 2/3 cut (the top shells) are empty
SOLVER_DATA = [
    ("navier_stokes_2d", "decaying", 64, 31),
    ("gray_scott_2d", "waves", 64, 31),
    ("shallow_water_2d", "bumps", 64, 31),
    ("advection_diffusion_3d", "abc", 32, 11),
]


def _noisy_and_persistence(
    frames: torch.Tensor, level: float
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-step metrics ``{metric: (S, C)}`` of truth + white noise and of the previous frame."""
    truth, last = frames[1:], frames[:-1]  # (S, C, *sp)
    axes = tuple(range(2, frames.ndim))
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(truth.shape, generator=g, dtype=truth.dtype)
    pred = truth + level * truth.std(dim=axes, keepdim=True) * noise

    def scores(x: torch.Tensor) -> dict[str, torch.Tensor]:
        spectral = binned_spectral_mse(x, truth)  # (S, C, 3)
        out = {"vrmse": vrmse(x, truth), "nrmse": nrmse(x, truth)}
        out.update({f"spectral_{b}": spectral[..., i] for i, b in enumerate(SPECTRAL_BINS)})
        return out

    return scores(pred), scores(last)


@pytest.mark.parametrize("system, regime, resolution, steps", SOLVER_DATA)
def test_near_exact_prediction_beats_persistence(
    system: str, regime: str, resolution: int, steps: int
) -> None:
    """Truth + tiny noise beats the previous frame on every metric, field, bin and step.

    The old spectral score (log-ratio of radial spectra) failed this on dealiased data: empty
    shells turned any noise there into a huge error.
    """
    frames = _solver_frames(system, regime, resolution, steps)
    if system == "navier_stokes_2d":  # the case in point: empty top shells
        power = torch.fft.fftn(frames, dim=(-2, -1)).abs().square()
        m = torch.fft.fftfreq(resolution, 1 / resolution).abs()
        beyond_cut = (m[:, None] >= resolution / 3) | (m[None, :] >= resolution / 3)
        assert power[..., beyond_cut].max() < 1e-20 * power.sum(dim=(-2, -1)).min()
    noisy, persist = _noisy_and_persistence(frames, 1e-4)
    for metric in METRICS:
        ratio = noisy[metric] / persist[metric]  # (S, C)
        assert ratio.max() < 0.5, (metric, ratio.amax(0).tolist())


@pytest.mark.parametrize("system, regime, resolution, steps", SOLVER_DATA)
def test_one_percent_white_noise_against_persistence(
    system: str, regime: str, resolution: int, steps: int
) -> None:
    """Truth + white noise of 1 % of each field's std against the previous frame.

    It wins on VRMSE, NRMSE and the low and mid bins, for every field and step. The high bin
    shows what it should: white noise puts 88 % of its power (1e-4 of the variance) there, while
    smooth, well-resolved fields may hold little power there and change little per step, so it
    is the noise's worst band. It wins there too where the band holds enough and moves:
    Navier-Stokes vorticity once the cascade has filled the band up to the dealiasing cut (step
    10 on), shallow water once the waves are under way (step 5 on). Right after the smooth
    Navier-Stokes start, the velocity's high band is nearly empty and the noise must lose.
    """
    frames = _solver_frames(system, regime, resolution, steps)
    noisy, persist = _noisy_and_persistence(frames, 1e-2)
    for metric in ("vrmse", "nrmse", "spectral_low", "spectral_mid"):
        ratio = noisy[metric] / persist[metric]  # (S, C)
        assert ratio.max() < 0.5, (metric, ratio.amax(0).tolist())
    high = noisy["spectral_high"] / persist["spectral_high"]  # (S, C)
    if system == "navier_stokes_2d":
        assert high[9:, 0].max() < 0.2, high[:, 0].tolist()  # vorticity
        assert high[0, 1:].min() > 10, high[0].tolist()  # velocity at step 1
    if system == "shallow_water_2d":
        assert high[4:].max() < 0.5, high.amax(0).tolist()


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
        prev_pred, prev_truth = (last, last) if s == 0 else (pred[:, s - 1], truth[:, s - 1])
        acc.update(s + 1, pred[:, s], truth[:, s], last, prev_pred=prev_pred, prev_truth=prev_truth)
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
    spec = binned_spectral_mse(pred[:, 6], truth[:, 6]).mean(dim=0)  # step 7, (C, 3)
    for i, b in enumerate(SPECTRAL_BINS):
        assert d["model"][f"spectral_{b}"]["per_step"]["u"][6] == pytest.approx(
            spec[0, i].item(), rel=1e-6
        )
        # 12 steps: the last window is labelled by the steps that ran
        assert list(d["model"][f"spectral_{b}"]["windows"]["u"]) == ["1", "2-10", "11-12"]
    assert d["windows"] == {"1": [1, 1], "2-10": [2, 10], "11-12": [11, 12]}
    v_steps = d["model"]["vrmse"]["per_step"]["v"]
    assert d["model"]["vrmse"]["windows"]["v"]["11-12"] == pytest.approx(sum(v_steps[10:]) / 2)
    assert list(d["model"]) == list(ALL_METRICS) and whole.sum.shape == (4, 10, steps, 2)
    assert d["spectral_bins"]["names"] == ["low", "mid", "high"]
    assert d["spectral_bins"]["grid"] == [8, 8]
    assert d["spectral_bins"]["edges"] == pytest.approx(spectral_bin_edges((8, 8)).tolist())
    json.dumps(d)  # JSON-able

    # two "processes" with two samples each, merged, equal the single run
    a = _accumulate(RolloutMetrics(names, steps), pred[:2], truth[:2], last[:2], steps)
    b = _accumulate(RolloutMetrics(names, steps), pred[2:], truth[2:], last[2:], steps)
    merged = a.merge(b.state())
    torch.testing.assert_close(merged.sum, whole.sum, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged.variation, whole.variation, rtol=1e-12, atol=0)
    assert torch.equal(merged.count, whole.count) and torch.equal(merged.defined, whole.defined)
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
    with pytest.raises(ValueError, match="grid"):
        acc.update(1, pred[:, 0, :, :4], truth[:, 0, :, :4], last[:, :, :4])
    assert RolloutMetrics(names, 3).to_dict()["spectral_bins"]["grid"] is None


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
        for key, value in whole.state().items():
            torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-12)


def test_spread_is_recorded_in_each_metrics_units_and_merges():
    from walrus.metrics import SPREAD, RolloutMetrics, nrmse, vrmse

    g = torch.Generator().manual_seed(0)
    truth = torch.randn(3, 2, 16, 16, generator=g)
    pred = truth + 0.1 * torch.randn(3, 2, 16, 16, generator=g)
    spread = 0.2 * torch.rand(3, 2, 16, 16, generator=g)
    whole = RolloutMetrics(["a", "b"], 2)
    parts = [RolloutMetrics(["a", "b"], 2) for _ in range(2)]
    for step in (1, 2):
        whole.update(step, pred, truth, truth, spread, prev_pred=truth, prev_truth=truth)
        for part, rows in zip(parts, (slice(0, 1), slice(1, None))):
            p, t, sp = pred[rows], truth[rows], spread[rows]
            part.update(step, p, t, t, sp, prev_pred=t, prev_truth=t)
    d = whole.to_dict()
    expected = vrmse(truth + spread, truth).mean(0)  # (C,)
    got = torch.tensor(
        [d[SPREAD]["vrmse"]["per_step"][f][0] for f in ("a", "b")], dtype=torch.float64
    )
    torch.testing.assert_close(got, expected.double(), rtol=1e-6, atol=1e-9)
    got_n = torch.tensor(
        [d[SPREAD]["nrmse"]["per_step"][f][1] for f in ("a", "b")], dtype=torch.float64
    )
    torch.testing.assert_close(
        got_n, nrmse(truth + spread, truth).mean(0).double(), rtol=1e-6, atol=1e-9
    )
    merged = parts[0].merge(parts[1]).to_dict()
    for f in ("a", "b"):
        assert merged[SPREAD]["vrmse"]["per_step"][f] == pytest.approx(
            d[SPREAD]["vrmse"]["per_step"][f]
        )
    # Without an ensemble there is no spread entry; model and persistence are unchanged by it.
    plain = RolloutMetrics(["a", "b"], 2)
    for step in (1, 2):
        plain.update(step, pred, truth, truth, prev_pred=truth, prev_truth=truth)
    p = plain.to_dict()
    assert SPREAD not in p and p["model"] == d["model"]
    with pytest.raises(ValueError, match="spread shape"):
        plain.update(1, pred, truth, truth, spread[:, :1])
