"""Shared test fixtures: config composition and tiny on-disk datasets."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

import walrus  # noqa: F401  (before any torch import, so its OpenMP wait policy applies)

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"


@pytest.fixture
def compose_cfg():
    """Compose a config from ``configs/`` with overrides: ``compose_cfg("train", [...])``."""

    def _compose(name: str = "train", overrides: list[str] | None = None):
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None  # an earlier in-process Hydra run's config
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose(config_name=name, overrides=overrides or [])

    yield _compose
    GlobalHydra.instance().clear()
    HydraConfig.instance().cfg = None


TINY_GEN = {"n_traj": [2, 1, 1], "resolution": 32, "steps": 12, "seed": 0}


@pytest.fixture(scope="session")
def tiny_data_root(tmp_path_factory) -> Path:
    """A data root with tiny Navier–Stokes and Gray–Scott datasets (32², 12 frames)."""
    from walrus.data.synthetic import generate

    root = tmp_path_factory.mktemp("data")
    for system in ("navier_stokes_2d", "gray_scott_2d"):
        generate(system, root, **{**TINY_GEN, "progress": False})
    return root


def tiny_train_overrides(
    data_root: Path, out_dir: Path, experiment: str = "quickstart"
) -> list[str]:
    """Overrides that make any experiment a seconds-long CPU run on the tiny datasets."""
    return [
        f"experiment={experiment}",
        "model=tiny",
        "trainer=cpu",
        f"paths.data_dir={data_root}",
        f"paths.output_dir={out_dir}",
        "data.batch_size=2",
        "data.max_val_windows=2",
        "data.batches_per_epoch=null",
        "data.generate_if_missing=false",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.max_epochs=1",
        # epochs end these runs (experiment=quickstart also caps steps at 600; a later
        # trainer.max_steps=N in a test's overrides wins)
        "trainer.max_steps=-1",
        "trainer.num_sanity_val_steps=0",
        "logger=csv",
        "callbacks.progress_bar=null",
    ]
