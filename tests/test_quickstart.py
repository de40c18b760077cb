"""The quickstart experiment, in full: it must beat persistence by 2x on validation (slow, ~6 min)."""

from __future__ import annotations

import pytest

from walrus.training.train import train


@pytest.mark.slow
def test_quickstart_beats_persistence_twice(compose_cfg, tmp_path):
    cfg = compose_cfg(
        "train",
        [
            "experiment=quickstart",
            f"paths.output_dir={tmp_path / 'run'}",
            f"paths.data_dir={tmp_path / 'data'}",
            "callbacks.progress_bar=null",
        ],
    )
    metrics, _ = train(cfg)
    assert metrics["val/vrmse"] * 2 <= metrics["val/vrmse_persistence"], metrics
