"""Plots and animations are written, non-empty, atomically, for 1D, 2D and 3D fields."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from walrus.metrics import RolloutMetrics
from walrus.viz import plot_error_curves, plot_snapshots, write_animation

PNG_MAGIC = b"\x89PNG"


def _fields(
    spatial: tuple[int, ...], steps: int = 5, c: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(steps, c, *spatial, generator=g)
    return truth, truth + 0.1 * torch.randn(steps, c, *spatial, generator=g)


def test_plot_error_curves(tmp_path: Path) -> None:
    truth, pred = _fields((8, 8))
    acc = RolloutMetrics(["u", "v"], 5)
    for s in range(5):
        acc.update(s + 1, pred[s : s + 1], truth[s : s + 1], truth[:1])
    out = plot_error_curves(acc.to_dict(), tmp_path / "vrmse.png")
    assert out == tmp_path / "vrmse.png"
    assert out.read_bytes()[:4] == PNG_MAGIC and out.stat().st_size > 1000
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


def test_import_has_no_matplotlib_side_effects() -> None:
    code = "import sys, walrus.viz; print('matplotlib' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_bad_array_shape(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="truth"):
        plot_snapshots(np.zeros((3, 4)), np.zeros((3, 4)), ["u"], None, tmp_path / "x.png")
