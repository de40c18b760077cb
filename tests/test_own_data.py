"""A dataset of one's own in The Well's format: boundary rules as The Well applies them,
predictions in the input's own layout, one data-location option, and the whole path from
training with a time budget to The Well's reader opening our predictions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from the_well.data import WellDataset as TheWellDataset
from the_well.utils.dummy_data import write_dummy_data

from tests.conftest import REPO
from walrus.bcs import BoundaryType
from walrus.checkpoint import load_checkpoint_file
from walrus.data.datamodule import resolve_data_root
from walrus.data.well_dataset import WellDataset
from walrus.data.well_file import WellFile, read_trajectory
from walrus.data.writer import write_well_file
from walrus.inference.report import write_predictions

WALL, OPEN, PER = int(BoundaryType.WALL), int(BoundaryType.OPEN), int(BoundaryType.PERIODIC)


def _the_wells_bcs(dataset_dir: Path) -> np.ndarray:
    """Boundary codes ``(n_spatial, 2)`` as The Well's own ``WellDataset`` returns them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ds = TheWellDataset(path=str(dataset_dir), well_split_name="train")
        return ds[0]["boundary_conditions"].numpy().astype(np.int64)


def _dummy_dataset(root: Path, name: str, seed: int = 0) -> Path:
    """``root/name`` with train/valid/test files from The Well's own dummy-data writer."""
    np.random.seed(seed)  # the writer draws from numpy's global generator
    for split in ("train", "valid", "test"):
        path = root / name / "data" / split / f"{split}.hdf5"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_dummy_data(str(path))
    return root / name


def test_reader_reads_the_wells_dummy_file_like_the_well(tmp_path: Path) -> None:
    ddir = _dummy_dataset(tmp_path, "dummy")
    path = ddir / "data" / "train" / "train.hdf5"
    wf = WellFile(path)  # its periodic masks are all false: every side is open
    assert wf.bcs.tolist() == [[OPEN, OPEN], [OPEN, OPEN]]
    assert np.array_equal(wf.bcs, _the_wells_bcs(ddir))
    assert wf.field_names == ["constant_field", "field_x", "field_y"]
    assert wf.scalars["time_varying_scalar"].shape == (10,)  # the time-varying scalar
    ours = WellDataset(tmp_path, "dummy", "train", n_steps_input=2, n_steps_output=1)
    batch = ours[3]  # trajectory 0, frames 3, 4 | 5
    theirs = TheWellDataset(
        path=str(ddir), well_split_name="train", n_steps_input=2, n_steps_output=1
    )[3]
    with h5py.File(path) as f:
        constant = f["t0_fields/constant_field"][0]  # (H, W), no time axis
    assert batch.input_fields.shape == (1, 2, 3, 32, 32)  # (B, T, C, H, W)
    for t in range(2):  # the constant field is broadcast over time
        np.testing.assert_array_equal(batch.input_fields[0, t, 0].numpy(), constant)
    # the vector field's components match The Well's sample, (T, H, W, C) there
    np.testing.assert_array_equal(
        batch.input_fields[0, :, 1:].numpy(), theirs["input_fields"].permute(0, 3, 1, 2).numpy()
    )
    np.testing.assert_array_equal(
        batch.output_fields[0, :, 1:].numpy(), theirs["output_fields"].permute(0, 3, 1, 2).numpy()
    )


def _with_boundaries(root: Path, groups: list[tuple[str, str, list[str], np.ndarray]]) -> Path:
    """A 2-D (x: 4, y: 5) Well file whose boundary_conditions are exactly ``groups``."""
    path = root / "case" / "data" / "train" / "f.hdf5"
    write_well_file(
        path,
        "case",
        coords={"x": np.arange(4.0), "y": np.arange(5.0)},
        time=np.arange(3.0),
        n_trajectories=1,
        fields={"p": np.zeros((1, 3, 4, 5), np.float32)},
    )
    with h5py.File(path, "a") as f:
        del f["boundary_conditions"]
        bc = f.create_group("boundary_conditions")
        for name, kind, dims, mask in groups:
            g = bc.create_group(name)
            g.attrs["bc_type"] = kind
            g.attrs["associated_dims"] = dims
            g.attrs["associated_fields"] = []
            g.create_dataset("mask", data=np.asarray(mask, dtype=bool))
    return path


def _plane(x_lo=(), x_hi=(), y_lo=(), y_hi=()) -> np.ndarray:
    """A ``(4, 5)`` mask set at the given y (x sides) or x (y sides) indices."""
    m = np.zeros((4, 5), bool)
    m[0, list(x_lo)], m[-1, list(x_hi)] = True, True
    m[list(y_lo), 0], m[list(y_hi), -1] = True, True
    return m


@pytest.mark.parametrize(
    ("groups", "expected", "warns"),
    [
        # an axis no group marks is open
        ([("x_periodic", "PERIODIC", ["x"], [1, 0, 0, 1])], [[PER, PER], [OPEN, OPEN]], False),
        # one side marked
        ([("x_wall", "wall", ["x"], [0, 0, 0, 1])], [[OPEN, WALL], [OPEN, OPEN]], False),
        # a group over both axes: a wall needs all of a side, open/periodic any of it
        (
            [("walls", "WALL", ["x", "y"], _plane(x_lo=range(5), x_hi=[0, 1], y_lo=range(4)))],
            [[WALL, OPEN], [WALL, OPEN]],
            True,
        ),
        (
            [
                ("a_wall", "WALL", ["x"], [1, 0, 0, 1]),
                ("b_open", "OPEN", ["x", "y"], _plane(x_hi=[2])),
            ],
            [[WALL, OPEN], [OPEN, OPEN]],
            True,
        ),
        # groups apply in the file's order; a later one replaces an earlier one where it marks
        (
            [
                ("a_wall", "WALL", ["x", "y"], np.ones((4, 5))),
                ("b_periodic", "PERIODIC", ["x", "y"], _plane(x_hi=[3])),
            ],
            [[WALL, PER], [WALL, WALL]],
            True,
        ),
    ],
)
def test_boundary_rules_are_the_wells(tmp_path: Path, groups, expected, warns) -> None:
    path = _with_boundaries(tmp_path, groups)
    if warns:
        with pytest.warns(RuntimeWarning, match="spans axes.*wall only if all of it is"):
            wf = WellFile(path)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            wf = WellFile(path)
    assert wf.bcs.tolist() == expected
    assert np.array_equal(wf.bcs, _the_wells_bcs(tmp_path / "case"))


def test_boundary_mask_must_fit_its_axes(tmp_path: Path) -> None:
    path = _with_boundaries(tmp_path, [("x_open", "open", ["x"], np.ones((2, 2, 2)))])
    with pytest.raises(ValueError, match=r"boundary_conditions/x_open: mask has 3 axes"):
        WellFile(path)


def _mixed_ranks(root: Path) -> Path:
    """A dataset ``mine`` with a scalar, a vector and a tensor field (2 trajectories)."""
    rng = np.random.default_rng(0)
    write_well_file(
        root / "mine" / "data" / "test" / "f.hdf5",
        "mine",
        coords={"x": np.arange(6.0), "y": np.arange(5.0)},
        time=np.arange(7.0) * 0.5,
        n_trajectories=2,
        fields={"p": rng.standard_normal((2, 7, 6, 5)).astype(np.float32)},
        vector_fields={"u": rng.standard_normal((2, 7, 6, 5, 2)).astype(np.float32)},
        tensor_fields={"sigma": rng.standard_normal((2, 7, 6, 5, 2, 2)).astype(np.float32)},
        bcs={"x": "wall", "y": ("open", "periodic")},
    )
    return root / "mine"


def test_predictions_keep_the_inputs_vectors_and_tensors(tmp_path: Path) -> None:
    _mixed_ranks(tmp_path / "data")
    ds = WellDataset(tmp_path / "data", "mine", "test", n_steps_input=2, n_steps_output=0)
    truth = [read_trajectory(ds.files[0].path, i)[0][2:] for i in range(2)]  # (5, C, H, W)
    out = tmp_path / "pred"
    write_predictions(out / "predictions.hdf5", ds, truth, 0, 2, 1)
    with h5py.File(out / "predictions.hdf5") as f:
        assert [
            list(f[g].attrs["field_names"]) for g in ("t0_fields", "t1_fields", "t2_fields")
        ] == [["p"], ["u"], ["sigma"]]
        assert f["t1_fields/u"].shape == (2, 5, 6, 5, 2)
        assert f["t2_fields/sigma"].shape == (2, 5, 6, 5, 2, 2)
    frames, names, bcs = read_trajectory(out / "predictions.hdf5", 1)
    assert names == ds.field_names  # p, u_x, u_y, sigma_xx, sigma_xy, sigma_yx, sigma_yy
    np.testing.assert_array_equal(frames, truth[1])
    assert bcs.tolist() == [[WALL, WALL], [OPEN, PER]]
    # The Well reads it as a dataset, with the input's fields in their groups
    theirs = TheWellDataset(path=str(out), n_steps_input=1, n_steps_output=1)
    assert theirs.metadata.field_names == {
        0: ["p"],
        1: ["u_x", "u_y"],
        2: ["sigma_xx", "sigma_xy", "sigma_yx", "sigma_yy"],
    }
    sample = theirs[0]  # trajectory 0, frame 0 | 1
    np.testing.assert_array_equal(sample["input_fields"][0].permute(2, 0, 1).numpy(), truth[0][0])
    assert sample["boundary_conditions"].tolist() == [[WALL, WALL], [OPEN, PER]]


def test_predictions_of_some_components_store_each_as_a_scalar(tmp_path: Path) -> None:
    _mixed_ranks(tmp_path / "data")
    fields = ["u_y", "p"]
    ds = WellDataset(tmp_path / "data", "mine", "test", 2, 0, fields=fields)
    truth = [read_trajectory(ds.files[0].path, 0, fields=fields)[0][2:]]  # (5, 2, H, W)
    path = write_predictions(tmp_path / "predictions.hdf5", ds, truth, 0, 2, 1)
    frames, names, _ = read_trajectory(path, 0, fields=fields)
    assert names == fields
    assert [(fi.group, fi.name) for fi in WellFile(path).fields] == [
        ("t0_fields", "u_y"),
        ("t0_fields", "p"),
    ]
    np.testing.assert_array_equal(frames, truth[0])


def test_data_root_option_and_its_old_name() -> None:
    assert resolve_data_root("/d", None) == "/d"
    assert resolve_data_root("/d", "/d") == "/d"  # a data config's root follows paths.data_dir
    assert resolve_data_root(None, None) is None
    with pytest.warns(FutureWarning, match=r"data.root is the old name of paths.data_dir.*/old"):
        assert resolve_data_root("/d", "/old") == "/old"


def test_inference_reads_data_from_paths_data_dir(tmp_path: Path) -> None:
    from walrus.data.vocab import FieldVocabulary
    from walrus.inference.loading import InferenceCheckpoint, resolve_data_config

    gone = tmp_path / "moved_away"
    ckpt = InferenceCheckpoint(
        tmp_path / "x.ckpt",
        None,
        FieldVocabulary(["p"]),
        True,
        {"root": str(gone), "datasets": ["a"]},
    )
    here = str(tmp_path)
    assert resolve_data_config({"root": None}, ckpt, data_dir=here)["root"] == here
    with pytest.raises(FileNotFoundError, match=r"moved_away \(checkpoint's training data root\) "
                       r"does not exist; pass paths.data_dir=DIR"):  # fmt: skip
        resolve_data_config({"root": None}, ckpt, data_dir=None)
    with pytest.warns(FutureWarning, match="Pass paths.data_dir="):
        assert resolve_data_config({"root": here}, ckpt)["root"] == here


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WALRUS_DATA_DIR", None)
    env.pop("WALRUS_TRACEBACK", None)
    proc = subprocess.run(
        [sys.executable, script, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def test_own_dataset_trains_on_a_time_budget_rolls_out_and_the_well_reads_it(
    tmp_path: Path,
) -> None:
    """The data guide's "Train on your own data": the same commands, sized for a test."""
    data, run, out = tmp_path / "my_data", tmp_path / "runs" / "my_solver", tmp_path / "rollout"
    _dummy_dataset(data, "my_solver_runs")  # a name we do not ship, written by The Well's code
    _run(
        "train.py",
        "experiment=quickstart",
        f"paths.data_dir={data}",
        "data.datasets=[my_solver_runs]",
        "trainer.max_time=00:00:00:08",
        f"hydra.run.dir={run}",
        # test sizing
        "model=tiny",
        "trainer.max_epochs=10000",
        "data.batch_size=2",
        "data.max_val_windows=2",
    )
    ckpt = load_checkpoint_file(run / "checkpoints" / "last.ckpt")
    steps = ckpt["global_step"]
    assert 1 <= steps < 10000 * 6  # the time budget ended the run, not the epochs
    lr = ckpt["optimizer_states"][0]["param_groups"][0]["lr"]
    scheduler = ckpt["lr_schedulers"][0]
    assert lr == pytest.approx(scheduler["base_lrs"][0] * scheduler["min_ratio"], rel=1e-6)
    assert ckpt["walrus"]["data_config"]["root"] == str(data)

    proc = _run(
        "infer.py",
        "rollout",
        f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
        f"paths.data_dir={data}",
        f"out={out}",
        "plots=false",
    )
    assert "FutureWarning" not in proc.stderr
    assert (out / "infer.log").is_file() and (out / ".hydra" / "config.yaml").is_file()
    report = json.loads((out / "metrics.json").read_text())
    assert report["datasets"]["my_solver_runs"]["steps"] == 10 - 4  # 4 context frames
    theirs = TheWellDataset(path=str(out), n_steps_input=1, n_steps_output=1)
    assert theirs.metadata.dataset_name == "my_solver_runs"
    assert theirs.metadata.field_names == {0: ["constant_field"], 1: ["field_x", "field_y"], 2: []}
    assert theirs.metadata.n_trajectories_per_file == [2]
    sample = theirs[0]
    assert (
        sample["input_fields"].shape == (1, 32, 32, 3)
        and torch.isfinite(sample["input_fields"]).all()
    )
    assert sample["boundary_conditions"].tolist() == [[OPEN, OPEN], [OPEN, OPEN]]
