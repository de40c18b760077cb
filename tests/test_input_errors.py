"""Honest input handling: what a run records, refused outputs, one-line errors, bad HDF5 fields."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import REPO, tiny_train_overrides
from tests.test_infer import base_overrides, compose_infer
from tests.test_infer import toy as toy  # fixture
from walrus.data.writer import write_well_file
from walrus.training.train import train


def _train(compose_cfg, data_root, out_dir, *extra):
    return train(compose_cfg("train", [*tiny_train_overrides(data_root, out_dir), *extra]))


# ---------------------------------------------------------------------- model= with a checkpoint


@pytest.mark.parametrize("how", ["init_from"])  # a resume refuses model changes (test_daily_loop)
def test_config_yaml_records_the_checkpoint_architecture(
    compose_cfg, tiny_data_root, tmp_path, caplog, how
):
    _train(compose_cfg, tiny_data_root, tmp_path / "a")
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    caplog.set_level(logging.INFO)
    _train(
        compose_cfg, tiny_data_root, tmp_path / "b", f"{how}={last}", "model.dim=64",
        "model.depth=3", "trainer.max_epochs=2",
    )  # fmt: skip
    recorded = OmegaConf.load(tmp_path / "b" / "config.yaml").model
    assert (recorded.dim, recorded.depth) == (32, 2)
    assert "these model options were ignored: depth=3 (checkpoint: 2), dim=64 (checkpoint: 32)" in (
        caplog.text
    )


# ---------------------------------------------------------------------- infer.py out=


def test_a_second_rollout_into_one_out_is_refused_unless_overwrite(toy, tmp_path):  # noqa: F811
    from walrus.inference import run

    out = tmp_path / "out"
    fast = ["plots=false", "steps=2", "trajectories=0"]
    run(compose_infer([*base_overrides(toy, out), *fast]))
    first = sorted(p.name for p in out.iterdir())
    (out / ".hydra").mkdir()  # an earlier run's own files count as its results
    (out / ".hydra" / "config.yaml").write_text("earlier")
    with pytest.raises(
        ValueError, match=r"already holds \.hydra, metrics\.json, predictions\.hdf5.*overwrite=true"
    ):
        run(compose_infer([*base_overrides(toy, out), *fast]))
    run(compose_infer([*base_overrides(toy, out, "evaluate"), "overwrite=true", "max_windows=2"]))
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json"]  # no mixing
    assert first == ["metrics.json", "predictions.hdf5"]
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds notes.txt, which no infer.py command wrote"):
        run(compose_infer([*base_overrides(toy, out), *fast, "overwrite=true"]))
    assert (out / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------------- one-line errors


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.batch_size=abc", "option data.batch_size must be an int, got 'abc'"),
        ("data.batch_size=2.5", "option data.batch_size must be an int, got 2.5"),
        ("optimizer.lr=fast", "option optimizer.lr must be a number, got 'fast'"),
        ("trainer.max_epochs=two", "option trainer.max_epochs must be an int or null, got 'two'"),
        ("module.input_noise=lots", "option module.input_noise must be a number, got 'lots'"),
        ("seed=x", "option seed must be an int, got 'x'"),
        ("optimizer.lr=-1", "option optimizer.lr must be a number >= 0, got -1"),
        ("module.weight_decay=-0.1", "option module.weight_decay must be a number >= 0"),
    ],
)
def test_options_of_the_wrong_kind_are_named(compose_cfg, tmp_path, override, message):
    cfg = compose_cfg("train", [*tiny_train_overrides(tmp_path, tmp_path), override])
    with pytest.raises(ValueError, match=re.escape(message)):
        train(cfg)


@pytest.mark.parametrize(
    "experiment", sorted(p.stem for p in (REPO / "configs" / "experiment").glob("*.yaml"))
)
def test_every_experiment_passes_the_type_check(compose_cfg, tmp_path, experiment):
    from walrus.training.train import _check_types

    _check_types(compose_cfg("train", [f"experiment={experiment}", f"paths.output_dir={tmp_path}"]))


def test_disk_full_names_the_file_in_one_line(tmp_path, monkeypatch, capsys):
    from walrus.atomic import write_text_atomic
    from walrus.cli import run_cli

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: write_text_atomic(tmp_path / "metrics.json", "{}"))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"error: no space left on device: could not write {tmp_path / 'metrics.json'} (any previous file is kept)\n"
    )
    assert list(tmp_path.iterdir()) == []


class _FillingDisk:
    """A file that takes ``room`` bytes, then fails as a full disk does (ENOSPC)."""

    def __init__(self, path: Path, room: int) -> None:
        self.f, self.room = open(path, "wb"), room  # noqa: SIM115 (closed in __exit__)

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def __enter__(self) -> _FillingDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


@pytest.mark.parametrize("room", [0, 100, 4096], ids=["at_once", "in_the_header", "in_a_tensor"])
def test_a_full_disk_inside_torchs_serializer_is_named(tmp_path, monkeypatch, room):
    """torch's own zip writer meets ENOSPC (and may mask it), not a patched torch.save."""
    from walrus import checkpoint
    from walrus.errors import DiskFullError

    path = tmp_path / "last.ckpt"
    checkpoint.atomic_torch_save({"state_dict": {"w": torch.ones(3)}}, path)
    before = path.read_bytes()
    monkeypatch.setattr(checkpoint, "open", lambda f, mode: _FillingDisk(f, room), raising=False)
    with pytest.raises(DiskFullError) as err:
        checkpoint.atomic_torch_save({"state_dict": {"w": torch.zeros(300, 300)}}, path)
    assert str(err.value) == (
        f"no space left on device: could not write {path} (any previous file is kept)"
    )
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("WALRUS_TRACEBACK", None)
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["train.py", "experiment=quickstart", "data.batch_sise=3"],
            "error: Could not override 'data.batch_sise'. To append to your config use "
            "+data.batch_sise=3\n",
        ),
        (["train.py", "model=nosuch"], "error: In 'train': Could not find 'model/nosuch'"),
        (
            [
                "train.py",
                "experiment=quickstart",
                "data.batch_size=abc",
                "paths.output_dir={tmp}/o",
            ],
            "error: option data.batch_size must be an int, got 'abc'\n",
        ),  # fmt: skip
        (
            ["infer.py", "rollout", "ckpt_path=x.ckpt", "out={tmp}/file"],
            "error: {tmp}/file exists and is not a directory\n",
        ),  # fmt: skip
    ],
    ids=["misspelled_key", "unknown_config", "type_error", "out_is_a_file"],
)
def test_cli_errors_are_one_line_with_a_nonzero_exit(tmp_path, args, message):
    (tmp_path / "file").write_text("not a folder")
    r = _cli(*(a.replace("{tmp}", str(tmp_path)) for a in args))
    message = message.replace("{tmp}", str(tmp_path))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith(message), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------- HDF5 fields and time


def _well(root: Path) -> Path:
    rng = np.random.default_rng(0)
    return write_well_file(
        root / "toy" / "data" / "train" / "f.hdf5",
        "toy",
        coords={"x": np.arange(4.0), "y": np.arange(4.0)},
        time=np.arange(6.0),
        n_trajectories=2,
        fields={"p": rng.standard_normal((2, 6, 4, 4)).astype(np.float32)},
    )


def _replace(f: h5py.File, name: str, data: np.ndarray) -> None:
    """Swap dataset ``name`` for ``data``, keeping its attributes."""
    attrs = dict(f[name].attrs)
    del f[name]
    f.create_dataset(name, data=data)
    f[name].attrs.update(attrs)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("t0_fields/p", lambda a: a + 1j, r"field t0_fields/p is complex \(complex64\)"),
        ("t0_fields/p", lambda a: a > 0, "field t0_fields/p is boolean"),
        ("t0_fields/p", lambda a: a.astype("S8"), r"field t0_fields/p has dtype \|S8"),
        ("dimensions/time", lambda a: a + 0j, "dimensions/time has dtype complex64"),
        ("dimensions/time", lambda a: np.where(a == 3, np.nan, a), r"NaN or Inf.*index \(3,\)"),
        ("dimensions/time", lambda a: np.where(a == 0, np.inf, a), r"NaN or Inf.*index \(0,\)"),
    ],
    ids=["complex_field", "bool_field", "bytes_field", "complex_time", "nan_time", "inf_time"],
)
def test_fields_and_times_that_are_not_real_numbers_are_refused(tmp_path, name, value, message):
    from walrus.data.well_dataset import WellDataset

    path = _well(tmp_path)
    with h5py.File(path, "a") as f:
        _replace(f, name, value(f[name][()]))
    with pytest.raises(ValueError, match=message) as err:
        WellDataset(tmp_path, "toy", "train", 2, 1)
    assert str(path) in str(err.value)


def test_a_folder_named_like_an_hdf5_file_is_called_a_directory(tmp_path):
    from walrus.data.well_file import WellFile, open_h5

    folder = tmp_path / "f.hdf5"
    folder.mkdir()
    for call in (WellFile, open_h5):
        with pytest.raises(ValueError, match=f"{re.escape(str(folder))}: is a directory"):
            call(folder)
    with pytest.raises(FileNotFoundError, match="no such file"):
        open_h5(tmp_path / "missing.hdf5")


def test_an_unreadable_hdf5_file_is_a_permission_error(tmp_path, monkeypatch):
    from walrus.data.well_file import WellFile

    path = _well(tmp_path)

    def denied(name, *args, **kwargs):
        raise PermissionError(13, "Unable to synchronously open file (Permission denied)")

    monkeypatch.setattr(h5py, "File", denied)  # tests run as root, so chmod would not do
    with pytest.raises(PermissionError, match=f"{re.escape(str(path))}: permission denied"):
        WellFile(path)


# ---------------------------------------------------------------------- checkpoint files


@pytest.mark.parametrize("text", ["hello world\n", "model: 1\n", '{"a": 1}\n'])
def test_a_text_file_given_as_a_checkpoint_is_called_a_text_file(tmp_path, text):
    from walrus.checkpoint import load_checkpoint_file

    path = tmp_path / "notes.ckpt"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_checkpoint_file(path)
    assert str(err.value) == f"checkpoint {path} is not a PyTorch checkpoint: it is a text file"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="not a PyTorch checkpoint: it is empty"):
        load_checkpoint_file(path)


def test_pickled_objects_in_a_checkpoint_are_named(tmp_path):
    from walrus.checkpoint import load_checkpoint_file

    path = tmp_path / "objects.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=1)}, path)
    with pytest.raises(ValueError, match=r"holds pickled objects.*GLOBAL argparse\.Namespace"):
        load_checkpoint_file(path)
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"\x80\x02" + bytes(range(256)))
    with pytest.raises(ValueError, match="corrupt or truncated.*pickle stream is invalid"):
        load_checkpoint_file(garbage)


def test_an_unreadable_checkpoint_is_a_permission_error(tmp_path, monkeypatch):
    from walrus.checkpoint import load_checkpoint_file

    path = tmp_path / "w.ckpt"
    torch.save({"state_dict": {}}, path)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(torch, "load", denied)
    with pytest.raises(PermissionError, match=f"{re.escape(str(path))}: permission denied"):
        load_checkpoint_file(path)


@pytest.mark.parametrize(
    ("obj", "refused"),
    [
        ({"args": argparse.Namespace(lr=1)}, "Unsupported global: GLOBAL argparse.Namespace"),
        ({"fn": os.getcwd}, f"unsupported GLOBAL {os.getcwd.__module__}.getcwd"),
    ],
    ids=["allow_list", "blocked_module"],
)
def test_the_converter_suggests_trust_pickle_for_every_refused_global(
    tmp_path, capsys, obj, refused
):
    from walrus.compat.__main__ import main

    path = tmp_path / "official.pt"
    torch.save({"model_state_dict": {"w": torch.ones(2)}, **obj}, path)
    assert main(["convert", str(path), str(tmp_path / "out.ckpt")]) == 2
    err = capsys.readouterr().err
    assert refused in err and "rerun with --trust-pickle" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out.ckpt").exists()


def test_the_converter_reports_unreadable_and_text_inputs(tmp_path, monkeypatch, capsys):
    from walrus.compat.__main__ import main

    text = tmp_path / "notes.pt"
    text.write_text("model: walrus\n")
    assert main(["convert", str(text), str(tmp_path / "out.ckpt")]) == 2
    assert capsys.readouterr().err == (
        f"error: {text} is not a readable PyTorch checkpoint (it is a text file)\n"
    )
    (tmp_path / "dir.pt").mkdir()
    assert main(["convert", str(tmp_path / "dir.pt"), str(tmp_path / "out.ckpt")]) == 2
    assert "is a directory" in capsys.readouterr().err
    real_open = open

    def denied(file, *args, **kwargs):
        if Path(file) == text:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", denied)
    assert main(["convert", str(text), str(tmp_path / "out.ckpt")]) == 2
    assert capsys.readouterr().err == (
        f"error: {text}: permission denied; this user may not read it (check its permissions)\n"
    )


# ---------------------------------------------------------------------- rollout start


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        (["start=8"], "; lower start (at most 6)"),
        (
            ["start=0", "data.time_stride=4"],
            "; pick longer trajectories or a smaller data.time_stride",
        ),
    ],
)
def test_too_short_for_a_rollout_suggests_a_fix_that_helps(toy, tmp_path, overrides, fix):  # noqa: F811
    from walrus.inference import run

    with pytest.raises(ValueError, match="leaves nothing to predict") as err:
        run(compose_infer([*base_overrides(toy, tmp_path / "o"), *overrides]))
    assert str(err.value).endswith(fix)
