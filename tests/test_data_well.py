"""Reader and writer: round trip, a hand-built spec file, window arithmetic."""

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from walrus.bcs import BoundaryType
from walrus.data.batch import collate
from walrus.data.vocab import FieldVocabulary
from walrus.data.well_dataset import WellDataset, evenly_spaced
from walrus.data.well_file import WellFile, read_trajectory
from walrus.data.writer import write_well_file


def _write(
    root: Path,
    name="toy",
    split="train",
    n_traj=3,
    n_time=10,
    shape=(8, 6),
    seed=0,
    fname="a.hdf5",
    **kw,
):
    rng = np.random.default_rng(seed)
    axes = "xyz"[: len(shape)]
    coords = {a: np.linspace(0, 1, n) for a, n in zip(axes, shape)}
    fields = {"p": rng.standard_normal((n_traj, n_time, *shape)).astype(np.float32)}
    vec = {"u": rng.standard_normal((n_traj, n_time, *shape, len(shape))).astype(np.float32)}
    path = root / name / "data" / split / fname
    write_well_file(
        path,
        name,
        coords=coords,
        time=np.arange(n_time) * 0.5,
        n_trajectories=n_traj,
        fields=fields,
        vector_fields=vec,
        params={"Re": 100.0},
        scalars={"gamma": np.array([1.4])},
        **kw,
    )
    return path, fields, vec


def test_round_trip_identical(tmp_path):
    path, fields, vec = _write(tmp_path, bcs={"x": ("wall", "open"), "y": "periodic"})
    wf = WellFile(path)
    assert wf.field_names == ["p", "u_x", "u_y"]
    assert wf.n_trajectories == 3 and wf.n_time == 10 and wf.spatial_shape == (8, 6)
    assert wf.bcs.tolist() == [[BoundaryType.WALL, BoundaryType.OPEN], [BoundaryType.PERIODIC] * 2]
    assert wf.params == {"Re": 100.0}
    assert np.allclose(wf.scalars["gamma"], 1.4)
    frames, names, bcs = read_trajectory(path, 2)
    assert names == wf.field_names and np.array_equal(bcs, wf.bcs)
    assert frames.shape == (10, 3, 8, 6)
    assert np.array_equal(frames[:, 0], fields["p"][2])
    assert np.array_equal(np.moveaxis(frames[:, 1:], 1, -1), vec["u"][2])
    with h5py.File(path) as f:  # spec attributes and groups exist
        for key in (
            "dataset_name",
            "n_spatial_dims",
            "n_trajectories",
            "grid_type",
            "simulation_parameters",
        ):
            assert key in f.attrs
        for g in (
            "dimensions",
            "boundary_conditions",
            "scalars",
            "t0_fields",
            "t1_fields",
            "t2_fields",
        ):
            assert g in f
        assert f["t0_fields/p"].attrs["time_varying"] and f["t0_fields/p"].attrs["sample_varying"]


def test_writer_rejects_bad_shapes(tmp_path):
    with pytest.raises(ValueError, match="'p' has shape"):
        write_well_file(
            tmp_path / "x.hdf5",
            "t",
            coords={"x": np.arange(4)},
            time=np.arange(3),
            n_trajectories=1,
            fields={"p": np.zeros((1, 3, 5))},
        )
    assert not list(tmp_path.iterdir())  # nothing half-written


def _handbuilt(path: Path) -> dict:
    """A file written with raw h5py following the spec, with byte-string attributes like real Well files."""
    rng = np.random.default_rng(1)
    B, T, H, W = 2, 7, 4, 5
    s = lambda xs: np.array([x.encode() for x in xs], dtype="S")  # noqa: E731
    data = {
        "rho": rng.standard_normal((B, T, H, W)).astype(np.float32),
        "mask": rng.standard_normal((H, W)).astype(np.float32),  # constant in time, shared
        "temp0": rng.standard_normal((B, H, W)).astype(np.float32),  # constant in time
        "prof": rng.standard_normal((B, T, H)).astype(np.float32),  # constant along y
        "v": rng.standard_normal((B, T, H, W, 2)).astype(np.float32),
        "sigma": rng.standard_normal((B, T, H, W, 2, 2)).astype(np.float32),
    }
    with h5py.File(path, "w") as f:
        f.attrs.update(
            dataset_name=b"hand", n_spatial_dims=2, n_trajectories=B, grid_type=b"cartesian"
        )
        f.attrs["simulation_parameters"] = s(["Ma"])
        f.attrs["Ma"] = 0.3
        d = f.create_group("dimensions")
        d.attrs["spatial_dims"] = s(["x", "y"])
        d["time"] = np.linspace(0, 1, T).astype(np.float32)
        d["x"], d["y"] = np.arange(H, dtype=np.float32), np.arange(W, dtype=np.float32)
        bc = f.create_group("boundary_conditions")
        for gname, btype, dim, mask in (
            ("x_open", b"OPEN", "x", [1, 0, 0, 1]),
            ("y_wall_lo", b"WALL", "y", [1, 0, 0, 0, 0]),
            ("y_open_hi", b"open", "y", [0, 0, 0, 0, 1]),
        ):
            g = bc.create_group(gname)
            g.attrs["bc_type"], g.attrs["associated_dims"] = btype, s([dim])
            g.attrs["associated_fields"] = s([])
            g["mask"] = np.array(mask, dtype=bool)
        sc = f.create_group("scalars")
        sc.attrs["field_names"] = s([])
        t0 = f.create_group("t0_fields")
        t0.attrs["field_names"] = s(["rho", "mask", "temp0", "prof"])
        for name, tv, sv, dv in (
            ("rho", True, True, [True, True]),
            ("mask", False, False, [True, True]),
            ("temp0", False, True, [True, True]),
            ("prof", True, True, [True, False]),
        ):
            ds = t0.create_dataset(name, data=data[name])
            ds.attrs.update(time_varying=tv, sample_varying=sv, dim_varying=np.array(dv))
        t1 = f.create_group("t1_fields")
        t1.attrs["field_names"] = s(["v"])
        t1.create_dataset("v", data=data["v"]).attrs.update(time_varying=True, sample_varying=True)
        t2 = f.create_group("t2_fields")
        t2.attrs["field_names"] = s(["sigma"])
        t2.create_dataset("sigma", data=data["sigma"]).attrs.update(
            time_varying=True, sample_varying=True, symmetric=False
        )
    return data


def test_handbuilt_spec_file(tmp_path):
    sdir = tmp_path / "hand" / "data" / "valid"
    sdir.mkdir(parents=True)
    data = _handbuilt(sdir / "f.hdf5")
    ds = WellDataset(tmp_path, "hand", "valid", n_steps_input=2, n_steps_output=1, time_stride=2)
    assert ds.field_names == [
        "rho",
        "mask",
        "temp0",
        "prof",
        "v_x",
        "v_y",
        "sigma_xx",
        "sigma_xy",
        "sigma_yx",
        "sigma_yy",
    ]
    assert ds.bcs.tolist() == [
        [BoundaryType.OPEN, BoundaryType.OPEN],
        [BoundaryType.WALL, BoundaryType.OPEN],
    ]
    assert ds.files[0].params == {"Ma": pytest.approx(0.3)}
    assert len(ds) == 2 * (7 - 4)  # span (3-1)*2+1 = 5 -> starts 0..2
    b = ds[4]  # trajectory 1, start 1 -> frames 1, 3, 5
    assert b.metadata["trajectory"].item() == 1 and b.metadata["start"].item() == 1
    x = torch.cat([b.input_fields, b.output_fields], dim=1)[0]  # (3, C, H, W)
    t = [1, 3, 5]
    assert np.array_equal(x[:, 0].numpy(), data["rho"][1, t])
    assert np.array_equal(x[:, 1].numpy(), np.broadcast_to(data["mask"], (3, 4, 5)))
    assert np.array_equal(x[:, 2].numpy(), np.broadcast_to(data["temp0"][1], (3, 4, 5)))
    assert np.array_equal(
        x[:, 3].numpy(), np.broadcast_to(data["prof"][1, t][:, :, None], (3, 4, 5))
    )
    assert np.array_equal(x[:, 4].numpy(), data["v"][1, t, ..., 0])
    assert np.array_equal(x[:, 7].numpy(), data["sigma"][1, t, ..., 0, 1])  # sigma_xy
    assert np.array_equal(x[:, 8].numpy(), data["sigma"][1, t, ..., 1, 0])  # sigma_yx
    assert b.metadata["dt"].item() == pytest.approx(2 / 6)


def test_field_subset_and_vocab(tmp_path):
    _write(tmp_path)
    vocab = FieldVocabulary(["zeta", "u_y", "p", "u_x"])
    ds = WellDataset(tmp_path, "toy", "train", 2, 1, vocab=vocab, fields=["u", "p"])
    assert ds.field_names == ["u_x", "u_y", "p"]
    b = ds[0]
    assert b.field_ids.tolist() == [3, 1, 2]
    assert b.input_fields.shape == (1, 2, 3, 8, 6)


@pytest.mark.parametrize("stride", [1, 3])
def test_window_arithmetic_exact(tmp_path, stride):
    _, f1, _ = _write(tmp_path, n_traj=2, n_time=16, fname="a.hdf5", seed=0)
    _, f2, _ = _write(tmp_path, n_traj=1, n_time=16, fname="b.hdf5", seed=1)
    n_in, n_out = 3, 2
    ds = WellDataset(tmp_path, "toy", "train", n_in, n_out, time_stride=stride, fields=["p"])
    per = 16 - (n_in + n_out - 1) * stride
    assert len(ds) == 3 * per
    refs = [f1["p"][0], f1["p"][1], f2["p"][0]]
    for idx in (0, per - 1, per, 2 * per, len(ds) - 1):  # ends of every trajectory
        b = ds[idx]
        traj, start = divmod(idx, per)
        got = torch.cat([b.input_fields, b.output_fields], 1)[0, :, 0].numpy()
        want = refs[traj][start : start + (n_in + n_out - 1) * stride + 1 : stride]
        assert np.array_equal(got, want)
        assert b.metadata["trajectory"].item() == traj and b.metadata["start"].item() == start
    last = ds[len(ds) - 1]
    assert (
        last.metadata["start"].item() + (n_in + n_out - 1) * stride == 15
    )  # ends on the last frame
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_stride_range_draws_fit(tmp_path):
    _write(tmp_path, n_traj=1, n_time=12)
    ds = WellDataset(tmp_path, "toy", "train", 2, 1, time_stride=(1, 4), train=True, fields=["p"])
    assert len(ds) == 10  # indexed at the lowest stride
    torch.manual_seed(0)
    seen = set()
    for i in range(len(ds)):
        for _ in range(5):
            b = ds[i]
            s, start = b.metadata["stride"].item(), b.metadata["start"].item()
            assert 1 <= s <= 4 and start + 2 * s <= 11
            seen.add(s)
    assert seen == {1, 2, 3, 4}
    assert all(
        WellDataset(tmp_path, "toy", "train", 2, 1, time_stride=(1, 4), fields=["p"])[i]
        .metadata["stride"]
        .item()
        == 1
        for i in range(3)
    )


def test_trajectory_for_rollout(tmp_path):
    _, f, _ = _write(tmp_path, n_traj=2, n_time=10)
    ds = WellDataset(tmp_path, "toy", "train", 3, 1)
    b = ds.trajectory(1, stride=2)
    assert b.input_fields.shape == (1, 3, 3, 8, 6) and b.output_fields.shape == (1, 2, 3, 8, 6)
    assert np.array_equal(b.output_fields[0, :, 0].numpy(), f["p"][1, 6::2])


def test_trajectory_from_mid_trajectory_reads_only_its_frames(tmp_path, monkeypatch):
    _, f, _ = _write(tmp_path, n_traj=2, n_time=12, fname="a.hdf5", seed=0)
    _write(tmp_path, n_traj=3, n_time=12, fname="b.hdf5", seed=1)
    ds = WellDataset(tmp_path, "toy", "train", 2, 1)
    assert ds.locate_trajectory(1) == (0, 1) and ds.locate_trajectory(4) == (1, 2)
    assert ds.frames_available(3, stride=2) == 6 and ds.frames_available(3) == 12
    reads = []
    read = WellFile.read
    monkeypatch.setattr(
        WellFile,
        "read",
        lambda self, h, sel, traj, start, n, *a: (
            reads.append((start, n)) or read(self, h, sel, traj, start, n, *a)
        ),
    )
    b = ds.trajectory(1, stride=2, n_frames=4, start=1)
    assert reads == [(2, 4)]  # time indices 2, 4, 6, 8 only
    assert b.input_fields.shape == (1, 2, 3, 8, 6) and b.output_fields.shape == (1, 2, 3, 8, 6)
    frames = torch.cat([b.input_fields, b.output_fields], dim=1)[0, :, 0].numpy()
    assert np.array_equal(frames, f["p"][1, 2:9:2])
    assert b.metadata["start"].item() == 2 and b.metadata["trajectory"].item() == 1
    with pytest.raises(ValueError, match="from frame 5"):
        ds.trajectory(1, stride=2, n_frames=2, start=5)  # only frame 5 is left at stride 2
    with pytest.raises(IndexError, match="out of range"):
        ds.locate_trajectory(5)


def test_evenly_spaced():
    assert evenly_spaced(5, None) == [0, 1, 2, 3, 4] and evenly_spaced(3, 7) == [0, 1, 2]
    assert evenly_spaced(10, 4) == [0, 3, 6, 9] and evenly_spaced(100, 1) == [0]


def test_dataloader_workers_open_own_handles(tmp_path):
    _write(tmp_path, n_traj=2, n_time=8)
    ds = WellDataset(tmp_path, "toy", "train", 2, 1)
    ds[0]  # parent opens a handle before the fork
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate)
    batches = list(loader)
    got = torch.cat([b.input_fields for b in batches])
    want = torch.cat([ds[i].input_fields for i in range(len(ds))])
    assert torch.equal(got, want)
    assert batches[0].metadata["trajectory"].shape == (4,) and len(batches[0].metadata["file"]) == 4
    assert batches[0].metadata["field_names"] == ("p", "u_x", "u_y")


def test_3d_and_constant_velocity(tmp_path):
    rng = np.random.default_rng(0)
    c = rng.standard_normal((2, 5, 4, 4, 4)).astype(np.float32)
    u = rng.standard_normal((2, 4, 4, 4, 3)).astype(np.float32)
    write_well_file(
        tmp_path / "d3" / "data" / "test" / "f.hdf5",
        "d3",
        coords={a: np.arange(4.0) for a in "xyz"},
        time=np.arange(5.0),
        n_trajectories=2,
        fields={"c": c},
        vector_fields={"u": u},
        varying={"u": (False, True)},
    )
    ds = WellDataset(tmp_path, "d3", "test", 2, 2)
    b = ds[len(ds) - 1]
    assert b.input_fields.shape == (1, 2, 4, 4, 4, 4) and ds.bcs.shape == (3, 2)
    assert torch.equal(b.output_fields[0, 1, 1:].permute(1, 2, 3, 0), torch.from_numpy(u[1]))


@pytest.mark.parametrize(
    ("field", "time", "match"),
    [
        (np.zeros((1, 3, 4), np.complex64), np.arange(3.0), "dtype complex64"),
        (np.zeros((1, 3, 4), bool), np.arange(3.0), "dtype bool"),
        (np.zeros((1, 3, 4)), np.array([0.0, np.nan, 2.0]), "NaN or Inf"),
        (np.zeros((1, 3, 4)), np.arange(3) + 0j, "real numbers"),
    ],
    ids=["complex", "bool", "nan_time", "complex_time"],
)
def test_writer_refuses_values_the_reader_refuses(tmp_path, field, time, match):
    """Complex parts are not dropped silently: what the reader refuses, the writer refuses."""
    with pytest.raises(ValueError, match=match):
        write_well_file(
            tmp_path / "x.hdf5",
            "t",
            coords={"x": np.arange(4)},
            time=time,
            n_trajectories=1,
            fields={"p": field},
        )
    assert not list(tmp_path.iterdir())
