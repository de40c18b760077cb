"""data.train_trajectories: training on the first N trajectories of the train split."""

from __future__ import annotations

import numpy as np
import pytest
from hydra.utils import instantiate

from walrus.data.datamodule import WellDataModule
from walrus.data.well_dataset import WellDataset
from walrus.data.writer import write_well_file

N_TIME = 8  # 4 windows of 4 + 1 frames per trajectory (one validation window of 4 + 4)


def _write(root, name, files):
    """Dataset ``name`` whose train split has one file per entry of ``files`` (trajectories per
    file, written in that name order); every frame of split-wide trajectory i holds the value i."""
    first = 0
    for k, n in enumerate(files):
        traj = np.arange(first, first + n, dtype=float)[:, None, None, None]  # (n, 1, 1, 1)
        write_well_file(
            root / name / "data" / "train" / f"part{k}.hdf5",
            name,
            coords={"x": np.arange(4.0), "y": np.arange(4.0)},
            time=np.arange(float(N_TIME)),
            n_trajectories=n,
            fields={"u": np.broadcast_to(traj, (n, N_TIME, 4, 4)).copy()},
        )
        first += n
    for split in ("valid", "test"):
        write_well_file(
            root / name / "data" / split / "f.hdf5",
            name,
            coords={"x": np.arange(4.0), "y": np.arange(4.0)},
            time=np.arange(float(N_TIME)),
            n_trajectories=2,
            fields={"u": np.ones((2, N_TIME, 4, 4))},
        )


def _served(ds):
    """The trajectory (as written into the frames) of every window ``ds`` serves."""
    return [int(ds[i].input_fields[0, 0, 0, 0, 0]) for i in range(len(ds))]


def test_the_dataset_serves_exactly_the_first_n_trajectories_in_file_order(tmp_path):
    _write(tmp_path, "toy", [3, 2])
    full = WellDataset(tmp_path, "toy", "train", 4, 1)
    assert full.n_trajectories == 5 and len(full) == 5 * 4
    four = WellDataset(tmp_path, "toy", "train", 4, 1, trajectories=4)
    assert four.n_trajectories == 4 and len(four) == 4 * 4
    # all of the first file, then the first trajectory of the second
    assert _served(four) == [t for t in range(4) for _ in range(4)]
    assert [i for i, _ in (four.locate_trajectory(t) for t in range(4))] == [0, 0, 0, 1]
    two = WellDataset(tmp_path, "toy", "train", 4, 1, trajectories=2)
    assert len(two.files) == 1 and _served(two) == [0] * 4 + [1] * 4


@pytest.mark.parametrize("n", [0, 6])
def test_n_outside_the_split_is_one_line_naming_the_option(tmp_path, n):
    _write(tmp_path, "toy", [3, 2])
    with pytest.raises(ValueError) as e:
        WellDataset(tmp_path, "toy", "train", 4, 1, trajectories=n)
    assert str(e.value) == (
        f"data.train_trajectories={n}: the train split of toy holds 5 trajectories; "
        "give a whole number from 1 to 5, or null for all"
    )


def test_the_datamodule_limits_train_only_and_each_dataset(tmp_path):
    _write(tmp_path, "big", [3, 2])
    _write(tmp_path, "small", [2])
    dm = WellDataModule(tmp_path, ["big", "small"], batch_size=1, train_trajectories=2)
    dm.setup("fit")
    big, small = dm._datasets("train")
    assert (big.n_trajectories, small.n_trajectories) == (2, 2)
    assert _served(big) == _served(small) == [0] * 4 + [1] * 4
    # validation is the whole split whatever N is
    assert [d.n_trajectories for d in dm._datasets("valid")] == [2, 2]
    train_batches = list(dm.train_dataloader())
    assert len(train_batches) == 16
    assert {int(b.metadata["trajectory"][0]) for b in train_batches} == {0, 1}

    over = WellDataModule(tmp_path, ["big", "small"], train_trajectories=3)
    with pytest.raises(ValueError, match=r"=3: the train split of small holds 2 trajectories"):
        over.setup("fit")


def test_the_option_reaches_the_datamodule_from_the_config(tmp_path, compose_cfg):
    _write(tmp_path, "toy", [3, 2])
    default = compose_cfg("train", ["data.datasets=[toy]", f"paths.data_dir={tmp_path}"])
    assert default.data.train_trajectories is None
    cfg = compose_cfg(
        "train",
        ["data.datasets=[toy]", f"paths.data_dir={tmp_path}", "data.train_trajectories=1"],
    )
    dm = instantiate(cfg.data)
    dm.setup("fit")
    assert _served(dm._datasets("train")[0]) == [0] * 4
