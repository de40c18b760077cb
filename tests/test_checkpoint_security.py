"""Crafted checkpoints never run code, never resolve interpolations, and are refused clearly.

Every loading path is tried: ``load_model``, ``infer.py rollout``, resume (``ckpt_path=``),
fine-tuning (``init_from=``) and the official-weights converter. A payload that Hydra would
instantiate writes a marker file; an interpolation names an environment variable holding a
secret. Neither the file nor the secret may ever appear.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from tests.conftest import CONFIG_DIR, REPO, tiny_train_overrides
from walrus.checkpoint import atomic_torch_save, load_checkpoint_file, load_model
from walrus.training.train import train

SECRET_VAR = "WALRUS_TEST_SECRET"
SECRET = "s3cr3t-value-4711"


def _compose(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    GlobalHydra.instance().clear()
    return cfg


@pytest.fixture(scope="module")
def trained(tiny_data_root, tmp_path_factory) -> Path:
    """A real walrus checkpoint from a two-step tiny run."""
    out = tmp_path_factory.mktemp("trained")
    train(_compose(tiny_train_overrides(tiny_data_root, out)))
    return out / "checkpoints" / "last.ckpt"


@pytest.fixture(autouse=True)
def secret_env(monkeypatch):
    monkeypatch.setenv(SECRET_VAR, SECRET)


def _writer(marker: Path) -> dict:
    """A config Hydra's ``instantiate`` would turn into a call writing ``marker``."""
    return {"_target_": "walrus.atomic.write_text_atomic", "path": str(marker), "text": "pwned"}


def _payloads(marker: Path) -> dict[str, tuple[str, object]]:
    """name -> (metadata location 'a/b', crafted value)."""
    return {
        "nested_target_in_bool_option": ("model_config/jitter", _writer(marker)),
        "nested_target_in_normalizer": ("normalizer/eps", _writer(marker)),
        "target_in_data_config": ("data_config/datasets", _writer(marker)),
        "interpolation_in_model_option": (
            "model_config/temporal_kernel",
            f"${{oc.env:{SECRET_VAR}}}",
        ),
        "interpolation_in_data_root": ("data_config/root", f"${{oc.env:{SECRET_VAR}}}"),
        "model_config_wrong_type": ("model_config", "walrus.model.walrus.Walrus"),
        "model_option_wrong_type": ("model_config/dim", "16"),
        "vocab_wrong_type": ("vocab", ["a", "b"]),
    }


def _craft(src: Path, dst: Path, where: str, value: object) -> Path:
    ckpt = load_checkpoint_file(src)
    meta = copy.deepcopy(ckpt["walrus"])
    *parents, last = where.split("/")
    node = meta
    for key in parents:
        node = node[key]
    node[last] = value
    atomic_torch_save({**ckpt, "walrus": meta}, dst)  # valid checksums: only metadata differs
    return dst


def _assert_safe(marker: Path, message: str) -> None:
    assert not marker.exists(), "a _target_ from the checkpoint was instantiated"
    assert SECRET not in message, "an interpolation from the checkpoint was resolved"


PAYLOAD_NAMES = list(_payloads(Path("x")))


@pytest.mark.parametrize("payload", PAYLOAD_NAMES)
def test_load_model_refuses_crafted_metadata(trained, tmp_path, payload):
    marker = tmp_path / "marker.txt"
    where, value = _payloads(marker)[payload]
    path = _craft(trained, tmp_path / "crafted.ckpt", where, value)
    with pytest.raises(ValueError, match="crafted.ckpt") as e:
        load_model(path)
    _assert_safe(marker, str(e.value))


@pytest.mark.parametrize("option", ["ckpt_path", "init_from"])
@pytest.mark.parametrize(
    "payload", ["nested_target_in_bool_option", "interpolation_in_model_option", "vocab_wrong_type"]
)
def test_resume_and_finetune_refuse_crafted_metadata(
    trained, tiny_data_root, tmp_path, option, payload
):
    marker = tmp_path / "marker.txt"
    where, value = _payloads(marker)[payload]
    path = _craft(trained, tmp_path / "crafted.ckpt", where, value)
    cfg = _compose([*tiny_train_overrides(tiny_data_root, tmp_path / "run"), f"{option}={path}"])
    with pytest.raises(ValueError, match="crafted.ckpt") as e:
        train(cfg)
    _assert_safe(marker, str(e.value))
    assert not (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()


def test_resume_ignores_lightning_entries_from_the_file(trained, tiny_data_root, tmp_path):
    """Lightning restores hyper_parameters/datamodule entries on resume: never instantiated."""
    marker = tmp_path / "marker.txt"
    ckpt = load_checkpoint_file(trained)
    ckpt["hyper_parameters"] = {"model": _writer(marker), "x": f"${{oc.env:{SECRET_VAR}}}"}
    ckpt["datamodule_hyper_parameters"] = {"data": _writer(marker)}
    path = tmp_path / "crafted.ckpt"
    atomic_torch_save(ckpt, path)
    run = tmp_path / "run"
    overrides = [*tiny_train_overrides(tiny_data_root, run), "trainer.max_epochs=2"]
    train(_compose([*overrides, f"ckpt_path={path}"]))
    assert not marker.exists()
    resumed = load_checkpoint_file(run / "checkpoints" / "last.ckpt")
    assert resumed["global_step"] == 4
    assert "hyper_parameters" not in resumed and SECRET not in repr(resumed["walrus"])


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("WALRUS_TRACEBACK", None)
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("payload", ["nested_target_in_normalizer", "interpolation_in_data_root"])
def test_infer_rollout_refuses_crafted_metadata(trained, tmp_path, payload):
    marker = tmp_path / "marker.txt"
    where, value = _payloads(marker)[payload]
    path = _craft(trained, tmp_path / "crafted.ckpt", where, value)
    r = _cli("infer.py", "rollout", f"ckpt_path={path}", f"out={tmp_path / 'out'}")
    assert r.returncode == 2, r.stderr
    assert "crafted.ckpt" in r.stderr and "Traceback" not in r.stderr
    _assert_safe(marker, r.stdout + r.stderr)


def test_converter_treats_crafted_config_as_data(tmp_path):
    from walrus.compat.__main__ import main

    marker = tmp_path / "marker.txt"
    official = tmp_path / "official.pt"
    torch.save({"model_state_dict": {"embed.2.proj.weight": torch.zeros(2, 2)}}, official)
    config = tmp_path / "config.yaml"
    config.write_text(
        "model:\n"
        f"  dim: ${{oc.env:{SECRET_VAR}}}\n"
        "  jitter:\n"
        "    _target_: walrus.atomic.write_text_atomic\n"
        f"    path: {marker}\n"
        "    text: pwned\n"
    )
    out = tmp_path / "out.ckpt"
    assert main(["convert", str(official), str(out), "--config", str(config)]) == 2
    assert not out.exists()
    assert not marker.exists()


def test_converter_output_carries_checksums_and_crafted_input_is_refused(tmp_path, capsys):
    """An official-looking file whose tensors are fine but whose wrapper holds a payload."""
    from walrus.compat.__main__ import main

    marker = tmp_path / "marker.txt"
    official = tmp_path / "official.pt"
    torch.save({"model_state_dict": {"x": torch.zeros(1)}, "config": _writer(marker)}, official)
    assert main(["convert", str(official), str(tmp_path / "out.ckpt")]) == 2
    assert not marker.exists()
    assert "official.pt" in capsys.readouterr().err


def test_best_checkpoint_ignores_stored_paths_outside_its_folder(tmp_path):
    """A crafted resume state must not make the best-checkpoint callback delete foreign files."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(__file__).parents[1] / "configs" / "callbacks" / "default.yaml")
    ckpt_dir = tmp_path / "checkpoints"
    cfg.model_checkpoint.dirpath = str(ckpt_dir)
    callback = instantiate(cfg.model_checkpoint)
    victim = tmp_path / "victim.txt"
    own = ckpt_dir / "best-000.ckpt"
    state = {
        "dirpath": str(ckpt_dir),
        "best_model_score": 0.5,
        "best_model_path": str(victim),
        "kth_best_model_path": str(victim),
        "kth_value": 0.5,
        "best_k_models": {str(victim): 0.5, str(own): 0.6, "../../etc/passwd": 0.1},
        "last_model_path": "/etc/passwd",
    }
    with pytest.warns(UserWarning, match="outside"):
        callback.load_state_dict(state)
    assert list(callback.best_k_models) == [str(own)]
    assert callback.best_model_path == "" and callback.last_model_path == ""
    assert callback.kth_best_model_path == ""
