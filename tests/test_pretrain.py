"""experiment=pretrain, the model card, fine-tune vs scratch with one recipe, and the transfer
benchmark (tiny sizes, in-process)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from tests.conftest import REPO, tiny_train_overrides
from walrus.checkpoint import load_checkpoint_file
from walrus.data.synthetic import SYSTEMS
from walrus.training.model_card import COST_KEY, model_preset, write_model_card
from walrus.training.resume import resume_overrides
from walrus.training.train import train

TWO = "data.datasets=[{name:navier_stokes_2d,weight:1.0},{name:gray_scott_2d,weight:1.0}]"


def _tiny_pretrain(data_root, out, *extra):
    """experiment=pretrain on the two tiny datasets, tiny model; ``extra`` overrides win."""
    keep = [o for o in tiny_train_overrides(data_root, out, "pretrain") if "max_epochs" not in o]
    return [*keep, TWO, *extra]


def test_pretrain_config_balances_all_nine_systems_under_a_time_budget(compose_cfg):
    cfg = compose_cfg("train", ["experiment=pretrain"])
    specs = list(cfg.data.datasets)
    assert sorted(s.name for s in specs) == sorted(SYSTEMS) and len(SYSTEMS) == 9
    assert len({s.weight for s in specs}) == 1  # equal draws per system
    assert {SYSTEMS[s.name].n_spatial for s in specs} == {1, 2, 3}
    assert cfg.data.generate_if_missing is True
    assert cfg.trainer.max_time == "00:00:25:00"
    assert cfg.trainer.max_steps == -1 and cfg.trainer.max_epochs == -1  # time alone ends it
    small = yaml.safe_load((REPO / "configs" / "model" / "small.yaml").read_text())
    assert {k: cfg.model[k] for k in small} == small
    # scratch and fine-tune share the preset of pretraining
    scratch = compose_cfg("train", ["experiment=finetune", "finetune.enabled=false"])
    assert scratch.model == cfg.model


def test_time_budget_schedule_ends_at_the_floor(compose_cfg, tiny_data_root, tmp_path):
    overrides = _tiny_pretrain(
        tiny_data_root, tmp_path, "trainer.max_time=2", "trainer.limit_train_batches=null"
    )
    _, objects = train(compose_cfg("train", overrides))
    module, trainer = objects["module"], objects["trainer"]
    assert trainer.global_step >= 1
    peak = float(compose_cfg("train", overrides).optimizer.lr)
    floor = peak * float(compose_cfg("train", overrides).lr_scheduler.min_ratio)
    assert module.lr_schedulers().get_last_lr()[0] == pytest.approx(floor)


def test_model_card_of_a_tiny_run(compose_cfg, tiny_data_root, tmp_path):
    run = tmp_path / "run"
    overrides = _tiny_pretrain(tiny_data_root, run, "trainer.max_steps=2")
    _, objects = train(compose_cfg("train", overrides))
    ckpt = load_checkpoint_file(run / "checkpoints" / "last.ckpt")
    assert COST_KEY in ckpt["callbacks"]

    md, js = write_model_card(run, max_windows=4, steps=5)
    card = json.loads(js.read_text())
    systems = card["data"]["systems"]
    assert list(systems) == ["navier_stokes_2d", "gray_scott_2d"]
    assert systems["gray_scott_2d"]["fields"] == ["A", "B"]
    assert systems["navier_stokes_2d"]["boundaries"] == ["periodic/periodic"] * 2
    assert systems["navier_stokes_2d"]["resolution"] == [32, 32]
    assert systems["navier_stokes_2d"]["trajectories"] == {"train": 2, "valid": 1, "test": 1}
    assert card["budget"]["steps"] == 2 and card["budget"]["cpu_s"] > 0
    assert card["budget"]["threads"] == torch.get_num_threads()
    model = objects["module"].model
    assert card["model"]["preset"] == "tiny"
    assert card["model"]["params"] == sum(p.numel() for p in model.parameters())
    for name in systems:
        v = card["validation"][name]
        assert v["rollout_steps"] == 5 and v["rollout_trajectories"] == 1
        assert math.isfinite(v["one_step_vrmse"]["model"])
        assert set(v["rollout_vrmse"]["model"]) == {"1", "2-5"}  # windows cut at step 5
    assert isinstance(card["source"]["dirty"], bool)
    text = md.read_text()
    assert "| gray_scott_2d | 2D | 32x32 |" in text and "Preset `tiny`" in text
    assert not list(run.glob("*.tmp"))


def test_model_card_names_a_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="last.ckpt: no checkpoint"):
        write_model_card(tmp_path)


def test_model_preset_reports_custom_for_an_unknown_architecture():
    small = yaml.safe_load((REPO / "configs" / "model" / "small.yaml").read_text())
    assert model_preset(small) == "small"
    assert model_preset({**small, "dim": small["dim"] + 1}) == "custom"


def test_scratch_refuses_init_from_in_one_line(compose_cfg, tiny_data_root, tmp_path):
    overrides = tiny_train_overrides(tiny_data_root, tmp_path, "finetune")
    overrides += ["finetune.enabled=false", f"init_from={tmp_path / 'x.ckpt'}"]
    with pytest.raises(ValueError, match="finetune.enabled=false trains from scratch") as e:
        train(compose_cfg("train", overrides))
    assert "\n" not in str(e.value) and "init_from=" in str(e.value)
    assert not (tmp_path / "config.yaml").exists()


def test_scratch_run_resumes_with_ckpt_path_alone(compose_cfg, tiny_data_root, tmp_path):
    keep = [
        o
        for o in tiny_train_overrides(tiny_data_root, tmp_path, "finetune")
        if not o.startswith(("trainer.max_epochs=", "paths.output_dir="))
    ]
    first = [*keep, "finetune.enabled=false", "trainer.max_steps=3"]
    train(compose_cfg("train", [*first, f"paths.output_dir={tmp_path}"]), overrides=first)
    last = tmp_path / "checkpoints" / "last.ckpt"
    merged = resume_overrides([f"ckpt_path={last}", "trainer.max_steps=4"])
    assert "finetune.enabled=false" in merged
    _, objects = train(compose_cfg("train", merged), overrides=merged)
    assert objects["trainer"].global_step == 4
    assert objects["output_dir"] == tmp_path
