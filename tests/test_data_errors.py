"""Each bad input gets a clear error naming the file (and field, trajectory, time index)."""

import os
import re

import h5py
import numpy as np
import pytest

from walrus.data.well_dataset import WellDataset
from walrus.data.well_file import WellFile
from walrus.data.writer import write_well_file


def _write(root, n_time=8, p=None):
    rng = np.random.default_rng(0)
    p = rng.standard_normal((2, n_time, 4, 4)).astype(np.float32) if p is None else p
    path = root / "toy" / "data" / "train" / "f.hdf5"
    write_well_file(
        path,
        "toy",
        coords={"x": np.arange(4.0), "y": np.arange(4.0)},
        time=np.arange(n_time),
        n_trajectories=2,
        fields={"p": p},
        bcs={"x": "wall"},
    )
    return path


def _ds(root, **kw):
    return WellDataset(root, "toy", "train", kw.pop("n_in", 2), kw.pop("n_out", 1), **kw)


def test_missing_root(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope"))):
        WellDataset(tmp_path / "nope", "toy", "train")


def test_missing_dataset_and_split(tmp_path):
    _write(tmp_path)
    with pytest.raises(FileNotFoundError, match="other.*does not exist"):
        WellDataset(tmp_path, "other", "train")
    with pytest.raises(FileNotFoundError, match=r"data/valid does not exist"):
        WellDataset(tmp_path, "toy", "valid")


def test_directory_without_hdf5(tmp_path):
    (tmp_path / "toy" / "data" / "train").mkdir(parents=True)
    (tmp_path / "toy" / "data" / "train" / "readme.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="holds no .hdf5 files"):
        _ds(tmp_path)


def test_not_hdf5(tmp_path):
    path = tmp_path / "toy" / "data" / "train" / "bad.hdf5"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"this is not an hdf5 file" * 10)
    with pytest.raises(ValueError, match=r"bad\.hdf5: cannot be opened as HDF5"):
        _ds(tmp_path)


def test_truncated(tmp_path):
    path = _write(tmp_path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ValueError, match=r"f\.hdf5.*(truncated|malformed|cannot read)"):
        ds = _ds(tmp_path)
        for i in range(len(ds)):
            ds[i]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda f: f.__delitem__("dimensions"), "group 'dimensions' is missing"),
        (lambda f: f.attrs.__delitem__("n_spatial_dims"), "attribute 'n_spatial_dims' is missing"),
        (
            lambda f: f["t0_fields"].attrs.__delitem__("field_names"),
            "attribute 'field_names' is missing",
        ),
        (lambda f: f["dimensions"].__delitem__("time"), "'dimensions/time' is missing"),
        (
            lambda f: f["boundary_conditions/x_wall"].attrs.__setitem__("bc_type", "slippery"),
            "unknown boundary type",
        ),
    ],
)
def test_missing_groups_and_attributes(tmp_path, edit, message):
    path = _write(tmp_path)
    with h5py.File(path, "a") as f:
        edit(f)
    with pytest.raises(ValueError, match=message) as err:
        _ds(tmp_path)
    assert str(path) in str(err.value)


def test_field_shape_disagrees_with_dimensions(tmp_path):
    path = _write(tmp_path)
    with h5py.File(path, "a") as f:
        del f["t0_fields/p"]
        f["t0_fields"].create_dataset("p", data=np.zeros((2, 8, 4, 5), np.float32))
    with pytest.raises(ValueError, match=r"f\.hdf5: field t0_fields/p has shape \(2, 8, 4, 5\)"):
        _ds(tmp_path)


def test_nan_in_window_is_located(tmp_path):
    p = np.ones((2, 8, 4, 4), np.float32)
    p[1, 5, 2, 2] = np.nan
    path = _write(tmp_path, p=p)
    ds = _ds(tmp_path)  # windows of 3 frames; 6 per trajectory
    assert ds[0].input_fields.isfinite().all() and ds[6 + 2].output_fields.isfinite().all()
    with pytest.raises(
        ValueError, match=r"NaN or Inf in field 'p', trajectory 1, time index 5"
    ) as err:
        ds[6 + 3]  # frames 3, 4, 5 of trajectory 1
    assert str(path) in str(err.value)
    p[1, 5, 2, 2] = np.inf
    _write(tmp_path, p=p)
    with pytest.raises(ValueError, match="NaN or Inf"):
        _ds(tmp_path)[6 + 5]


def test_window_longer_than_trajectory(tmp_path):
    _write(tmp_path, n_time=5)
    with pytest.raises(
        ValueError, match=r"f\.hdf5: a window of 6 frames .* longer than the trajectory \(5 steps\)"
    ):
        _ds(tmp_path, n_in=4, n_out=2)
    with pytest.raises(ValueError, match="longer than the trajectory"):
        _ds(tmp_path, n_in=2, n_out=1, time_stride=3)


def test_unknown_field(tmp_path):
    _write(tmp_path)
    with pytest.raises(
        ValueError, match=r"f\.hdf5: unknown field 'velocity_x'; this file has \['p'\]"
    ):
        _ds(tmp_path, fields=["velocity_x"])


def test_bad_options(tmp_path):
    _write(tmp_path)
    with pytest.raises(ValueError, match="time_stride"):
        _ds(tmp_path, time_stride=(3, 1))
    with pytest.raises(ValueError, match="n_steps_input"):
        _ds(tmp_path, n_in=0)


def test_read_out_of_range(tmp_path):
    path = _write(tmp_path)
    wf = WellFile(path)
    with h5py.File(path) as h, pytest.raises(ValueError, match="trajectory 5 out of range"):
        wf.read(h, wf.select(None), 5, 0, 2)
    assert os.path.exists(path)
