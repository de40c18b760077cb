"""Plot layout: titles fit the figure, legends cover no window label; the per-field fidelity
and rank-histogram plots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from walrus.metrics import RolloutMetrics
from walrus.viz import (
    error_curves_figure,
    fidelity_figure,
    plot_fidelity_fields,
    plot_rank_histogram,
)

LONG_TITLE = (
    "navier_stokes_2d: 12 trajectories [0, 1, ..., 11], 76 steps, mean of 4 jitter draws per step"
)


def _metrics(fields: list[str], steps: int = 12, members: int = 1) -> dict:
    g = torch.Generator().manual_seed(0)
    acc = RolloutMetrics(fields, steps, members=members)
    c = len(fields)
    truth = torch.randn(steps, 2, c, 8, 8, generator=g)
    for s in range(steps):
        ens = truth[s] + 0.3 * torch.randn(max(members, 2), 2, c, 8, 8, generator=g)
        kwargs = {"members": ens} if members > 1 else {}
        acc.update(s + 1, ens.mean(0), truth[s], truth[0], **kwargs)
    return acc.to_dict()


def _extent(fig, artist):
    return artist.get_window_extent(fig.canvas.get_renderer())


def test_single_field_title_fits_the_figure() -> None:
    fig = error_curves_figure(_metrics(["vorticity"]), "vrmse", title=LONG_TITLE)
    fig.canvas.draw()
    box, page = _extent(fig, fig._suptitle), fig.bbox
    assert box.x0 >= page.x0 and box.x1 <= page.x1  # not clipped left or right
    assert fig._suptitle.get_text().replace("\n", " ") == LONG_TITLE


@pytest.mark.parametrize("make", [fidelity_figure, error_curves_figure])
def test_legend_covers_no_window_label(make) -> None:
    fig = make(_metrics(["u", "v"]), title="toy")
    fig.canvas.draw()
    legend = fig.legends[0]
    labels = [t for ax in fig.axes for t in ax.texts if t.get_text() in ("1", "2-10", "11-12")]
    assert len(labels) >= 3
    box = _extent(fig, legend)
    assert not any(box.overlaps(_extent(fig, t)) for t in labels)
    assert all(ax.get_legend() is None for ax in fig.axes)  # no legend inside a panel


def test_spatial_mean_curve_on_error_plot() -> None:
    fig = error_curves_figure(_metrics(["u"]), "vrmse")
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert labels == ["model", "persistence", "spatial mean"]


def test_fidelity_fields_and_rank_histogram_plots(tmp_path: Path) -> None:
    d = _metrics(["u", "v", "w"], members=3)
    out = plot_fidelity_fields(d, tmp_path / "fidelity_fields.png", title="toy", dpi=40)
    assert out.read_bytes()[:4] == b"\x89PNG"
    ranks = plot_rank_histogram(d, tmp_path / "rank_histogram.png", title="toy", dpi=40)
    assert ranks.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="ensemble=2 or more"):
        plot_rank_histogram(_metrics(["u"]), tmp_path / "x.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fidelity_fields.png",
        "rank_histogram.png",
    ]
