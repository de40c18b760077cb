"""Hostile Well files and stats.yaml (issue 22, data side): one-line errors, bounded memory.

Each crafted case names what is wrong; property-based mutations of a valid file (hypothesis,
derandomised) end in a valid result or a one-line error naming the file, never another
exception; a subprocess under a 4 GB address-space cap shows the blow-ups end in errors.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from walrus.compat.inputs import read_config
from walrus.data.stats import load_stats
from walrus.data.storage import data_root_exists
from walrus.data.vocab import FieldVocabulary
from walrus.data.well_dataset import WellDataset
from walrus.data.well_file import MAX_WHOLE_ENTRIES, WellFile, open_h5, read_trajectory
from walrus.data.writer import write_well_file
from walrus.inference.loading import open_datasets, resolve_data_config
from walrus.safe_yaml import MAX_YAML_BYTES

REPO = Path(__file__).resolve().parents[1]
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError)
HUGE = 2 * 10**9


def _write(root: Path, p: np.ndarray | None = None, time: np.ndarray | None = None) -> Path:
    """A valid 2-trajectory, 8-frame file on a 4x4 grid: scalar p, vector u, wall on x."""
    rng = np.random.default_rng(0)
    p = rng.standard_normal((2, 8, 4, 4)).astype(np.float32) if p is None else p
    path = root / "toy" / "data" / "train" / "f.hdf5"
    write_well_file(
        path,
        "toy",
        coords={"x": np.arange(4.0), "y": np.arange(4.0)},
        time=np.arange(8.0) if time is None else time,
        n_trajectories=2,
        fields={"p": p},
        vector_fields={"u": rng.standard_normal((2, 8, 4, 4, 2)).astype(np.float32)},
        bcs={"x": "wall"},
        scalars={"gamma": np.array([1.4])},
    )
    return path


def _ds(root: Path, **kw) -> WellDataset:
    return WellDataset(root, "toy", "train", 2, 1, **kw)


def _check_error(err: BaseException, *names: object) -> str:
    """A user error on one line naming one of ``names``; returns the message."""
    msg = str(err)
    assert isinstance(err, USER_ERRORS), f"{type(err).__name__}: {msg}"
    assert "\n" not in msg, msg
    assert any(str(n) in msg for n in names), msg
    return msg


def _refused(fn, *names: object) -> str:
    with pytest.raises(USER_ERRORS) as info:
        fn()
    return _check_error(info.value, *names)


def _edit(path: Path, fn) -> None:
    with h5py.File(path, "a") as f:
        fn(f)


def _replace(f: h5py.File, name: str, **kw) -> None:
    del f[name]
    f.create_dataset(name, **kw)


def _huge_grid(path: Path, n: int = 10**5) -> Path:
    """A Well file declaring an n x n grid, its field chunked and never written (a few KB)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.attrs.update(dataset_name="toy", n_spatial_dims=2, n_trajectories=1)
        d = f.create_group("dimensions")
        d.attrs["spatial_dims"] = ["x", "y"]
        d["time"] = np.arange(4.0)
        for axis in "xy":
            d.create_dataset(axis, shape=(n,), dtype="f4", chunks=(n,))
        f.create_group("boundary_conditions")
        g = f.create_group("t0_fields")
        g.attrs["field_names"] = ["p"]
        g.create_dataset("p", shape=(1, 4, n, n), dtype="f4", chunks=(1, 1, 1024, 1024))
    return path


# -- declared sizes are bounded before anything is read -----------------------------------------


def test_huge_unwritten_scalar_refused_at_open(tmp_path):
    path = _write(tmp_path)

    def add(f):
        f["scalars"].create_dataset("big", shape=(HUGE,), dtype="f4", chunks=(2**20,))
        f["scalars"].attrs["field_names"] = ["gamma", "big"]

    _edit(path, add)
    assert path.stat().st_size < 1 << 20
    msg = _refused(lambda: WellFile(path), path)
    assert "scalars/big" in msg and f"{MAX_WHOLE_ENTRIES:,}" in msg


def test_huge_unwritten_time_refused_at_open(tmp_path):
    path = _write(tmp_path)
    _edit(
        path,
        lambda f: _replace(f, "dimensions/time", shape=(HUGE,), dtype="f8", chunks=(2**20,)),
    )
    assert "dimensions/time" in _refused(lambda: WellFile(path), path)


def test_huge_trajectory_count_refused(tmp_path):
    path = _write(tmp_path)
    _edit(path, lambda f: f.attrs.__setitem__("n_trajectories", HUGE))
    assert "'n_trajectories'" in _refused(lambda: WellFile(path), path)


def test_huge_grid_refused_before_a_window_is_read(tmp_path):
    path = _huge_grid(tmp_path / "toy" / "data" / "train" / "f.hdf5")
    wf = WellFile(path)  # metadata only: fine
    assert wf.spatial_shape == (10**5, 10**5)
    msg = _refused(lambda: _ds(tmp_path), path)
    assert "data.max_sample_bytes" in msg
    with open_h5(path) as h:
        _refused(lambda: wf.read(h, wf.select(None), 0, 0, 1), "data.max_sample_bytes")
    # a cap that fits the request lets an ordinary grid through; one that does not is named
    small = _write(tmp_path / "small")
    assert len(_ds(tmp_path / "small", max_sample_bytes=1 << 20)) > 0
    assert "data.max_sample_bytes=100" in _refused(
        lambda: _ds(tmp_path / "small", max_sample_bytes=100), small
    )


def test_inference_takes_the_sample_cap_from_the_data_config(tmp_path):
    path = _write(tmp_path)
    vocab = FieldVocabulary(["p", "u_x", "u_y"])
    ckpt = SimpleNamespace(data_config={"datasets": ["toy"]}, path="c.ckpt", vocab=vocab)
    data = resolve_data_config({"max_sample_bytes": 100}, ckpt, str(tmp_path))
    with pytest.raises(ValueError, match=r"data\.max_sample_bytes=100 ") as info:
        open_datasets(data, "train", ckpt)
    _check_error(info.value, path)
    data = resolve_data_config({}, ckpt, str(tmp_path))
    assert len(open_datasets(data, "train", ckpt)[0]) > 0


def test_compressed_files_are_not_judged_by_size_on_disk(tmp_path):
    path = _write(tmp_path, p=np.zeros((2, 8, 4, 4), np.float32))

    def compress(f):
        _replace(
            f,
            "t0_fields/p",
            data=np.zeros((2, 8, 4, 4), np.float32),
            compression="gzip",
            chunks=(1, 8, 4, 4),
        )
        f["t0_fields/p"].attrs.update(time_varying=True, sample_varying=True)

    _edit(path, compress)
    assert _ds(tmp_path)[0].input_fields[:, :, 0].abs().sum() == 0  # channel p


# -- data outside the file ----------------------------------------------------------------------


def test_external_raw_storage_refused(tmp_path):
    path = _write(tmp_path)
    outside = tmp_path / "secret.bin"
    outside.write_bytes(np.arange(256, dtype=np.float32).tobytes())

    def external(f):
        _replace(
            f, "t0_fields/p", shape=(2, 8, 4, 4), dtype="f4", external=[(str(outside), 0, 1024)]
        )

    _edit(path, external)
    assert "external raw storage" in _refused(lambda: WellFile(path), path)


def test_virtual_dataset_and_external_link_refused(tmp_path):
    path = _write(tmp_path)
    other = _write(tmp_path / "other")

    def virtual(f):
        layout = h5py.VirtualLayout(shape=(2, 8, 4, 4), dtype="f4")
        layout[:] = h5py.VirtualSource(str(other), "t0_fields/p", shape=(2, 8, 4, 4))
        del f["t0_fields/p"]
        f["t0_fields"].create_virtual_dataset("p", layout)

    _edit(path, virtual)
    assert "virtual dataset" in _refused(lambda: WellFile(path), path)

    path = _write(tmp_path)

    def link(f):
        del f["t0_fields/p"]
        f["t0_fields/p"] = h5py.ExternalLink(str(other), "t0_fields/p")

    _edit(path, link)
    assert "link to another file" in _refused(lambda: WellFile(path), path)


# -- values and layouts that cannot be right ----------------------------------------------------


@pytest.mark.parametrize("time", [[0, 1, 2, 3, 2, 5, 6, 7], [0, 1, 2, 3, 3, 5, 6, 7]])
def test_non_increasing_time_refused(tmp_path, time):
    path = _write(tmp_path)
    _edit(path, lambda f: f["dimensions/time"].__setitem__(slice(None), np.array(time, float)))
    msg = _refused(lambda: WellFile(path), path)
    assert "does not increase" in msg and "time[3]" in msg


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (np.ones(5, bool), r"mask has shape \(5,\).*\(4,\) grid points"),
        (np.array([b"a", b"b", b"c", b"d"]), "mask has dtype"),
    ],
)
def test_bad_boundary_masks_refused(tmp_path, mask, message):
    path = _write(tmp_path)
    _edit(path, lambda f: _replace(f, "boundary_conditions/x_wall/mask", data=mask))
    with pytest.raises(ValueError, match=message) as info:
        WellFile(path)
    _check_error(info.value, path)


def test_fifo_and_devices_refused_as_data(tmp_path):
    fifo_root = tmp_path / "fifo"
    split = fifo_root / "toy" / "data" / "train"
    split.mkdir(parents=True)
    os.mkfifo(split / "f.hdf5")
    msg = _refused(lambda: _ds(fifo_root), split / "f.hdf5")
    assert "not a regular file" in msg
    assert "not a regular file" in _refused(lambda: read_trajectory("/dev/null", 0), "/dev/null")
    # symlinks are followed: one to a valid file reads, one to a FIFO is refused
    good = _write(tmp_path / "good")
    link_root = tmp_path / "links"
    (link_root / "toy" / "data" / "train").mkdir(parents=True)
    (link_root / "toy" / "data" / "train" / "a.hdf5").symlink_to(good)
    assert len(_ds(link_root)) > 0
    (link_root / "toy" / "data" / "train" / "b.hdf5").symlink_to(split / "f.hdf5")
    assert "not a regular file" in _refused(lambda: _ds(link_root), "b.hdf5")
    # a FIFO as the data root is not a folder
    os.mkfifo(tmp_path / "pipe")
    assert not data_root_exists(tmp_path / "pipe")
    _refused(lambda: _ds(tmp_path / "pipe"), tmp_path / "pipe")


def test_float64_beyond_float32_range_named(tmp_path):
    p = np.ones((2, 8, 4, 4))
    p[1, 5, 2, 2] = 1e300
    path = _write(tmp_path)
    _edit(path, lambda f: _replace(f, "t0_fields/p", data=p))  # float64 (the writer casts)
    ds = _ds(tmp_path)  # windows of 3 frames, 6 per trajectory
    assert ds[6 + 2].input_fields.isfinite().all()
    with np.errstate(all="raise"):  # no stray numpy warning either
        msg = _refused(lambda: ds[6 + 3], path)
    assert "out of float32 range" in msg and "'t0_fields/p'" in msg


def test_zero_trajectories_named(tmp_path):
    path = _write(tmp_path)
    _edit(path, lambda f: f.attrs.__setitem__("n_trajectories", 0))
    msg = _refused(lambda: _ds(tmp_path), path)
    assert "'n_trajectories'" in msg and "is 0" in msg


def test_absolute_field_path_refused_at_open(tmp_path):
    path = _write(tmp_path)
    _edit(path, lambda f: f["t0_fields"].attrs.__setitem__("field_names", ["/t0_fields/p"]))
    msg = _refused(lambda: WellFile(path), path)
    assert "'/t0_fields/p'" in msg and "not a plain dataset name" in msg


# -- stats.yaml ---------------------------------------------------------------------------------

ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (ALIAS_BOMB, "line 1: anchors"),
        ("mean: !!python/object/apply:os.system ['true']\n", "line 1: tags"),
        ("mean: {p: 1.0}\nstd: {p: [1.0, 2.0\n", "line 3"),
        ("mean: {p: 1.0}\nstd: {p: fast}\n", r"std\.p: expected a number, got str"),
        ("mean: {u: [1.0, [2.0]]}\n", r"mean\.u: mixes numbers and lists"),
        ("mean: {u: [[[1.0]]]}\n", r"mean\.u\[0\]\[0\]: expected a number, got list"),
        ("mean: {p: .nan}\n", r"mean\.p: expected a finite number"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("mean: {p: 1.0}\n" + "#" * MAX_YAML_BYTES, "larger than"),
    ],
)
def test_bad_stats_yaml_one_line(tmp_path, text, message):
    path = tmp_path / "stats.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_stats(path)
    _check_error(info.value, path)


def test_released_config_yaml_read_by_the_same_loader(tmp_path):
    path = tmp_path / "extended_config.yaml"
    path.write_text(ALIAS_BOMB)
    with pytest.raises(ValueError, match="not valid YAML/JSON: .*line 1: anchors") as info:
        read_config(path)
    _check_error(info.value, path)
    path.write_text("model: {dim: 8}\n")
    assert read_config(path) == {"model": {"dim": 8}}


def test_stats_yaml_valid_and_fifo(tmp_path):
    path = tmp_path / "stats.yaml"
    path.write_text("mean: {p: 1, u: [1.0, 2.0], s: [[1, 2], [3, 4]]}\nnote: text\n")
    assert load_stats(path) == {
        "mean": {
            "p": 1.0,
            "u_x": 1.0,
            "u_y": 2.0,
            "s_xx": 1.0,
            "s_xy": 2.0,
            "s_yx": 3.0,
            "s_yy": 4.0,
        }
    }
    os.mkfifo(tmp_path / "fifo.yaml")
    assert "not a regular file" in _refused(lambda: load_stats(tmp_path / "fifo.yaml"), "fifo")


# -- property-based mutations of a valid file ---------------------------------------------------

OBJECTS = [
    "/",
    "dimensions",
    "dimensions/time",
    "dimensions/x",
    "boundary_conditions",
    "boundary_conditions/x_wall",
    "boundary_conditions/x_wall/mask",
    "scalars",
    "scalars/gamma",
    "t0_fields",
    "t0_fields/p",
    "t1_fields",
    "t1_fields/u",
]
DATASETS = [
    o for o in OBJECTS if "/" in o and o.split("/")[-1] in {"time", "x", "mask", "gamma", "p", "u"}
]
ATTRS = [
    "n_spatial_dims",
    "n_trajectories",
    "dataset_name",
    "field_names",
    "spatial_dims",
    "time_varying",
    "sample_varying",
    "dim_varying",
    "bc_type",
    "associated_dims",
    "simulation_parameters",
]
attr_values = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(alphabet="xyp/._ u0", max_size=6),
    st.binary(max_size=4),
    st.lists(st.integers(-2, 5), max_size=4),
    st.lists(st.sampled_from(["x", "y", "p", "u", "/t0_fields/p", "..", ""]), max_size=3),
)
shapes = st.lists(st.sampled_from([0, 1, 2, 4, 5, 8, 10**9]), max_size=5).map(tuple)
dtypes = st.sampled_from(["f4", "f8", "i4", "u1", "bool", "S4", "c8"])
mutations = st.one_of(
    st.tuples(st.just("attr"), st.sampled_from(OBJECTS), st.sampled_from(ATTRS), attr_values),
    st.tuples(st.just("delattr"), st.sampled_from(OBJECTS), st.sampled_from(ATTRS)),
    st.tuples(st.just("delete"), st.sampled_from(OBJECTS[1:])),
    st.tuples(st.just("replace"), st.sampled_from(DATASETS), shapes, dtypes),
    st.tuples(
        st.just("fill"),
        st.sampled_from(DATASETS),
        st.sampled_from([np.nan, np.inf, 1e300, -1.0, 0.0]),
    ),
)


def _mutate(f: h5py.File, m: tuple) -> None:
    kind, name = m[0], m[1]
    if name != "/" and name not in f:
        return
    obj = f[name]
    if kind == "attr":
        value = m[3]
        if isinstance(value, list) and value and isinstance(value[0], str):
            value = np.array(value, dtype=h5py.string_dtype())
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            obj.attrs[m[2]] = value  # a value h5py cannot store leaves nothing to test
    elif kind == "delattr":
        if m[2] in obj.attrs:
            del obj.attrs[m[2]]
    elif kind == "delete":
        del f[name]
    elif kind == "replace":
        shape, dtype = m[2], np.dtype(m[3])
        attrs = dict(obj.attrs)
        del f[name]
        if np.prod(shape, dtype=object) > 10**6:
            chunks = tuple(max(1, min(n, 64)) for n in shape) or None
            ds = f.create_dataset(name, shape=shape, dtype=dtype, chunks=chunks)
        else:
            data = np.arange(int(np.prod(shape))).reshape(shape) % 7
            ds = f.create_dataset(name, data=data.astype(dtype))
        ds.attrs.update(attrs)
    elif kind == "fill" and isinstance(obj, h5py.Dataset) and obj.dtype.kind == "f":
        if (obj.size or 0) > 10**6:
            return  # writing it would be the test's own blow-up
        with np.errstate(over="ignore"):  # 1e300 into float32 is meant
            obj[...] = m[2]


def _exercise(root: Path, path: Path) -> None:
    """Every reader entry point: a valid result or a one-line user error naming the file."""
    try:
        wf = WellFile(path)
        ds = _ds(root)
        for i in sorted({0, len(ds) - 1}):
            b = ds[i]
            assert b.input_fields.shape[2:] == (len(ds.field_names), *wf.spatial_shape)
            assert b.input_fields.isfinite().all() and b.output_fields.isfinite().all()
        frames, _, _ = read_trajectory(path, 0)
        assert frames.shape[0] == wf.n_time
    except USER_ERRORS as e:
        _check_error(e, path)


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("valid"))


@settings(
    derandomize=True,
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(mutations, min_size=1, max_size=3))
def test_fuzz_mutated_well_file(valid_file, muts):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = root / "toy" / "data" / "train" / "f.hdf5"
        path.parent.mkdir(parents=True)
        shutil.copyfile(valid_file, path)
        with h5py.File(path, "a") as f:
            for m in muts:
                _mutate(f, m)
        _exercise(root, path)


@settings(derandomize=True, max_examples=50, deadline=None)
@given(st.text(alphabet="ab: -[]{},&*!#'\"\n.5e|>%@`\\", max_size=60))
def test_fuzz_stats_yaml(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stats.yaml"
        path.write_text(text)
        try:
            stats = load_stats(path)
        except USER_ERRORS as e:
            _check_error(e, path)
        else:
            assert all(isinstance(v, float) for t in stats.values() for v in t.values())


# -- the blow-ups under an address-space cap ----------------------------------------------------

CAPPED = textwrap.dedent(
    """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    from walrus.data.stats import load_stats
    from walrus.data.well_dataset import WellDataset
    root = sys.argv[1]
    for case in ("scalar", "time", "grid"):
        try:
            ds = WellDataset(f"{root}/{case}", "toy", "train", 2, 1)
            ds[0]
            print(case, "READ")
        except (ValueError, FileNotFoundError) as e:
            print(case, "error:", e)
    try:
        load_stats(f"{root}/stats.yaml")
        print("yaml READ")
    except ValueError as e:
        print("yaml error:", e)
    """
)


def test_blowups_end_in_errors_under_a_4gb_cap(tmp_path):
    scalar = _write(tmp_path / "scalar")

    def add(f):
        f["scalars"].create_dataset("big", shape=(HUGE,), dtype="f4", chunks=(2**20,))
        f["scalars"].attrs["field_names"] = ["big"]

    _edit(scalar, add)
    time = _write(tmp_path / "time")
    _edit(
        time, lambda f: _replace(f, "dimensions/time", shape=(HUGE,), dtype="f8", chunks=(2**20,))
    )
    _huge_grid(tmp_path / "grid" / "toy" / "data" / "train" / "f.hdf5")
    (tmp_path / "stats.yaml").write_text(ALIAS_BOMB)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CAPPED, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,  # a hang guard only
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["scalar", "time", "grid", "yaml"]
    assert all(line.split()[1] == "error:" for line in lines), lines
    assert "scalars/big" in lines[0] and "dimensions/time" in lines[1]
    assert "data.max_sample_bytes" in lines[2] and "anchors" in lines[3]
