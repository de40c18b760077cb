"""Switching the dataset-level z-score on and off consistently across pretraining and fine-tuning:
a fine-tune keeps its checkpoint's kind of normalisation, says so when asked for the other one,
and a z-score fine-tune uses the statistics of its own data."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_train_overrides
from walrus.checkpoint import load_checkpoint_file
from walrus.data.normalization import RMSNormalizer, ZScoreNormalizer
from walrus.data.stats import load_stats
from walrus.training.train import train


def _run(compose_cfg, root, out, *extra, experiment="quickstart"):
    overrides = tiny_train_overrides(root, out, experiment)
    return train(compose_cfg("train", [*overrides, "trainer.limit_train_batches=1", *extra]))


def _finetune(compose_cfg, root, out, src, *extra):
    return _run(compose_cfg, root, out, f"init_from={src}", *extra, experiment="finetune")


def test_per_sample_checkpoint_refuses_a_zscore_finetune(compose_cfg, tiny_data_root, tmp_path):
    _run(compose_cfg, tiny_data_root, tmp_path / "pre")
    src = tmp_path / "pre" / "checkpoints" / "last.ckpt"
    with pytest.raises(ValueError, match="per-sample normalisation .RMSNormalizer.*drop data"):
        _finetune(compose_cfg, tiny_data_root, tmp_path / "ft", src, "data.normalization=zscore")
    _, objects = _finetune(compose_cfg, tiny_data_root, tmp_path / "ok", src)
    assert isinstance(objects["module"].normalizer, RMSNormalizer)


def test_zscore_finetune_uses_its_own_data_statistics(compose_cfg, tiny_data_root, tmp_path):
    _run(compose_cfg, tiny_data_root, tmp_path / "pre", "data.normalization=zscore")
    src = tmp_path / "pre" / "checkpoints" / "last.ckpt"
    stored = load_checkpoint_file(src)["walrus"]["normalizer"]["stats"]["mean"]
    assert "A" not in stored  # the pretraining data (Navier-Stokes) has no Gray-Scott fields
    with pytest.raises(ValueError, match="dataset-level z-score.*set data.normalization=zscore"):
        _finetune(compose_cfg, tiny_data_root, tmp_path / "ft", src)
    _, objects = _finetune(
        compose_cfg, tiny_data_root, tmp_path / "ok", src, "data.normalization=zscore"
    )
    normalizer = objects["module"].normalizer
    assert isinstance(normalizer, ZScoreNormalizer)
    own = load_stats(tiny_data_root / "gray_scott_2d" / "stats.yaml")
    assert normalizer.stats["mean"] == own["mean"] and set(own["mean"]) == {"A", "B"}
    saved = load_checkpoint_file(tmp_path / "ok" / "checkpoints" / "last.ckpt")["walrus"]
    assert saved["normalizer"]["stats"]["std"] == own["std"]  # inference de-normalises alike
