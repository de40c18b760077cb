"""The mixing sampler and the DataModule over several datasets."""

from collections import Counter

import numpy as np
import pytest
import torch

from walrus.data.datamodule import WellDataModule
from walrus.data.sampler import MixedBatchSampler
from walrus.data.vocab import FieldVocabulary
from walrus.data.writer import write_well_file


def _owner(index, sizes):
    return int(np.searchsorted(np.cumsum(sizes), index, side="right"))


def test_sampler_one_dataset_per_batch_and_covers_all():
    sizes = [30, 7, 50]
    s = MixedBatchSampler(sizes, batch_size=4, shuffle=True, drop_last=True, seed=1)
    batches = list(s)
    assert len(batches) == len(s) == 7 + 1 + 12
    for b in batches:
        assert len(b) == 4 and len({_owner(i, sizes) for i in b}) == 1
    flat = [i for b in batches for i in b]
    assert len(set(flat)) == len(flat)  # no repeats within an epoch
    s.set_epoch(1)
    assert list(s) != batches  # reshuffled per epoch
    s.set_epoch(0)
    assert list(s) == batches  # deterministic given seed and epoch


def test_sampler_respects_weights():
    sizes = [40, 40, 40]
    s = MixedBatchSampler(sizes, batch_size=2, weights=[1.0, 3.0, 0.0], num_batches=4000, seed=0)
    counts = Counter(_owner(b[0], sizes) for b in s)
    assert counts[2] == 0
    assert counts[1] / 4000 == pytest.approx(0.75, abs=0.03)
    for b in s:
        assert len({_owner(i, sizes) for i in b}) == 1
        break


def test_sampler_ddp_ranks_disjoint_and_equal():
    sizes = [21, 13]
    parts = [list(MixedBatchSampler(sizes, 3, seed=5, num_replicas=3, rank=r)) for r in range(3)]
    assert len({len(p) for p in parts}) == 1 and len(parts[0]) == len(
        MixedBatchSampler(sizes, 3, num_replicas=3, rank=0)
    )
    flat = [i for p in parts for b in p for i in b]
    assert len(flat) == len(set(flat))


def test_sampler_eval_keeps_partial_batches_in_order():
    s = MixedBatchSampler([5, 3], batch_size=2, shuffle=False, drop_last=False)
    assert list(s) == [[0, 1], [2, 3], [4], [5, 6], [7]]


def test_padded_eval_sampler_serves_every_batch_once_and_names_the_repeats():
    # [5, 3] in batches of 2: 5 batches over 2 ranks -> rank 1 gets one repeat at the end
    sizes, world = [5, 3], 2
    samplers = [
        MixedBatchSampler(sizes, 2, shuffle=False, drop_last=False, num_replicas=world, rank=r,
                          pad=True)
        for r in range(world)
    ]  # fmt: skip
    parts = [list(s) for s in samplers]
    assert [len(p) for p in parts] == [3, 3] == [len(s) for s in samplers]
    real = [
        tuple(b) for s, p in zip(samplers, parts) for i, b in enumerate(p) if not s.is_padding(i)
    ]
    assert sorted(real) == sorted(map(tuple, [[0, 1], [2, 3], [4], [5, 6], [7]]))
    assert [s.is_padding(2) for s in samplers] == [False, True]
    one = MixedBatchSampler(sizes, 2, shuffle=False, drop_last=False, pad=True)
    assert len(list(one)) == 5 and not any(one.is_padding(i) for i in range(5))
    tiny = [
        MixedBatchSampler([1], 2, shuffle=False, drop_last=False, num_replicas=3, rank=r, pad=True)
        for r in range(3)
    ]
    assert [list(s) for s in tiny] == [[[0]]] * 3
    assert [s.is_padding(0) for s in tiny] == [False, True, True]


def test_sampler_bad_weights():
    with pytest.raises(ValueError, match="weights"):
        MixedBatchSampler([4, 4], 2, weights=[1.0])
    with pytest.raises(ValueError, match="too few samples"):
        MixedBatchSampler([4, 1], 2, weights=[1.0, 1.0])


def _toy(root, name, fields, shape, bcs, n_time=8):
    rng = np.random.default_rng(len(name))
    axes = "xyz"[: len(shape)]
    for split, n in (("train", 3), ("valid", 1), ("test", 1)):
        write_well_file(
            root / name / "data" / split / "f.hdf5",
            name,
            coords={a: np.arange(float(k)) for a, k in zip(axes, shape)},
            time=np.arange(float(n_time)),
            n_trajectories=n,
            fields={f: rng.standard_normal((n, n_time, *shape)) for f in fields},
            vector_fields={"velocity": rng.standard_normal((n, n_time, *shape, len(shape)))},
            bcs=bcs,
        )


def test_datamodule_serves_mixed_datasets(tmp_path):
    _toy(tmp_path, "alpha", ["density"], (8, 8), {"x": "wall"})
    _toy(tmp_path, "beta", ["tracer", "density"], (6, 6, 6), {})
    base = FieldVocabulary(["pressure", "density"])
    dm = WellDataModule(
        tmp_path,
        ["alpha", {"name": "beta", "weight": 2.0}],
        n_steps_input=2,
        n_steps_output=1,
        batch_size=2,
        base_vocab=base.to_dict(),
        max_val_windows=3,
        time_stride=(1, 2),
    )
    assert dm.vocab.names == [
        "pressure",
        "density",
        "velocity_x",
        "velocity_y",
        "tracer",
        "velocity_z",
    ]
    dm.setup("fit")
    seen = set()
    for b in dm.train_dataloader():
        name = b.metadata["dataset"]
        seen.add(name)
        assert b.batch_size == 2 and len(set(b.metadata["file"])) >= 1
        if name == "alpha":
            assert b.input_fields.shape == (2, 2, 3, 8, 8)
            assert b.field_ids.tolist() == [1, 2, 3] and b.bcs[0].tolist() == [0, 0]
        else:
            assert b.input_fields.shape == (2, 2, 5, 6, 6, 6)
            assert b.field_ids.tolist() == [4, 1, 2, 3, 5]
    assert seen == {"alpha", "beta"}
    val = list(dm.val_dataloader())
    assert sum(b.batch_size for b in val) == 6  # 3 windows kept per dataset
    assert [b.metadata["dataset"] for b in val] == ["alpha", "alpha", "beta", "beta"]
    assert all(b.metadata["stride"].eq(1).all() for b in val)
    dm.setup("test")
    assert len(list(dm.test_dataloader())) == 4


def test_datamodule_zscore_computes_stats(tmp_path):
    _toy(tmp_path, "alpha", ["density"], (8, 8), {})
    dm = WellDataModule(tmp_path, "alpha", normalization="zscore", n_steps_input=2)
    dm.prepare_data()
    assert (tmp_path / "alpha" / "stats.yaml").is_file()
    assert set(dm.stats("alpha")["std"]) == {"density", "velocity_x", "velocity_y"}


def test_datamodule_bad_config(tmp_path):
    with pytest.raises(ValueError, match="normalization"):
        WellDataModule(tmp_path, "a", normalization="minmax")
    with pytest.raises(ValueError, match="needs 'name'"):
        WellDataModule(tmp_path, [{"weight": 1.0}])
    dm = WellDataModule(tmp_path, "not_a_system", generate_if_missing=True)
    with pytest.raises(FileNotFoundError, match="built-in systems: navier_stokes_2d"):
        dm.prepare_data()
    assert not (tmp_path / "not_a_system").exists()


def test_generate_if_missing(tmp_path):
    dm = WellDataModule(
        tmp_path,
        ["navier_stokes_2d"],
        n_steps_input=2,
        batch_size=2,
        generate_if_missing=True,
        generate_kwargs={"n_traj": (2, 1, 1), "resolution": 16, "steps": 6},
    )
    with pytest.raises(FileNotFoundError, match="call prepare_data"):
        dm.vocab  # noqa: B018 - reading the vocabulary never generates data
    assert not (tmp_path / "navier_stokes_2d").exists()
    dm.prepare_data()
    assert dm.vocab.names == ["vorticity", "velocity_x", "velocity_y"]
    dm.setup("fit")
    b = next(iter(dm.train_dataloader()))
    assert b.input_fields.shape == (2, 2, 3, 16, 16) and torch.isfinite(b.input_fields).all()


def test_missing_dataset_is_an_error_unless_generation_was_asked_for(tmp_path):
    """A mistyped data root or a dataset not on disk is an error naming the folder, never
    silently generated data."""
    (tmp_path / "data" / "gray_scott_2d" / "data").mkdir(parents=True)
    dm = WellDataModule(tmp_path / "data", ["navier_stokes_2d"])
    with pytest.raises(FileNotFoundError) as err:
        dm.prepare_data()
    msg = str(err.value)
    assert str(tmp_path / "data" / "navier_stokes_2d" / "data") in msg
    assert "['gray_scott_2d']" in msg and "generate_if_missing=true" in msg
    with pytest.raises(FileNotFoundError, match="does not exist"):
        WellDataModule(tmp_path / "dat", ["navier_stokes_2d"]).prepare_data()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert not (tmp_path / "data" / "navier_stokes_2d").exists()


@pytest.mark.parametrize(
    ("overrides", "generate"),
    [
        (["data=navier_stokes_2d"], False),
        (["data=multi"], False),
        (["experiment=walrus_1b"], False),
        (["experiment=quickstart"], True),
        (["experiment=multi"], True),
    ],
)
def test_configs_generate_only_for_built_in_experiments(compose_cfg, overrides, generate):
    cfg = compose_cfg("train", overrides)
    assert cfg.data.generate_if_missing is generate


@pytest.mark.parametrize("weight", ["heavy", True, -1.0, float("inf")])
def test_a_bad_dataset_weight_names_the_option_and_the_dataset(weight):
    from walrus.data.datamodule import parse_dataset_specs

    with pytest.raises(ValueError, match=r"data.datasets entry 'ns': weight must be a finite"):
        parse_dataset_specs([{"name": "ns", "weight": weight}])
    assert parse_dataset_specs([{"name": "ns", "weight": 2}])[0].weight == 2.0
