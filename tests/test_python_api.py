"""One Python path: ``walrus.load`` gives what ``infer.py`` uses, ``walrus.rollout`` on it gives
``infer.py rollout``'s numbers (jitter on, same seed), and the rollout guide's example runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import walrus
from tests.conftest import REPO
from tests.test_infer import TINY
from walrus.checkpoint import atomic_torch_save, build_model
from walrus.data.normalization import MeanStdNormalizer
from walrus.data.vocab import FieldVocabulary
from walrus.data.well_file import read_trajectory
from walrus.inference.loading import DEFAULT_SEED, InferenceCheckpoint, load_inference_checkpoint
from walrus.metrics import RolloutMetrics

DATASET = "navier_stokes_2d"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory, tiny_data_root: Path) -> Path:
    """A tiny random model over the Navier-Stokes fields, with the official normaliser stored."""
    torch.manual_seed(0)
    model = build_model(TINY)
    meta = {
        "format": 1,
        "model_config": TINY,
        "vocab": FieldVocabulary(["vorticity", "velocity_x", "velocity_y", "pressure"]).to_dict(),
        "predict_delta": True,
        "normalizer": MeanStdNormalizer(eps=1e-4).config(),
        "data_config": {"root": str(tiny_data_root), "datasets": [DATASET], "n_steps_input": 3},
    }
    path = tmp_path_factory.mktemp("api") / "tiny.ckpt"
    state = {"model." + k: v for k, v in model.state_dict().items()}
    atomic_torch_save({"state_dict": state, "walrus": meta}, path)
    return path


def test_load_is_the_inference_checkpoint(ckpt: Path, compose_cfg) -> None:
    loaded = walrus.load(ckpt)
    assert type(loaded) is InferenceCheckpoint
    assert type(load_inference_checkpoint(ckpt)) is type(loaded)
    assert not loaded.model.training and loaded.predict_delta
    assert isinstance(loaded.normalizer, MeanStdNormalizer)
    assert loaded.field_names[:3] == ["vorticity", "velocity_x", "velocity_y"]
    assert loaded.inference_jitter and loaded.cap_delta_unit and loaded.n_steps_input == 3
    assert loaded.default_jitter_seed() == DEFAULT_SEED == compose_cfg("infer", []).seed
    assert loaded.source == str(ckpt)


def test_python_rollout_equals_infer_rollout(ckpt: Path, tmp_path: Path) -> None:
    loaded = walrus.load(ckpt)
    ds = walrus.open_dataset(loaded)  # the checkpoint's data root and dataset
    batch = walrus.trajectory_batch(ds, 0, steps=5)
    assert batch.input_fields.shape[:3] == (1, 3, 3) and batch.output_fields.shape[1] == 5
    preds = torch.stack(list(walrus.rollout(loaded, batch, 5)), dim=1)[0]  # (S, C, H, W)

    result = walrus.infer(
        "rollout",
        f"ckpt_path={ckpt}",
        "steps=5",
        f"out={tmp_path}",
        "plots=false",
        "progress=false",
    )
    assert result["metrics"]["jitter_seed"] == DEFAULT_SEED  # the command jittered, seed 0
    frames, names, _ = read_trajectory(tmp_path / "predictions.hdf5", 0)  # (S, C, H, W)
    assert names == ds.field_names
    torch.testing.assert_close(preds, torch.from_numpy(frames), rtol=1e-5, atol=1e-6)

    metrics = RolloutMetrics(ds.field_names, 5)
    for step in range(1, 6):
        metrics.update(
            step, preds[None, step - 1], batch.output_fields[:, step - 1], batch.input_fields[:, -1]
        )
    ours = metrics.to_dict()["model"]["vrmse"]["per_step"]
    theirs = result["metrics"]["datasets"][DATASET]["metrics"]["model"]["vrmse"]["per_step"]
    for field in ds.field_names:
        assert ours[field] == pytest.approx(theirs[field], rel=1e-5)

    # the defaults matter: no jitter, or the bare model's RMS normaliser, give other numbers
    unjittered = torch.stack(list(walrus.rollout(loaded, batch, 5, jitter_seed=None)), 1)[0]
    bare = torch.stack(list(walrus.rollout(loaded.model, batch, 5, jitter_seed=0)), 1)[0]
    assert not torch.allclose(unjittered, preds, atol=1e-4)
    assert not torch.allclose(bare, preds, atol=1e-4)
    explicit = walrus.rollout(
        loaded.model,
        batch,
        5,
        normalizer=loaded.normalizer,
        predict_delta=True,
        jitter_seed=DEFAULT_SEED,
    )
    torch.testing.assert_close(torch.stack(list(explicit), 1)[0], preds)


def test_ensemble_takes_the_loaded_checkpoint(ckpt: Path) -> None:
    loaded = walrus.load(ckpt)
    batch = walrus.trajectory_batch(walrus.open_dataset(loaded), 0, steps=2)
    first, _ = next(walrus.ensemble_rollout(loaded, batch, 2, members=1, jitter_seed=4))
    alone = next(walrus.rollout(loaded, batch, 2, jitter_seed=4))
    torch.testing.assert_close(first, alone)


def test_bad_inputs_are_one_line(ckpt: Path, tmp_path: Path) -> None:
    loaded = walrus.load(ckpt)
    with pytest.raises(ValueError, match="jitter_seed must be an int, None or 'checkpoint'"):
        next(walrus.rollout(loaded, None, 1, jitter_seed="yes"))  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        walrus.open_dataset(loaded, tmp_path / "nowhere")
    with pytest.raises(ValueError, match="unknown command 'train'"):
        walrus.infer("train")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        walrus.load(tmp_path / "missing.ckpt")


GUIDE = REPO / "docs" / "guide" / "inference.md"


def _guide_example() -> str:
    """The code block of the rollout guide's section "From Python: dataset → batch → rollout →
    metrics"."""
    text = GUIDE.read_text()
    section = text.split("## From Python: dataset → batch → rollout → metrics", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_guide_example_runs_and_matches_the_command(
    ckpt: Path, tiny_data_root: Path, tmp_path: Path, capsys
) -> None:
    code = _guide_example()
    values = {"ckpt": str(ckpt), "data_dir": str(tiny_data_root), "out": str(tmp_path), "steps": 3}
    for name, value in values.items():
        code, n = re.subn(rf"^{name} = .*$", f"{name} = {value!r}", code, flags=re.M)
        assert n == 1, f"the guide's example no longer sets {name}"
    scope: dict = {}
    exec(compile(code, str(GUIDE), "exec"), scope)
    assert scope["vrmse"].keys() == scope["same"].keys()
    for field, values in scope["vrmse"].items():
        assert len(values) == 3 and values == pytest.approx(scope["same"][field], rel=1e-5)
    assert "vorticity" in capsys.readouterr().out
