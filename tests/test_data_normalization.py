"""Normalisation inverts exactly; stats.yaml is computed by streaming and read back."""

import typing

import numpy as np
import pytest
import torch
import yaml

from walrus.data.normalization import (
    NORMALIZERS,
    MeanStdNormalizer,
    Normalizer,
    RMSNormalizer,
    ZScoreNormalizer,
    build_normalizer,
)
from walrus.data.stats import compute_stats, load_stats, main, write_stats
from walrus.data.well_dataset import WellDataset
from walrus.data.writer import write_well_file


def _dataset(root, seed=0):
    rng = np.random.default_rng(seed)
    p = (3.0 + 2.0 * rng.standard_normal((3, 9, 6, 5))).astype(np.float32)
    u = rng.standard_normal((3, 9, 6, 5, 2)).astype(np.float32)
    for i, split in enumerate(("train", "train", "valid")):
        write_well_file(
            root / "toy" / "data" / split / f"f{i}.hdf5",
            "toy",
            coords={"x": np.arange(6.0), "y": np.arange(5.0)},
            time=np.arange(9.0),
            n_trajectories=1,
            fields={"p": p[i : i + 1]},
            vector_fields={"u": u[i : i + 1]},
        )
    return p, u


def test_rms_normalisation_inverts():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 3, 8, 8) * torch.tensor([1.0, 10.0, 0.01]).view(1, 1, 3, 1, 1)
    s = RMSNormalizer().fit(x)
    assert torch.allclose(s.denormalize(s.normalize(x)), x, atol=1e-6, rtol=1e-6)
    d = x[:, 1:] - x[:, :-1]
    assert torch.allclose(s.denormalize_delta(s.normalize_delta(d)), d, atol=1e-6, rtol=1e-6)
    assert torch.allclose(
        s.normalize(x).square().mean(dim=(1, 3, 4)).sqrt(), torch.ones(2, 3), atol=1e-2
    )


def test_stats_stream_matches_numpy(tmp_path):
    p, u = _dataset(tmp_path)
    stats = compute_stats(tmp_path / "toy", max_bytes=4 * 3 * 30 * 2)  # 2 frames per read
    train_p = p[:2]
    assert stats["mean"]["p"] == pytest.approx(train_p.mean(), rel=1e-6)
    assert stats["std"]["p"] == pytest.approx(train_p.std(), rel=1e-5)
    assert stats["rms"]["u_y"] == pytest.approx(np.sqrt((u[:2, ..., 1] ** 2).mean()), rel=1e-5)
    dp = np.diff(train_p, axis=1)
    assert stats["std_delta"]["p"] == pytest.approx(dp.std(), rel=1e-5)
    assert stats["mean_delta"]["u_x"] == pytest.approx(
        np.diff(u[:2, ..., 0], axis=1).mean(), abs=1e-6
    )


def test_zscore_from_stats_yaml_inverts(tmp_path):
    _dataset(tmp_path)
    main([str(tmp_path / "toy")])
    stats = load_stats(tmp_path / "toy" / "stats.yaml")
    ds = WellDataset(tmp_path, "toy", "valid", 4, 1)
    x = ds[0].input_fields
    s = ZScoreNormalizer(stats).fit(x, ds.field_names)
    assert s.shift[0, 0, 0, 0, 0].item() == pytest.approx(stats["mean"]["p"], rel=1e-6)
    assert torch.allclose(s.denormalize(s.normalize(x)), x, atol=1e-5)
    d = x[:, 1:] - x[:, :-1]
    assert torch.allclose(s.denormalize_delta(s.normalize_delta(d)), d, atol=1e-6)


def test_load_real_well_style_stats(tmp_path):
    path = tmp_path / "stats.yaml"
    path.write_text(yaml.safe_dump({"mean": {"rho": 1.0, "v": [0.1, 0.2], "S": [[1, 2], [3, 4]]}}))
    stats = load_stats(path)
    assert stats["mean"] == {
        "rho": 1.0,
        "v_x": 0.1,
        "v_y": 0.2,
        "S_xx": 1,
        "S_xy": 2,
        "S_yx": 3,
        "S_yy": 4,
    }
    with pytest.raises(FileNotFoundError, match="walrus.data.stats"):
        load_stats(tmp_path / "missing.yaml")


def test_write_stats_is_atomic(tmp_path):
    _dataset(tmp_path)
    path = write_stats(tmp_path / "toy")
    assert [q.name for q in (tmp_path / "toy").iterdir() if q.is_file()] == ["stats.yaml"]
    assert set(yaml.safe_load(path.read_text())) == {
        "mean",
        "std",
        "rms",
        "mean_delta",
        "std_delta",
        "rms_delta",
    }


def test_mean_std_normalisation_matches_hand_formula_and_inverts():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 3, 8, 8) * 3 + 5  # (B, T, C, H, W)
    stats = MeanStdNormalizer(eps=1e-4).fit(x)
    mean = x.mean(dim=(1, 3, 4), keepdim=True)
    std = x.std(dim=(1, 3, 4), keepdim=True, correction=0)
    torch.testing.assert_close(stats.normalize(x), (x - mean) / (std + 1e-4))
    d = x[:, 1:] - x[:, :-1]
    d_mean = d.mean(dim=(1, 3, 4), keepdim=True)
    d_std = d.std(dim=(1, 3, 4), keepdim=True, correction=0)
    torch.testing.assert_close(stats.normalize_delta(d), (d - d_mean) / (d_std + 1e-4))
    torch.testing.assert_close(stats.denormalize(stats.normalize(x)), x)
    torch.testing.assert_close(stats.denormalize_delta(stats.normalize_delta(d)), d)


@pytest.mark.parametrize(
    "normalizer",
    [
        RMSNormalizer(eps=1e-3),
        RMSNormalizer(delta="state"),
        MeanStdNormalizer(eps=1e-2),
        ZScoreNormalizer({"mean": {"a": 1.0}, "std": {"a": 2.0}}),
    ],
)
def test_normalizer_config_round_trips(normalizer):
    rebuilt = build_normalizer(normalizer.config())
    assert type(rebuilt) is type(normalizer) and rebuilt.config() == normalizer.config()
    x = torch.randn(1, 2, 1, 4, 4)
    a, b = normalizer.fit(x, ["a"]), rebuilt.fit(x, ["a"])
    torch.testing.assert_close(a.normalize(x), b.normalize(x))


def test_build_normalizer_defaults_to_rms_and_refuses_other_targets():
    assert isinstance(build_normalizer(None), RMSNormalizer)
    with pytest.raises(ValueError, match="unknown normaliser 'os.system'"):
        build_normalizer({"_target_": "os.system", "command": "true"})


def test_rms_delta_in_state_units_ignores_the_windows_own_changes():
    torch.manual_seed(0)
    t = torch.arange(4.0).view(1, 4, 1, 1, 1)
    x = torch.randn(2, 1, 3, 8, 8) + 0.01 * t  # slow change: deltas of 0.01
    noisy = x.clone()
    noisy[:, -1] += 0.05 * torch.randn_like(x[:, -1])  # a bad last frame, as in a rollout
    window, state = RMSNormalizer(), RMSNormalizer(delta="state")
    s = state.fit(x)
    torch.testing.assert_close(s.delta_scale, s.scale)
    # the window unit follows the bad frame; the state unit barely moves
    grow_window = (window.fit(noisy).delta_scale / window.fit(x).delta_scale).min()
    grow_state = (state.fit(noisy).delta_scale / s.delta_scale).max()
    assert grow_window > 1.5 and grow_state < 1.2
    with pytest.raises(ValueError, match="delta must be one of"):
        RMSNormalizer(delta="global")


def test_normalizer_alias_names_every_normaliser():
    assert set(typing.get_args(Normalizer)) == set(NORMALIZERS.values())


@pytest.mark.parametrize(
    "normalizer",
    [
        RMSNormalizer(),
        MeanStdNormalizer(),
        ZScoreNormalizer({"mean": {"a": 1.0, "b": -2.0}, "std": {"a": 2.0, "b": 0.5}}),
    ],
    ids=["rms", "meanstd", "zscore"],
)
def test_next_frame_inverts_the_training_targets(normalizer):
    g = torch.Generator().manual_seed(0)
    window = torch.randn(2, 3, 2, 5, 4, generator=g, dtype=torch.float64) + 3.0  # (B, T, C, H, W)
    nxt = torch.randn(2, 1, 2, 5, 4, generator=g, dtype=torch.float64)  # (B, 1, C, H, W)
    stats = normalizer.fit(window, ["a", "b"])
    last = window[:, -1:]
    delta_target = stats.normalize_delta(nxt - last)
    torch.testing.assert_close(stats.next_frame(last, delta_target, True), nxt)
    torch.testing.assert_close(stats.next_frame(last, stats.normalize(nxt), False), nxt)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"_target_": "walrus.data.normalization.RMSNormalizer", "eps": "abc"}, "eps must be"),
        ({"_target_": "walrus.data.normalization.RMSNormalizer", "eps": True}, "eps must be"),
        ({"_target_": "walrus.data.normalization.MeanStdNormalizer", "eps": -1.0}, "eps must be"),
        ({"_target_": "walrus.data.normalization.RMSNormalizer", "scale": 2}, "no option"),
        (
            {"_target_": "walrus.data.normalization.ZScoreNormalizer", "stats": {"mean": 1}},
            "section 'mean'",
        ),
        (
            {
                "_target_": "walrus.data.normalization.ZScoreNormalizer",
                "stats": {"mean": {"u": "0"}, "std": {"u": 1.0}},
            },
            "entry 'u' must be a number",
        ),
    ],
)
def test_normalizer_options_read_from_a_file_are_validated(config, match):
    """A checkpoint's normaliser entry is data: wrong kinds are named before anything runs."""
    with pytest.raises(ValueError, match=match):
        build_normalizer(config)


@pytest.mark.parametrize(
    "normalizer", [RMSNormalizer(), MeanStdNormalizer()], ids=["rms", "meanstd"]
)
def test_per_sample_statistics_share_one_scale_and_round_trip(normalizer):
    """Systems of very different scales normalise to the same numbers, and each comes back
    exactly (float32) from its own statistics."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 4, 2, 8, 8, generator=g) + 0.5  # (1, T, C, H, W)
    x = torch.cat([base * 0.1, base * 1e3])  # two samples, four orders of magnitude apart
    nxt = torch.cat([base[:, -1:] * 0.1, base[:, -1:] * 1e3]) * 1.1  # (2, 1, C, H, W)
    stats = normalizer.fit(x)
    xn = stats.normalize(x)
    torch.testing.assert_close(xn[0], xn[1], rtol=2e-3, atol=2e-3)  # eps 1e-4 against 0.1
    d = nxt - x[:, -1:]
    back = stats.denormalize(xn), stats.denormalize_delta(stats.normalize_delta(d))
    frame = stats.next_frame(x[:, -1:], stats.normalize_delta(d), True)
    for i in range(2):  # float32 rounding of each sample's own size
        tol = 1e-6 * x[i].abs().max().item()
        torch.testing.assert_close(back[0][i], x[i], rtol=0.0, atol=tol)
        torch.testing.assert_close(back[1][i], d[i], rtol=0.0, atol=tol)
        torch.testing.assert_close(frame[i], nxt[i], rtol=0.0, atol=tol)
