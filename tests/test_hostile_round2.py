"""Hostile input, second round: non-finite weights are never saved, checksums cover the whole
checkpoint, memory is bounded by the machine, and the remaining tracebacks are one line.

Training cases run the tiny in-process training of ``tests/conftest.py``; everything else is
crafted in-process. Each case asserts the one line a user sees and what is left on disk.
"""

from __future__ import annotations

import re
import resource
import shutil
import types
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import walrus
from tests.conftest import tiny_train_overrides
from tests.test_hostile_input import _cli_error, _compose, one_line_error, small_checkpoint
from walrus import checkpoint
from walrus.checkpoint import (
    atomic_torch_save,
    content_checksum,
    load_checkpoint_file,
    with_checksums,
)
from walrus.cli import run_cli
from walrus.compat.inputs import read_fields
from walrus.data.datamodule import parse_dataset_specs
from walrus.data.well_dataset import WellDataset
from walrus.data.writer import write_well_file
from walrus.errors import DiskFullError, NonFiniteWeightsError
from walrus.memory import available_memory, check_model_fits, default_max_sample_bytes
from walrus.training.checkpointing import BestCheckpoint
from walrus.training.summary import _best
from walrus.training.train import train

FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "walrus_reference_tiny.pt"


@pytest.fixture(scope="module")
def run(tiny_data_root, tmp_path_factory) -> Path:
    """A finished tiny training run's folder (last.ckpt and best-000.ckpt inside)."""
    out = tmp_path_factory.mktemp("run")
    train(_compose(tiny_train_overrides(tiny_data_root, out)))
    return out


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# ------------------------------------------------------------------------- non-finite weights


def test_a_learning_rate_that_overflows_saves_nothing(tiny_data_root, tmp_path):
    """``optimizer.lr=1e30``: finite 1e30 weights whose forward pass overflows on validation."""
    out = tmp_path / "run"
    overrides = [
        *tiny_train_overrides(tiny_data_root, out),
        "optimizer.lr=1e30",
        "lr_scheduler=constant",
        "trainer.max_steps=1",
    ]
    with pytest.raises(NonFiniteWeightsError, match="non-finite .* at global step 1") as e:
        train(_compose(overrides))
    assert "\n" not in str(e.value) and "last finite checkpoint is kept" in str(e.value)
    assert not (out / "checkpoints").exists()  # no last.ckpt, no best-*.ckpt
    assert not (out / "metrics.json").exists()


def test_resuming_a_nan_optimizer_state_keeps_the_finite_checkpoints(run, tiny_data_root, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    last = folder / "checkpoints" / "last.ckpt"
    ckpt = load_checkpoint_file(last)
    for state in ckpt["optimizer_states"][0]["state"].values():
        state["exp_avg"].fill_(float("nan"))
    atomic_torch_save(ckpt, last)  # valid checksums: only the Adam moments are poisoned
    before = _files(folder / "checkpoints")
    overrides = [
        *tiny_train_overrides(tiny_data_root, folder),
        f"ckpt_path={last}",
        "trainer.max_epochs=2",
    ]
    with pytest.raises(NonFiniteWeightsError, match="after the optimizer step at global step 2"):
        train(_compose(overrides))
    assert _files(folder / "checkpoints") == before  # last.ckpt and best-000.ckpt untouched


def test_a_non_finite_score_never_becomes_best(tmp_path):
    callback = BestCheckpoint(dirpath=tmp_path, monitor="val/x", save_top_k=1)
    assert callback.check_monitor_top_k(None, torch.tensor(0.5))
    assert not callback.check_monitor_top_k(None, torch.tensor(float("inf")))
    assert not callback.check_monitor_top_k(None, torch.tensor(float("nan")))
    best = tmp_path / "best-000.ckpt"
    best.write_bytes(b"x")
    for score, expected in ((float("inf"), None), (0.25, (str(best), "val/x = 0.25"))):
        cb = types.SimpleNamespace(
            best_model_path=str(best), best_model_score=torch.tensor(score), monitor="val/x"
        )
        assert _best(types.SimpleNamespace(checkpoint_callbacks=[cb])) == expected


# --------------------------------------------------------------------------------- checksums


def _flip_after(path: Path, marker: bytes, opcode: bytes, bit: int, out: Path) -> Path:
    """Flip ``bit`` of the first byte after the first ``opcode`` following ``marker`` in the
    raw file (``data.pkl`` is stored uncompressed; the zip CRC is left stale, as torch does not
    check it)."""
    raw = bytearray(path.read_bytes())
    at = raw.index(opcode, raw.index(marker) + len(marker))
    raw[at + (0 if opcode in (b"\x88", b"\x89") else 1)] ^= 1 << bit
    out.write_bytes(bytes(raw))
    return out


@pytest.mark.parametrize(
    ("marker", "opcode", "bit"),
    [(b"predict_delta", b"\x88", 0), (b"eps", b"G", 4)],  # True -> False; an exponent bit
    ids=["predict_delta", "normaliser_eps"],
)
def test_a_flipped_metadata_bit_is_refused(run, tmp_path, marker, opcode, bit):
    flipped = _flip_after(run / "checkpoints" / "last.ckpt", marker, opcode, bit, tmp_path / "f")
    with pytest.raises(ValueError, match="its metadata .* does not match its stored checksum") as e:
        load_checkpoint_file(flipped)
    one_line_error(e.value, flipped)


def test_metadata_checksum_covers_every_value_and_old_files_still_load(tmp_path):
    ckpt = with_checksums(small_checkpoint())
    digest = ckpt["walrus"]["content_checksum"]
    assert digest == content_checksum(ckpt)
    ckpt["walrus"]["vocab"]["names"][0] = "v"
    assert content_checksum(ckpt) != digest
    old = small_checkpoint()
    old["walrus"]["checksums"] = with_checksums(old)["walrus"]["checksums"]
    torch.save(old, tmp_path / "old.ckpt")  # tensor checksums only, as before this change
    with pytest.warns(UserWarning, match="old.ckpt has no metadata checksum"):
        assert load_checkpoint_file(tmp_path / "old.ckpt")["walrus"]["predict_delta"] is True


def test_a_compressed_record_is_refused_before_it_is_inflated(tmp_path, monkeypatch):
    src = tmp_path / "plain.ckpt"
    atomic_torch_save(small_checkpoint(), src)
    packed = tmp_path / "packed.ckpt"
    with zipfile.ZipFile(src) as z_in, zipfile.ZipFile(packed, "w") as z_out:
        for info in z_in.infolist():
            kind = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            z_out.writestr(info.filename, z_in.read(info), compress_type=kind)

    def no_load(*args, **kwargs):
        raise AssertionError("torch.load reached")

    monkeypatch.setattr(checkpoint.torch, "load", no_load)
    with pytest.raises(ValueError, match="record .* is compressed") as e:
        load_checkpoint_file(packed)
    one_line_error(e.value, packed)


# ---------------------------------------------------------------------------------- memory


def test_the_default_sample_bound_follows_the_memory_available(tmp_path):
    bound = default_max_sample_bytes()
    assert 256 << 20 <= bound <= max(available_memory() // 2, 256 << 20)
    path = tmp_path / "toy" / "data" / "train" / "toy.hdf5"
    write_well_file(
        path,
        "toy",
        coords={"x": np.arange(8.0), "y": np.arange(8.0)},
        time=np.arange(6.0),
        n_trajectories=1,
        fields={"u": np.ones((1, 6, 8, 8), np.float32)},
    )
    assert WellDataset(tmp_path, "toy", "train", 2, 1).max_sample_bytes == bound


def test_a_field_that_was_never_written_is_refused(tmp_path):
    path = tmp_path / "toy" / "data" / "train" / "toy.hdf5"
    write_well_file(
        path,
        "toy",
        coords={"x": np.arange(8.0), "y": np.arange(8.0)},
        time=np.arange(6.0),
        n_trajectories=1,
        fields={"u": np.ones((1, 6, 8, 8), np.float32)},
    )
    with h5py.File(path, "r+") as f:  # same shape, chunked, no chunk ever written
        attrs = dict(f["t0_fields/u"].attrs)
        del f["t0_fields/u"]
        ds = f["t0_fields"].create_dataset("u", shape=(1, 6, 8, 8), dtype="f4", chunks=True)
        ds.attrs.update(attrs)
    ds = WellDataset(tmp_path, "toy", "train", 2, 1)
    with pytest.raises(ValueError, match="field 't0_fields/u' declares 384 values .* none") as e:
        ds[0]
    one_line_error(e.value, path)


def test_a_model_that_cannot_fit_is_refused_before_it_is_built(tiny_data_root, tmp_path):
    cfg = _compose([*tiny_train_overrides(tiny_data_root, tmp_path / "run"), "model.dim=1000000"])
    with pytest.raises(ValueError, match=r"model\.dim=1000000.* more than the .* available") as e:
        train(cfg)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run" / "checkpoints").exists()
    check_model_fits(small_checkpoint()["walrus"]["model_config"], "train")  # fits: no error


def test_allocator_errors_are_one_line(capsys, monkeypatch):
    monkeypatch.delenv("WALRUS_TRACEBACK", raising=False)
    err = _cli_error(capsys, lambda: torch.empty(2**45))  # 512 TiB: the real allocator refuses
    assert err == (
        "error: this run (its options or input files) asks for more than this machine can give "
        "(out of memory)\n"
    )

    def other():
        raise RuntimeError("a bug, not memory")

    with pytest.raises(RuntimeError, match="a bug"):  # other RuntimeErrors keep their traceback
        run_cli(other)


# ------------------------------------------------------------------------ one-line errors


@pytest.mark.skipif(not FIXTURE.is_file(), reason=f"reference fixture {FIXTURE} not found")
@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("processor: 5\n", "official config processor=5 must be a mapping"),
        ("model:\n  groups: 0\n", "official config groups=0 must be an integer >= 1"),
        ("model:\n  drop_path: [1]\n", r"official config drop_path=\[1\] must be a number"),
    ],
)
def test_converter_config_values_are_one_line(tmp_path, capsys, config, message):
    from walrus.compat.__main__ import main

    path = tmp_path / "config.yaml"
    path.write_text(config)
    out = tmp_path / "out.ckpt"
    assert main(["convert", str(FIXTURE), str(out), "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert not out.exists()


def test_converter_fields_with_a_non_integer_index_are_one_line(tmp_path):
    path = tmp_path / "fields.yaml"
    path.write_text("{a: 0, b: x}\n")
    with pytest.raises(ValueError, match="must map each name to an integer") as e:
        read_fields(str(path), 2)
    one_line_error(e.value, path)


def test_a_file_size_limit_while_saving_keeps_the_old_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_torch_save(small_checkpoint(), path)
    before = path.read_bytes()
    big = {**small_checkpoint(), "extra": torch.zeros(300, 300)}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) + 4096, hard))  # SIGXFSZ: ignored
    try:
        with pytest.raises(DiskFullError, match="file size limit reached") as e:
            atomic_torch_save(big, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    one_line_error(e.value, path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_datasets_that_are_not_names_are_one_line(run, tiny_data_root, tmp_path):
    with pytest.raises(ValueError, match="data.datasets must be a dataset name or a list"):
        parse_dataset_specs(5)
    with pytest.raises(ValueError, match="data.datasets must be .* got '5'") as e:
        walrus.infer(
            "rollout",
            f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
            f"paths.data_dir={tiny_data_root}",
            "data.datasets=5",
            f"out={tmp_path / 'out'}",
        )
    assert "\n" not in str(e.value)


def test_infer_with_a_bad_override_raises_value_error():
    with pytest.raises(ValueError, match="bad override in \\['not an override'\\]") as e:
        walrus.infer("rollout", "not an override")
    assert "\n" not in str(e.value)


def test_stats_on_missing_or_nan_data_is_one_line(tmp_path, capsys, monkeypatch):
    from walrus.data.stats import main

    monkeypatch.delenv("WALRUS_TRACEBACK", raising=False)
    err = _cli_error(capsys, lambda: main([str(tmp_path / "missing")]))
    assert "dataset directory" in err and "missing does not exist" in err
    u = np.ones((1, 6, 8, 8), np.float32)
    u[0, 3, 2, 2] = np.nan
    write_well_file(
        tmp_path / "toy" / "data" / "train" / "toy.hdf5",
        "toy",
        coords={"x": np.arange(8.0), "y": np.arange(8.0)},
        time=np.arange(6.0),
        n_trajectories=1,
        fields={"u": u},
    )
    err = _cli_error(capsys, lambda: main([str(tmp_path / "toy")]))
    assert "toy.hdf5: NaN or Inf in field 'u', trajectory 0, time index 3" in err
    assert not (tmp_path / "toy" / "stats.yaml").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--resolution", "4"], "--resolution must be at least 8, got 4"),
        (["--resolution", "100000"], "--resolution 100000 --steps 80 .* more than the"),
        (["--steps", "1000000000"], "--steps 1000000000 .* more than the"),
    ],
)
def test_generator_sizes_are_checked_before_simulating(tmp_path, capsys, args, message):
    from walrus.data.synthetic.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["navier_stokes_2d", "--out", str(tmp_path / "data"), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert not (tmp_path / "data").exists()
