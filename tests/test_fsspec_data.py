"""Data under an fsspec URL (issue 21 item 4): the same windows as a local read, read lazily."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace

import fsspec
import h5py
import numpy as np
import pytest
import torch

import walrus.data.well_file as well_file
from walrus.data.datamodule import WellDataModule
from walrus.data.stats import compute_stats, load_stats, write_stats
from walrus.data.storage import data_root_exists
from walrus.data.well_dataset import WellDataset
from walrus.data.well_file import WellFile, list_split_files
from walrus.data.writer import write_well_file
from walrus.inference.loading import resolve_data_config


def _write(
    root: Path, fname: str, n_traj: int, seed: int, n_time: int = 12, split: str = "train"
) -> Path:
    rng = np.random.default_rng(seed)
    shape = (16, 8)
    return write_well_file(
        root / "toy" / "data" / split / fname,
        "toy",
        coords={"x": np.linspace(0, 1, shape[0]), "y": np.linspace(0, 1, shape[1])},
        time=np.arange(n_time) * 0.1,
        n_trajectories=n_traj,
        fields={
            "p": rng.standard_normal((n_traj, n_time, *shape)).astype(np.float32),
            "mask": rng.standard_normal(shape).astype(np.float32),
        },
        vector_fields={"u": rng.standard_normal((n_traj, n_time, *shape, 2)).astype(np.float32)},
        varying={"mask": (False, False)},
        bcs={"x": "wall", "y": "periodic"},
    )


@pytest.fixture
def local_root(tmp_path) -> Path:
    _write(tmp_path, "a.hdf5", 2, 0)
    _write(tmp_path, "b.hdf5", 1, 1)
    _write(tmp_path, "c.hdf5", 1, 2, split="valid")
    write_stats(tmp_path / "toy")
    return tmp_path


@pytest.fixture
def memory_root(local_root):
    """``local_root`` copied into fsspec's in-memory filesystem; removed afterwards."""
    fs = fsspec.filesystem("memory")
    base = f"/walrus-test-{uuid.uuid4().hex}"
    for path in sorted(local_root.rglob("*")):
        if path.is_file():
            fs.pipe(f"{base}/{path.relative_to(local_root).as_posix()}", path.read_bytes())
    yield f"memory://{base}"
    fs.rm(base, recursive=True)


def _same_windows(a: WellDataset, b: WellDataset) -> None:
    assert len(a) == len(b) and a.field_names == b.field_names
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x.input_fields, y.input_fields)
        assert torch.equal(x.output_fields, y.output_fields)
        assert torch.equal(x.bcs, y.bcs) and x.metadata["dt"] == y.metadata["dt"]


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_url_windows_equal_local_windows(local_root, memory_root, kind):
    url = memory_root if kind == "memory" else f"file://{local_root}"
    local = WellDataset(local_root, "toy", "train", 3, 2)
    remote = WellDataset(url, "toy", "train", 3, 2)
    assert [str(wf.path) for wf in remote.files] == [
        f"{url}/toy/data/train/a.hdf5",
        f"{url}/toy/data/train/b.hdf5",
    ]
    _same_windows(local, remote)
    t_local, t_remote = local.trajectory(2, stride=2), remote.trajectory(2, stride=2)
    assert torch.equal(t_local.output_fields, t_remote.output_fields)
    remote.close()


def test_datamodule_and_stats_from_a_url(local_root, memory_root):
    dm = WellDataModule(memory_root, ["toy"], n_steps_input=2, batch_size=2, normalization="zscore")
    dm.prepare_data()  # stats.yaml is there: nothing to write
    assert dm.vocab.names == WellFile(local_root / "toy/data/train/a.hdf5").field_names
    assert dm.stats("toy") == load_stats(local_root / "toy" / "stats.yaml")
    assert compute_stats(f"{memory_root}/toy") == compute_stats(local_root / "toy")
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.input_fields.shape == (2, 2, 4, 16, 8)


def test_url_errors_name_the_location(memory_root):
    assert data_root_exists(memory_root) and data_root_exists(memory_root + "/")
    assert not data_root_exists(memory_root + "/toy/stats.yaml")  # a file
    # object stores and the Hub have no folder objects: a missing dataset is named instead
    with pytest.raises(FileNotFoundError, match=r"nope/toy does not exist \(found: \[\]\)"):
        list_split_files(memory_root + "/nope", "toy", "train")
    with pytest.raises(FileNotFoundError, match=r"other does not exist \(found: \['toy'\]\)"):
        list_split_files(memory_root, "other", "train")
    with pytest.raises(FileNotFoundError, match="data/test does not exist"):
        list_split_files(memory_root, "toy", "test")
    with pytest.raises(ValueError, match=r"nosuchproto://x: cannot use this location"):
        data_root_exists("nosuchproto://x")
    with pytest.raises(ValueError, match="does not write under a URL"):
        write_stats(f"{memory_root}/toy")
    dm = WellDataModule(memory_root, ["navier_stokes_2d"], generate_if_missing=True)
    with pytest.raises(FileNotFoundError, match="nothing is generated under a URL"):
        dm.prepare_data()


def test_a_hub_organisation_is_a_data_root():
    pytest.importorskip("huggingface_hub")
    # not a repository, so fsspec cannot describe it; parsing it needs no network
    assert data_root_exists("hf://datasets/polymathic-ai/")


def test_inference_accepts_a_url_data_root(memory_root, tmp_path):
    ckpt = SimpleNamespace(data_config={"datasets": ["toy"]}, path="c.ckpt")
    data = resolve_data_config({}, ckpt, memory_root)
    assert data["root"] == memory_root
    with pytest.raises(FileNotFoundError, match="stats.yaml .*does not exist"):
        resolve_data_config({}, ckpt, memory_root + "/toy/stats.yaml")


def test_hostile_checks_apply_to_url_files(local_root, memory_root):
    path = local_root / "toy" / "data" / "train" / "b.hdf5"
    with h5py.File(path, "a") as f:
        f["dimensions/time"][5] = 0.0
    fsspec.filesystem("memory").pipe(
        memory_root.removeprefix("memory://") + "/toy/data/train/b.hdf5", path.read_bytes()
    )
    with pytest.raises(ValueError, match="does not increase") as info:
        WellDataset(memory_root, "toy", "train", 2, 1)
    assert f"{memory_root}/toy/data/train/b.hdf5" in str(info.value)
    fsspec.filesystem("memory").pipe(
        memory_root.removeprefix("memory://") + "/toy/stats.yaml", b"a: &x 1\nb: *x\n"
    )
    with pytest.raises(ValueError, match="anchors"):
        load_stats(f"{memory_root}/toy/stats.yaml")


def test_only_the_window_is_read(tmp_path, monkeypatch):
    path = _write(tmp_path, "big.hdf5", 4, 0, n_time=64)  # ~0.8 MB of fields
    read = []

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            data = self.f.read(n)
            read.append(len(data))
            return data

        def readinto(self, buf):
            n = self.f.readinto(buf)
            read.append(n)
            return n

        def __getattr__(self, name):
            return getattr(self.f, name)

    real = well_file.open_binary
    monkeypatch.setattr(well_file, "open_binary", lambda loc: Counting(real(loc)))
    ds = WellDataset(f"file://{tmp_path}", "toy", "train", 2, 1)
    read.clear()
    b = ds[len(ds) - 1]
    assert b.input_fields.shape == (1, 2, 4, 16, 8)
    assert 0 < sum(read) < path.stat().st_size / 5  # headers and 3 frames, not the file
