"""Every config composes and every ``_target_`` in it instantiates."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.conftest import CONFIG_DIR

GROUPS = sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name != "hydra")
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONFIG_DIR / g).glob("*.yaml"))]
EXPERIMENTS = [p.stem for p in sorted((CONFIG_DIR / "experiment").glob("*.yaml"))]
NEEDS_GPU = {"gpu", "fsdp"}


def _instantiate_node(node, key: str, tmp_path):
    """Instantiate one composed node; models go on the meta device so 1.3B costs nothing."""
    if key == "model":
        with torch.device("meta"):
            model = instantiate(node)
        assert model.num_params() > 0
        return model
    if key == "trainer" and node.get("accelerator") == "gpu" and not torch.cuda.is_available():
        # A GPU trainer cannot start on CPU: instantiate its strategy, if it names one.
        strategy = node.get("strategy")
        return instantiate(strategy) if OmegaConf.is_dict(strategy) else None
    if key in ("logger", "callbacks"):
        return {name: instantiate(sub) for name, sub in node.items()}
    return instantiate(node)


def _overrides(tmp_path):
    return [f"paths.output_dir={tmp_path}", f"paths.data_dir={tmp_path}/data"]


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}/{o}" for g, o in OPTIONS])
def test_every_group_option_composes_and_instantiates(compose_cfg, tmp_path, group, option):
    if group in ("experiment", "debug"):
        cfg = compose_cfg("train", [f"{group}={option}", *_overrides(tmp_path)])
        assert cfg.model._target_ and cfg.data._target_
        return
    cfg = compose_cfg("train", [f"{group}={option}", *_overrides(tmp_path)])
    node = cfg.get(group)
    if node is None or (OmegaConf.is_dict(node) and len(node) == 0):
        assert option in ("none", "constant"), f"{group}/{option} composed to nothing"
        return
    _instantiate_node(node, group, tmp_path)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_instantiates(compose_cfg, tmp_path, experiment):
    cfg = compose_cfg("train", [f"experiment={experiment}", *_overrides(tmp_path)])
    OmegaConf.resolve(cfg)
    for key in ("model", "data", "optimizer", "lr_scheduler", "trainer", "logger", "callbacks"):
        node = cfg.get(key)
        if node:
            _instantiate_node(node, key, tmp_path)
    module = instantiate(cfg.module)
    assert callable(module)


def test_experiments_exist():
    assert {"quickstart", "multi", "finetune", "walrus_1b"} <= set(EXPERIMENTS)
