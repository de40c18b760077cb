"""Plots and animations are written, non-empty, atomically, for 1D, 2D and 3D fields."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from walrus.metrics import RolloutMetrics
from walrus.viz import (
    animation_frames,
    plot_error_curves,
    plot_fidelity,
    plot_snapshots,
    snapshot_limits,
    write_animation,
)

PNG_MAGIC = b"\x89PNG"


def _fields(
    spatial: tuple[int, ...], steps: int = 5, c: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(steps, c, *spatial, generator=g)
    return truth, truth + 0.1 * torch.randn(steps, c, *spatial, generator=g)


def _metrics(truth: torch.Tensor, pred: torch.Tensor) -> RolloutMetrics:
    """Accumulated metrics of one trajectory ``(S, C, *sp)`` against persistence of step 1."""
    acc = RolloutMetrics(["u", "v"], truth.shape[0])
    for s in range(truth.shape[0]):
        prev = (truth[:1], truth[:1]) if s == 0 else (pred[s - 1 : s], truth[s - 1 : s])
        acc.update(s + 1, pred[s : s + 1], truth[s : s + 1], truth[:1], prev_pred=prev[0],
                   prev_truth=prev[1])  # fmt: skip
    return acc


def _png_title(path: Path) -> str | None:
    from PIL import Image

    with Image.open(path) as im:
        return im.info.get("Title")


def test_plot_error_curves(tmp_path: Path) -> None:
    truth, pred = _fields((8, 8))
    acc = _metrics(truth, pred)
    out = plot_error_curves(acc.to_dict(), tmp_path / "vrmse.png", title="toy: trajectory 0")
    assert out == tmp_path / "vrmse.png"
    assert out.read_bytes()[:4] == PNG_MAGIC and out.stat().st_size > 1000
    assert _png_title(out) == "toy: trajectory 0"
    assert [p.name for p in tmp_path.iterdir()] == ["vrmse.png"]  # no temp file left
    with pytest.raises(ValueError, match="metric"):
        plot_error_curves(acc.to_dict(), tmp_path / "x.png", metric="bogus")
    # the binned spectral MSE: one panel per field and bin, or one bin alone
    spectral = plot_error_curves(acc.to_dict(), tmp_path / "spectral.png", metric="spectral")
    assert spectral.read_bytes()[:4] == PNG_MAGIC
    assert spectral.stat().st_size > out.stat().st_size  # 6 panels against 2
    high = plot_error_curves(acc.to_dict(), tmp_path / "high.png", metric="spectral_high")
    assert high.read_bytes()[:4] == PNG_MAGIC
    legacy = {**acc.to_dict(), "model": {"vrmse": acc.to_dict()["model"]["vrmse"]}}
    with pytest.raises(ValueError, match="spectral_low"):
        plot_error_curves(legacy, tmp_path / "y.png", metric="spectral")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["high.png", "spectral.png", "vrmse.png"]


def test_plot_fidelity_and_undefined_values(tmp_path: Path) -> None:
    truth, pred = _fields((8, 8))
    d = _metrics(truth, pred).to_dict()
    # a band with no true power anywhere (all null) is drawn as a gap, not an error
    for source in ("model", "persistence"):
        for key in ("power_ratio_high", "spectral_high"):
            block = d[source][key]
            block["per_step"] = {f: [None] * 5 for f in block["per_step"]}
            block["mean_over_fields"]["per_step"] = [None] * 5
    out = plot_fidelity(d, tmp_path / "fidelity.png", title="toy: 5 steps", dpi=50)
    assert out.read_bytes()[:4] == PNG_MAGIC and _png_title(out) == "toy: 5 steps"
    plot_error_curves(d, tmp_path / "spectral.png", metric="spectral", dpi=50)
    with pytest.raises(ValueError, match="fidelity"):
        plot_fidelity({"fields": ["u"], "model": {"vrmse": {}}}, tmp_path / "x.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fidelity.png", "spectral.png"]


def test_spread_row_has_its_own_colour_scale(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(3, 8, 8, generator=g).numpy()  # (K, H, W): the frames shown
    pred = truth + 2.0
    spread = 0.01 * torch.rand(3, 8, 8, generator=g).numpy()
    limits = snapshot_limits(truth, pred, spread)
    assert limits["spread"] == (0.0, pytest.approx(float(spread.max())))
    assert limits["error"] == (pytest.approx(-2.0), pytest.approx(2.0))
    assert limits["prediction"] == limits["truth"] == (float(truth.min()), float(truth.max()))
    assert "spread" not in snapshot_limits(truth, pred, None)
    t, p = _fields((8, 8))
    out = plot_snapshots(t, p, ["u", "v"], None, tmp_path / "snap.png", spread=0.01 * p.abs(),
                         title="toy: trajectory 0, steps 1-5, ensemble of 3")  # fmt: skip
    assert _png_title(out) == "toy: trajectory 0, steps 1-5, ensemble of 3"


@pytest.mark.parametrize("spatial", [(16,), (8, 8), (6, 6, 4)])
def test_plot_snapshots(tmp_path: Path, spatial: tuple[int, ...]) -> None:
    truth, pred = _fields(spatial)
    out = plot_snapshots(truth, pred.numpy(), ["u", "v"], None, tmp_path / "snap.png")
    assert out.read_bytes()[:4] == PNG_MAGIC and out.stat().st_size > 1000
    with pytest.raises(ValueError, match="steps"):
        plot_snapshots(truth, pred, ["u", "v"], [0, 9], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="field names"):
        plot_snapshots(truth, pred, ["u"], [1], tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


@pytest.mark.parametrize("spatial", [(16,), (8, 8)])
def test_write_animation_gif(tmp_path: Path, spatial: tuple[int, ...], monkeypatch) -> None:
    monkeypatch.setattr("walrus.viz.shutil.which", lambda name: None)  # force the Pillow path
    truth, pred = _fields(spatial, steps=7)
    out = write_animation(truth, pred, ["u", "v"], tmp_path / "rollout", max_frames=4)
    assert out == tmp_path / "rollout.gif"
    data = out.read_bytes()
    assert data[:6] in (b"GIF89a", b"GIF87a") and len(data) > 500
    from PIL import Image

    with Image.open(out) as im:
        assert im.n_frames == 4  # capped
    assert [p.name for p in tmp_path.iterdir()] == ["rollout.gif"]


def test_gif_frames_keep_the_figures_colours(tmp_path: Path, monkeypatch) -> None:
    """Each GIF frame reproduces the rendered figure (colour bars included) within a small
    error: the palette is fitted per frame, so colour maps keep their gradients."""
    from PIL import Image

    monkeypatch.setattr("walrus.viz.shutil.which", lambda name: None)
    truth, pred = _fields((32, 32), steps=3)
    rendered = animation_frames(truth, pred, ["u", "v"], title="toy")
    out = write_animation(truth, pred, ["u", "v"], tmp_path / "rollout", title="toy")
    with Image.open(out) as im:
        assert im.n_frames == len(rendered) == 3
        for i, want in enumerate(rendered):
            im.seek(i)
            got = np.asarray(im.convert("RGB"), dtype=float)
            assert got.shape == want.shape
            assert np.abs(got - want).mean() < 1.5, i  # of 255
            assert len(np.unique(got.reshape(-1, 3), axis=0)) > 64
    # a colour bar per image panel: 2 fields x (truth, prediction, error), each its own axes
    from walrus.viz import _Animation

    anim = _Animation(truth.numpy(), pred.numpy(), ["u", "v"], None)
    assert len(anim.fig.axes) == 2 * 3 * 2
    assert sum(ax.get_label() == "<colorbar>" for ax in anim.fig.axes) == 6


def test_import_has_no_matplotlib_side_effects() -> None:
    code = "import sys, walrus.viz; print('matplotlib' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_bad_array_shape(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="truth"):
        plot_snapshots(np.zeros((3, 4)), np.zeros((3, 4)), ["u"], None, tmp_path / "x.png")


def test_blitted_frames_match_a_full_redraw() -> None:
    """Frames after the first are blitted over a kept background; each matches the figure
    drawn from scratch at that step (within antialiasing), and the frames really change."""
    from walrus.viz import _Animation

    truth, pred = _fields((24, 24), steps=4)
    t, p = truth.numpy(), pred.numpy()
    anim = _Animation(t, p, ["u", "v"], "toy")
    frames = []
    for i in range(4):
        anim.show(i)
        frames.append(anim.rgb(72))
    for i in (0, 3):
        fresh = _Animation(t, p, ["u", "v"], "toy")
        fresh.show(i)
        fresh.fig.set_dpi(72)
        fresh.fig.canvas.draw()
        full = np.asarray(fresh.fig.canvas.buffer_rgba())[..., :3].astype(float)
        assert full.shape == frames[i].shape
        assert np.abs(full - frames[i]).mean() < 1.0, i  # of 255
    assert np.abs(frames[3].astype(float) - frames[0]).mean() > 5.0
