"""Spectral fixes for patch seams: the filter on predicted deltas (model option) and the
rollout's per-shell change limit (``spectral_limit``), with their infer.py options."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.test_ensemble_training import TINY as ENSEMBLE_TINY
from tests.test_ensemble_training import _inputs
from tests.test_infer import TINY as INFER_TINY
from tests.test_infer import base_overrides, compose_infer, toy, write_checkpoint  # noqa: F401
from walrus.inference import run
from walrus.inference.loading import DEFAULT_SPECTRAL_LIMIT, load_inference_checkpoint
from walrus.model.config import WalrusConfig
from walrus.model.walrus import Walrus
from walrus.nn.spectral import EMPTY_SHELL, filter_gain, limit_spectral_change, spectral_filter
from walrus.rollout import predict_next, rollout

TINY = {**ENSEMBLE_TINY, "jitter": False}


def _wave(n: int, cycles: float) -> torch.Tensor:
    return torch.cos(2 * math.pi * cycles * torch.arange(n, dtype=torch.float64) / n)


def test_filter_keeps_modes_below_the_cutoff_and_removes_the_nyquist_mode():
    low, nyquist = _wave(64, 3), _wave(64, 32)  # eta 3/32 and 1
    y = (low + nyquist).view(1, 1, 64)
    out = spectral_filter(y, 0.5, 8)
    torch.testing.assert_close(out.view(-1), low, atol=1e-12, rtol=0)
    mid = _wave(64, 24).view(1, 1, 64)  # eta 0.75: damped, not removed
    ratio = spectral_filter(mid, 0.5, 8).norm() / mid.norm()
    assert ratio.item() == pytest.approx(math.exp(-36 * 0.5**8), rel=1e-9)


def test_gain_is_isotropic_and_falls_with_the_wavenumber():
    gain = filter_gain([16, 16], 0.25, 4)  # (16, 9)
    assert gain.shape == (16, 9)
    assert gain[0, 0] == 1 and gain[0, 8] < 1e-15  # the Nyquist mode along one axis
    assert gain[3, 4] == pytest.approx(gain[4, 3].item())  # |k| alone decides
    along = gain[0, :]
    assert torch.all(along[1:] <= along[:-1])


def test_a_non_periodic_axis_is_mirrored_so_its_ends_stay_apart():
    ramp = torch.linspace(0, 1, 64, dtype=torch.float64).view(1, 1, 64)
    wall = spectral_filter(ramp, 0.5, 8, [False])
    wrapped = spectral_filter(ramp, 0.5, 8, [True])
    # wrapping joins 1 to 0: the jump is smeared into both ends; mirroring leaves the ramp
    assert (wall - ramp).abs().max() < 1e-3 < (wrapped - ramp).abs().max()


def test_filter_keeps_shape_dtype_and_size_one_axes():
    y = torch.randn(2, 3, 16, 1, dtype=torch.bfloat16)
    out = spectral_filter(y, 0.6, 8, [True, True])
    assert out.shape == y.shape and out.dtype == torch.bfloat16
    flat = torch.randn(2, 3, 1)
    assert spectral_filter(flat, 0.6, 8) is flat
    with pytest.raises(ValueError, match="periodic has 1 entries for 2 spatial axes"):
        spectral_filter(y, 0.6, 8, [True])


def test_the_model_option_filters_its_deltas_and_adds_no_weights():
    torch.manual_seed(0)
    plain = Walrus(**TINY).eval()
    torch.manual_seed(0)
    filtered = Walrus(**TINY, output_filter=0.4).eval()
    assert set(plain.state_dict()) == set(filtered.state_dict())
    with torch.no_grad():
        y, y_f = plain(*_inputs()), filtered(*_inputs())  # (B, T, C, H, W)
    want = spectral_filter(y.flatten(0, 1), 0.4, 8).view_as(y)
    torch.testing.assert_close(y_f, want, atol=1e-5, rtol=1e-5)
    assert (y_f - y).abs().max() > 1e-3  # the unfiltered deltas had fine scales
    plain.set_output_filter(0.4)
    assert plain.config.output_filter == 0.4
    with torch.no_grad():
        torch.testing.assert_close(plain(*_inputs()), y_f)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"output_filter": 1.0}, "output_filter must be 0"),
        ({"output_filter": -0.2}, "output_filter must be 0"),
        ({"output_filter": 0.5, "output_filter_order": 3}, "output_filter_order must be an even"),
    ],
)
def test_bad_filter_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WalrusConfig(**TINY, **kwargs)


def test_the_filter_option_round_trips_through_the_config_dict():
    cfg = WalrusConfig(**TINY, output_filter=0.5, output_filter_order=4)
    back = WalrusConfig.from_dict(cfg.to_dict())
    assert (back.output_filter, back.output_filter_order) == (0.5, 4)


def test_infer_output_filter_option(toy, tmp_path: Path) -> None:  # noqa: F811
    """``output_filter=c`` rolls a checkpoint out with the filter, recorded in metrics.json."""
    patch = {**INFER_TINY, "encoder": "patch", "kernel_sizes": [4, 2]}
    ckpt = write_checkpoint(tmp_path / "patch.ckpt", toy["data"], config=patch)
    common = [*base_overrides(toy, tmp_path), "steps=2", "trajectories=0", "plots=false"]
    common += [f"ckpt_path={ckpt}", "jitter=false"]
    got = {
        name: run(compose_infer([*common, *extra, f"out={tmp_path / name}"]))["metrics"]
        for name, extra in (("plain", []), ("filtered", ["output_filter=0.3"]))
    }
    assert got["plain"]["output_filter"] == 0.0 and got["filtered"]["output_filter"] == 0.3
    v = [
        got[name]["datasets"]["toy"]["metrics"]["model"]["vrmse"]["per_step"]["u"][0]
        for name in ("plain", "filtered")
    ]
    assert v[1] != v[0]
    for bad in ("output_filter=1.5", "output_filter=true", "output_filter=abc"):
        with pytest.raises(ValueError, match="option output_filter must be"):
            run(compose_infer([*common, bad, f"out={tmp_path / 'x'}"]))


def _plane(n: int, kx: int, ky: int) -> torch.Tensor:
    """``cos(2 pi (kx x + ky y) / n)`` as ``(1, 1, n, n)`` float64 (one shell, ``|k| n``)."""
    x = torch.arange(n, dtype=torch.float64)
    return torch.cos(2 * math.pi * (kx * x[:, None] + ky * x[None, :]) / n)[None, None]


def test_a_change_within_the_limit_is_kept_and_one_beyond_it_is_scaled_to_it():
    last = _plane(32, 3, 4) + 0.5 * _plane(32, 1, 0)  # shells 5 and 1
    small = last + 0.8 * _plane(32, 3, 4)  # 0.8 of shell 5's amplitude: within ratio 1
    torch.testing.assert_close(limit_spectral_change(last, small, 1.0), small, atol=1e-12, rtol=0)
    big = last + 3.0 * _plane(32, 4, 3) + 0.1 * _plane(32, 1, 0)  # 3x shell 5, 0.2x shell 1
    got = limit_spectral_change(last, big, 1.0)
    want = last + 1.0 * _plane(32, 4, 3) + 0.1 * _plane(32, 1, 0)  # shell 5 cut to 1x
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # a larger ratio lets the same change through
    torch.testing.assert_close(limit_spectral_change(last, big, 3.5), big, atol=1e-12, rtol=0)


def test_grid_scale_noise_on_a_smooth_field_is_held_to_the_empty_shell_floor():
    last = _plane(32, 2, 1)  # (1, 1, 32, 32), one smooth shell
    seams = 1e-2 * _plane(32, 16, 0)  # the Nyquist mode of axis 0: a shell `last` lacks
    got = limit_spectral_change(last, last + 0.3 * _plane(32, 2, 1) + seams, 1.0)
    left = got - last - 0.3 * _plane(32, 2, 1)  # what remains of the noise
    # shell 16 is empty in `last`: the noise keeps at most the floor's power there, EMPTY_SHELL
    # of the field's mean power per mode times the shell's modes (fewer than 128 of 1024)
    floor_rms = (EMPTY_SHELL * 128 / 1024 * last.square().mean()).sqrt()
    assert 0 < left.square().mean().sqrt() <= floor_rms < 0.05 * seams.square().mean().sqrt()
    # the mean is never limited, and a flat field not at all
    shifted = limit_spectral_change(last, last + 7.0, 0.1)
    torch.testing.assert_close(shifted, last + 7.0, atol=1e-12, rtol=0)
    flat, noise = torch.zeros(1, 1, 16, 16), torch.randn(1, 1, 16, 16)
    torch.testing.assert_close(limit_spectral_change(flat, noise, 0.1), noise)


def test_a_wall_axis_is_mirrored_and_shapes_and_errors_are_kept():
    ramp = torch.linspace(0, 1, 32, dtype=torch.float64).view(1, 1, 32, 1).expand(1, 1, 32, 8)
    ramp = ramp.contiguous()
    # a steeper ramp is a change in the ramp's own shells: allowed on a wall axis (mirrored),
    # while wrapping would see the ramp's jump and the change's jump alike: also allowed
    steeper = 1.5 * ramp
    torch.testing.assert_close(
        limit_spectral_change(ramp, steeper, 1.0, [False, True]), steeper, atol=1e-9, rtol=0
    )
    y = torch.randn(2, 3, 16, 1)
    assert limit_spectral_change(y, y + 1, 1.0, [False, True]).shape == (2, 3, 16, 1)
    with pytest.raises(ValueError, match="ratio must be > 0"):
        limit_spectral_change(y, y, 0.0)
    with pytest.raises(ValueError, match="differ in shape"):
        limit_spectral_change(y, y[:1], 1.0)


class _Seams(torch.nn.Module):
    """Predicts a smooth delta plus a patch-grid pattern (period 4) in normalised units."""

    patch = True

    def forward(self, x, fields, bcs, *, jitter_seed=None):  # noqa: ANN001
        last = x[:, -1:]  # (B, 1, C, H, W)
        grid = torch.zeros_like(last)
        grid[..., ::4, :] = 1.0
        return 0.1 * last + grid


def _smooth_batch():
    from walrus.data.batch import Batch

    frames = torch.stack([_plane(16, 1, 1)[0] * (1 + 0.1 * t) for t in range(3)])  # (3,1,16,16)
    x = frames.float().unsqueeze(0)  # (1, 3, 1, 16, 16)
    return Batch(x, x[:, :0], torch.tensor([0]), torch.full((2, 2), 2))


def test_predict_next_applies_the_limit_to_the_predicted_frame():
    batch = _smooth_batch()
    args = (_Seams(), batch.input_fields, batch.field_ids, batch.bcs)
    free = predict_next(*args)
    limited = predict_next(*args, spectral_limit=1.0)
    last = batch.input_fields[:, -1]
    torch.testing.assert_close(limited, limit_spectral_change(last, free, 1.0, [True, True]))
    high = lambda y: torch.fft.rfft2(y)[..., 4:, :].abs().sum()  # noqa: E731
    assert high(limited - last) < 0.02 * high(free - last)  # the seams are gone
    with pytest.raises(ValueError, match="spectral_limit must be a finite number >= 0"):
        next(rollout(_Seams(), batch, 1, spectral_limit=-1.0))
    # a bare model rolls out without a limit unless asked
    torch.testing.assert_close(next(rollout(_Seams(), batch, 1)), free)


def test_infer_spectral_limit_option_and_default(toy, tmp_path: Path) -> None:  # noqa: F811
    """A patch checkpoint rolls out with DEFAULT_SPECTRAL_LIMIT, a conv one without; the option
    overrides it; metrics.json records it."""
    patch = {**INFER_TINY, "encoder": "patch", "kernel_sizes": [4, 2]}
    patch_ckpt = write_checkpoint(tmp_path / "patch.ckpt", toy["data"], config=patch)
    assert load_inference_checkpoint(patch_ckpt).default_spectral_limit() == DEFAULT_SPECTRAL_LIMIT
    assert load_inference_checkpoint(toy["ckpt"]).default_spectral_limit() == 0.0
    common = [*base_overrides(toy, tmp_path), "steps=2", "trajectories=0", "plots=false"]
    got = {
        name: run(compose_infer([*common, *extra, f"out={tmp_path / name}"]))["metrics"]
        for name, extra in (
            ("patch", [f"ckpt_path={patch_ckpt}"]),
            ("patch_off", [f"ckpt_path={patch_ckpt}", "spectral_limit=0"]),
            ("conv", []),
            ("conv_on", ["spectral_limit=0.5"]),
        )
    }
    assert got["patch"]["spectral_limit"] == DEFAULT_SPECTRAL_LIMIT > 0
    assert got["patch_off"]["spectral_limit"] == 0 and got["conv"]["spectral_limit"] == 0
    assert got["conv_on"]["spectral_limit"] == 0.5
    for bad in ("spectral_limit=-1", "spectral_limit=true", "spectral_limit=inf"):
        with pytest.raises(ValueError, match="option spectral_limit must be"):
            run(compose_infer([*common, bad, f"out={tmp_path / 'x'}"]))
