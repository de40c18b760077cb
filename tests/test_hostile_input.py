"""Hostile checkpoints, options and command lines: one clear line, bounded memory, no writes.

Every case is crafted in-process and handed to the loaders (``load_model``,
``load_inference_checkpoint``, resume with ``ckpt_path=``, fine-tuning with ``init_from=``);
only the memory-cap case and the "a refused run changes no file" case start a subprocess.
A hypothesis fuzzer mutates a valid small checkpoint: every mutation ends in a model or in a
one-line ``ValueError`` naming the file, never in another exception.
"""

from __future__ import annotations

import copy
import os
import resource
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from tests.conftest import CONFIG_DIR, REPO, tiny_train_overrides
from walrus.checkpoint import (
    MAX_DEPTH,
    atomic_torch_save,
    build_model,
    load_checkpoint_file,
    load_model,
    load_model_and_meta,
)
from walrus.cli import run_cli
from walrus.compat.__main__ import main as convert_main
from walrus.data.vocab import FieldVocabulary
from walrus.data.writer import write_well_file
from walrus.errors import reading
from walrus.inference.loading import load_inference_checkpoint, positive_int
from walrus.model.config import WalrusConfig
from walrus.run_files import close_run_log, write_run_files
from walrus.training.train import train

SMALL = {
    "_target_": "walrus.model.walrus.Walrus",
    "n_fields": 4,
    "dim": 16,
    "depth": 2,
    "heads": 2,
    "projection_dim": 8,
    "intermediate_dim": 8,
    "groups": 4,
    "include_d": [2],
}
NAMES = ["u", "velocity_x", "velocity_y", "pressure"]


def small_checkpoint() -> dict:
    """A valid walrus checkpoint (as a dict) of a small untrained 2-D model."""
    torch.manual_seed(0)
    model = build_model(SMALL)
    meta = {
        "format": 1,
        "model_config": dict(SMALL),
        "vocab": FieldVocabulary(NAMES).to_dict(),
        "predict_delta": True,
        "data_config": {"root": "/nowhere", "datasets": ["toy"], "n_steps_input": 3},
    }
    return {"state_dict": {"model." + k: v for k, v in model.state_dict().items()}, "walrus": meta}


def save(ckpt: dict, path: Path) -> Path:
    atomic_torch_save(ckpt, path)  # stores fresh checksums: the deeper checks are reached
    return path


def with_meta(path: Path, **changes: object) -> Path:
    ckpt = small_checkpoint()
    for where, value in changes.items():
        *parents, last = where.split("__")
        node = ckpt["walrus"]
        for key in parents:
            node = node[key]
        node[last] = value
    return save(ckpt, path)


def one_line_error(error: BaseException, path: Path) -> str:
    msg = str(error)
    assert "\n" not in msg and str(path) in msg, msg
    return msg


def _compose(overrides: list[str]):
    GlobalHydra.instance().clear()
    HydraConfig.instance().cfg = None
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    GlobalHydra.instance().clear()
    return cfg


# ------------------------------------------------ sizes are checked against the weights first

HUGE = [
    ("depth", 10**6, "depth=1000000 but the weights hold 2 blocks"),
    ("dim", 20000, "dim=20000 does not fit the weights"),
    ("n_fields", 10**9, "n_fields=1000000000 does not fit the weights"),
    ("rel_pos_buckets", 10**9, "rel_pos_buckets=1000000000 does not fit the weights"),
]


@pytest.mark.parametrize(("option", "value", "message"), HUGE)
def test_sizes_that_disagree_with_the_weights_are_refused(tmp_path, option, value, message):
    ckpt = small_checkpoint()
    ckpt["walrus"]["model_config"][option] = value
    if option == "dim":
        ckpt["walrus"]["model_config"]["heads"] = 1000  # keeps the config itself valid
    path = save(ckpt, tmp_path / "big.ckpt")
    with pytest.raises(ValueError, match=message) as e:
        load_inference_checkpoint(path)
    one_line_error(e.value, path)


def test_missing_and_reshaped_weights_are_named(tmp_path):
    ckpt = small_checkpoint()
    state = ckpt["state_dict"]
    key = next(k for k in state if k.endswith("rel_pos_bias.relative_attention_bias.weight"))
    state[key] = torch.zeros(7, 2)
    with pytest.raises(ValueError, match=r"rel_pos_buckets=32 does not fit .* \(7, 2\)"):
        load_model(save(ckpt, tmp_path / "a.ckpt"))
    del state[key]
    with pytest.raises(ValueError, match=r"missing keys \(1\): blocks.*unexpected keys \(0\)"):
        load_model(save(ckpt, tmp_path / "b.ckpt"))


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("dim", 10**30, "past the largest size"),
        ("n_fields", -(2**70), "past the largest size"),
        ("mlp_ratio", 1e30, "mlp_ratio \\* dim .* past the largest size"),
        ("mlp_ratio", float("inf"), "a finite number"),
        ("rope_max_freq", 10**400, "a finite number"),
        ("target_latent", [32, 32, 2**64], "past the largest size"),
    ],
)
def test_sizes_past_int64_are_one_line_errors(option, value, message):
    with pytest.raises(ValueError, match=message) as e:
        WalrusConfig.from_dict({**SMALL, option: value})
    assert "\n" not in str(e.value)


MEMORY_CAP_SCRIPT = """
import resource, sys
cap = 4 << 30
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
from walrus.inference.loading import load_inference_checkpoint, positive_int
for path in sys.argv[1:]:
    try:
        load_inference_checkpoint(path)
        print("loaded", path)
    except ValueError as e:
        print("refused", str(e).replace(chr(10), " | "))
"""


def test_blow_ups_end_in_one_line_under_a_4gb_address_space_cap(tmp_path):
    paths = []
    for option, value, _ in HUGE:
        ckpt = small_checkpoint()
        ckpt["walrus"]["model_config"][option] = value
        if option == "dim":
            ckpt["walrus"]["model_config"]["heads"] = 1000
        paths.append(str(save(ckpt, tmp_path / f"{option}.ckpt")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(
        [sys.executable, "-c", MEMORY_CAP_SCRIPT, *paths],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == len(HUGE), r.stdout
    for line, (_, _, message) in zip(lines, HUGE, strict=True):
        assert line.startswith("refused") and message in line and "|" not in line, line


def test_resume_and_init_from_check_sizes_before_building(tiny_data_root, tmp_path):
    ckpt = small_checkpoint()
    ckpt["walrus"]["model_config"]["depth"] = 10**6
    path = save(ckpt, tmp_path / "deep.ckpt")
    for option in ("ckpt_path", "init_from"):
        overrides = [*tiny_train_overrides(tiny_data_root, tmp_path / option), f"{option}={path}"]
        with pytest.raises(ValueError, match="depth=1000000 but the weights hold 2 blocks") as e:
            train(_compose(overrides))
        one_line_error(e.value, path)
        assert not (tmp_path / option / "config.yaml").exists()  # nothing written


# ---------------------------------------------------------------- metadata and state dict


def _nested_pickle_checkpoint(path: Path, depth: int) -> Path:
    """A checkpoint whose ``walrus.deep`` is a list nested ``depth`` deep, built by editing the
    pickle stream (pickling such a structure would exhaust Python's own stack)."""
    ckpt = small_checkpoint()
    marker = "NESTED_HERE_1234"
    ckpt["walrus"]["deep"] = marker
    save(ckpt, path)
    pickled = b"X" + len(marker).to_bytes(4, "little") + marker.encode()
    nested = b"]" * depth + b"a" * (depth - 1)  # EMPTY_LIST x depth, APPEND x (depth - 1)
    with zipfile.ZipFile(path) as z:
        members = [(info, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for info, data in members:
            if info.filename.endswith("data.pkl"):
                assert data.count(pickled) == 1
                data = data.replace(pickled, nested)
            z.writestr(info, data)
    return path


def test_metadata_nested_50000_deep_is_one_line(tmp_path):
    path = _nested_pickle_checkpoint(tmp_path / "deep.ckpt", 50_000)
    with pytest.raises(ValueError, match=f"walrus/deep.* more than {MAX_DEPTH} levels") as e:
        load_checkpoint_file(path)
    one_line_error(e.value, path)
    shallow = _nested_pickle_checkpoint(tmp_path / "ok.ckpt", 3)  # nesting fine, bytes edited
    with pytest.raises(ValueError, match="its metadata .* does not match its stored checksum"):
        load_checkpoint_file(shallow)


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("predict_delta", "yes", "walrus.predict_delta must be true or false"),
        ("vocab__names", "u,velocity_x", "walrus.vocab.names must be a list of field names"),
        ("vocab__names", ["u", "u"], "empty or repeated field name"),
        ("data_config__n_steps_input", "four", "walrus.data_config.n_steps_input"),
        ("data_config__time_stride", [1, "x"], "walrus.data_config.time_stride"),
    ],
)
def test_metadata_of_the_wrong_kind_is_named(tmp_path, where, value, message):
    path = with_meta(tmp_path / "m.ckpt", **{where: value})
    with pytest.raises(ValueError, match=message) as e:
        load_inference_checkpoint(path)
    one_line_error(e.value, path)


def test_state_dict_stored_as_a_list_is_one_line(tmp_path):
    ckpt = small_checkpoint()
    ckpt["state_dict"] = list(ckpt["state_dict"].values())
    path = save(ckpt, tmp_path / "list.ckpt")
    with pytest.raises(ValueError, match="state_dict is a list") as e:
        load_model(path)
    one_line_error(e.value, path)


def test_fifo_device_and_symlinks(tmp_path):
    fifo = tmp_path / "pipe.ckpt"
    os.mkfifo(fifo)
    link = tmp_path / "link.ckpt"
    link.symlink_to(fifo)
    for path in (fifo, link, Path(os.devnull)):
        with pytest.raises(ValueError, match="not a regular file") as e:  # never blocks
            load_checkpoint_file(path)
        one_line_error(e.value, path)
    real = save(small_checkpoint(), tmp_path / "real.ckpt")
    good = tmp_path / "hub_cache_link.ckpt"
    good.symlink_to(real)  # symlinks are followed (the Hub's cache is made of them)
    model, vocab = load_model(good)
    assert vocab.names == NAMES and model.depth == 2


# ------------------------------------------------------------------ resume state, options


@pytest.fixture(scope="module")
def trained(tiny_data_root, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained")
    train(_compose(tiny_train_overrides(tiny_data_root, out)))
    return out / "checkpoints" / "last.ckpt"


def _reshape_first_exp_avg(ckpt: dict) -> None:
    state = ckpt["optimizer_states"][0]["state"]
    state[0]["exp_avg"] = torch.zeros(3, 3)


def _garbage_loops(ckpt: dict) -> None:
    ckpt["loops"]["fit_loop"]["epoch_progress"]["total"]["ready"] = "garbage"


def _string_last_epoch(ckpt: dict) -> None:
    ckpt["lr_schedulers"][0]["last_epoch"] = "2"


def _loops_as_list(ckpt: dict) -> None:
    ckpt["loops"] = ["fit_loop"]


@pytest.mark.parametrize(
    ("craft", "message"),
    [
        (_reshape_first_exp_avg, r"optimizer state 0/exp_avg has shape \(3, 3\)"),
        (_garbage_loops, "loops/fit_loop/epoch_progress/total/ready must be a step count"),
        (_string_last_epoch, "lr_schedulers/0/last_epoch must be an int"),
        (_loops_as_list, "loops entry is not a mapping"),
    ],
)
def test_resume_state_is_checked_before_lightning_reads_it(
    trained, tiny_data_root, tmp_path, craft, message
):
    ckpt = load_checkpoint_file(trained)
    craft(ckpt)
    path = save(ckpt, tmp_path / "crafted.ckpt")
    run = tmp_path / "run"
    overrides = [*tiny_train_overrides(tiny_data_root, run), f"ckpt_path={path}"]
    with pytest.raises(ValueError, match=message) as e:
        train(_compose([*overrides, "trainer.max_epochs=2"]))
    one_line_error(e.value, path)
    assert not (run / "config.yaml").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.lr=1e308", "option optimizer.lr=1e[+]308 is out of range"),
        ("optimizer.lr=-inf", "option optimizer.lr=-inf is out of range"),
        ("data.batch_size=100000000000000000000000", "option data.batch_size is out of range"),
    ],
)
def test_options_that_overflow_are_refused(tiny_data_root, tmp_path, override, message):
    cfg = _compose([*tiny_train_overrides(tiny_data_root, tmp_path / "run"), override])
    with pytest.raises(ValueError, match=message) as e:
        train(cfg)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_infer_integer_options_are_bounded():
    cfg = OmegaConf.create({"batch_size": 10**30, "steps": 2**31 - 1})
    with pytest.raises(ValueError, match="option batch_size must be at most 2147483647"):
        positive_int(cfg, "batch_size")
    assert positive_int(cfg, "steps") == 2**31 - 1


# ---------------------------------------------------------------- the top-level guard


def _cli_error(capsys, fn) -> str:
    with pytest.raises(SystemExit) as e:
        run_cli(fn)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("error", [MemoryError, RecursionError, OverflowError])
def test_resource_errors_name_the_input_being_read(capsys, monkeypatch, error):
    monkeypatch.delenv("WALRUS_TRACEBACK", raising=False)

    def load():
        with reading("checkpoint /data/x.ckpt"), reading("option model.dim"):
            raise error("boom")

    err = _cli_error(capsys, load)
    assert err == (
        f"error: option model.dim asks for more than this machine can give ({error.__name__})\n"
    )

    def unnamed():
        raise error()

    assert "this run (its options or input files) asks for more" in _cli_error(capsys, unnamed)


def test_a_path_too_long_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("WALRUS_TRACEBACK", raising=False)
    long = tmp_path / ("x" * 5000) / "out"
    err = _cli_error(capsys, lambda: long.mkdir(parents=True))
    assert "File name too long" in err and len(err) < 400


# ------------------------------------------------------------------------- converter


def test_converter_refuses_to_overwrite(tmp_path, capsys):
    src = tmp_path / "official.pt"
    src.write_bytes(b"official weights")
    other = tmp_path / "other.ckpt"
    other.write_bytes(b"keep me")
    link, hard = tmp_path / "link.pt", tmp_path / "hard.pt"
    link.symlink_to(src)
    os.link(src, hard)
    for out, extra, message in [
        (other, [], "exists; pass --overwrite"),
        (src, ["--overwrite"], "is the input file"),
        (link, ["--overwrite"], "is the input file"),
        (hard, ["--overwrite"], "is the input file"),
        (tmp_path, [], "is a directory"),
    ]:
        assert convert_main(["convert", str(src), str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert src.read_bytes() == b"official weights" and other.read_bytes() == b"keep me"
    # with --overwrite an unrelated existing file may be replaced: the input is read then
    assert convert_main(["convert", str(src), str(other), "--overwrite"]) == 2
    assert "official.pt is not a readable PyTorch checkpoint" in capsys.readouterr().err


# ------------------------------------------------------------- nothing written before checks


def _tree(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_refused_infer_run_changes_no_file_of_an_earlier_result(tmp_path):
    out = tmp_path / "result"
    (out / ".hydra").mkdir(parents=True)
    for name, text in [
        (".hydra/config.yaml", "old config"),
        (".hydra/overrides.yaml", "- old"),
        (".hydra/hydra.yaml", "hydra: old"),
        ("infer.log", "old log\n"),
        ("metrics.json", "{}"),
    ]:
        (out / name).write_text(text)
    before = _tree(out)
    bad = save(with_meta_dict(depth=10**6), tmp_path / "bad.ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("WALRUS_TRACEBACK", None)
    r = subprocess.run(
        [sys.executable, "infer.py", "rollout", f"ckpt_path={bad}", f"out={out}", "overwrite=true"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "depth=1000000" in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1, r.stderr
    assert _tree(out) == before


def with_meta_dict(**model_changes: object) -> dict:
    ckpt = small_checkpoint()
    ckpt["walrus"]["model_config"].update(model_changes)
    return ckpt


def test_run_files_are_written_and_the_log_records_prints_and_logs(tmp_path, capsys):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            config_name="infer",
            overrides=["command=rollout", "ckpt_path=x.ckpt", f"out={tmp_path}", "steps=3"],
            return_hydra_config=True,
        )
    GlobalHydra.instance().clear()
    HydraConfig.instance().set_config(cfg)
    try:
        assert cfg.hydra.output_subdir is None  # Hydra itself writes nothing at start
        write_run_files(cfg, tmp_path, "infer.log")
        print("| field | vrmse |")
        print("\rprogress redraw 50%", end="")
        import logging

        logging.getLogger("walrus.test").info("a log record")
    finally:
        close_run_log()
        HydraConfig.instance().cfg = None
    assert "| field | vrmse |" in capsys.readouterr().out
    log = (tmp_path / "infer.log").read_text()
    assert "| field | vrmse |" in log and "a log record" in log and "progress" not in log
    assert "steps=3" in (tmp_path / ".hydra" / "overrides.yaml").read_text()
    assert "steps: 3" in (tmp_path / ".hydra" / "config.yaml").read_text()
    assert "hydra:" in (tmp_path / ".hydra" / "hydra.yaml").read_text()
    print("after close")
    assert "after close" not in (tmp_path / "infer.log").read_text()


# ------------------------------------------------------------------------------ fuzzing

OPTIONS = sorted(set(SMALL) - {"_target_"}) + ["mlp_ratio", "rel_pos_buckets", "compat"]
ANY_VALUE = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.sampled_from([0, 1, 2, 3, 4, 8, 16, 32, 10**9]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=6),
        st.just("${oc.env:HOME}"),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
META_KEYS = ["predict_delta", "vocab", "data_config", "format", "model_config", "inference"]


@st.composite
def mutations(draw) -> list[tuple[str, object, object]]:
    out = []
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        kind = draw(st.sampled_from(["option", "meta", "drop", "reshape", "nest"]))
        if kind == "option":
            out.append((kind, draw(st.sampled_from(OPTIONS)), draw(ANY_VALUE)))
        elif kind == "meta":
            out.append((kind, draw(st.sampled_from(META_KEYS)), draw(ANY_VALUE)))
        elif kind in ("drop", "reshape"):
            shape = draw(st.lists(st.integers(min_value=0, max_value=5), max_size=3))
            out.append((kind, draw(st.integers(min_value=0, max_value=200)), shape))
        else:
            out.append((kind, draw(st.sampled_from(META_KEYS)), draw(st.integers(1, 200))))
    return out


def _apply(ckpt: dict, changes: list[tuple[str, object, object]]) -> None:
    meta, state = ckpt["walrus"], ckpt["state_dict"]
    keys = list(state)
    for kind, what, value in changes:
        if kind == "option":
            meta["model_config"][what] = copy.deepcopy(value)
        elif kind == "meta":
            meta[what] = copy.deepcopy(value)
        elif kind == "drop" and keys:
            state.pop(keys[what % len(keys)], None)
        elif kind == "reshape" and keys:
            state[keys[what % len(keys)]] = torch.zeros(value)
        elif kind == "nest":
            for _ in range(value):
                meta[what] = [meta.get(what)]


@settings(
    derandomize=True,
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(changes=mutations())
def test_fuzzed_checkpoints_load_or_fail_in_one_line(changes):
    with tempfile.TemporaryDirectory() as folder:
        ckpt = small_checkpoint()
        _apply(ckpt, changes)
        path = save(ckpt, Path(folder) / "fuzzed.ckpt")
        try:
            model, vocab, _ = load_model_and_meta(path)
        except ValueError as e:
            one_line_error(e, path)
        else:
            assert len(vocab) <= model.config.n_fields
            assert model.config.depth == len(
                {k.split(".")[1] for k in model.state_dict() if k.startswith("blocks.")}
            )


# ------------------------------------------------------------------------- a full disk


def _write_predictions_like(path: Path, n_time: int) -> None:
    rng = np.random.default_rng(0)  # noise: HDF5 cannot shrink it
    write_well_file(
        path,
        "toy",
        coords={"x": np.arange(32, dtype=np.float32), "y": np.arange(32, dtype=np.float32)},
        time=np.arange(n_time, dtype=np.float32),
        n_trajectories=1,
        fields={"u": rng.standard_normal((1, n_time, 32, 32)).astype(np.float32)},
    )


def test_predictions_on_a_full_disk_keep_the_old_file(tmp_path, capsys, monkeypatch):
    """h5py writing past the file size limit (as on a full disk): one line naming the file,
    the previous file intact, no temporary file left."""
    monkeypatch.delenv("WALRUS_TRACEBACK", raising=False)
    path = tmp_path / "predictions.hdf5"
    _write_predictions_like(path, 2)
    old = path.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        err = _cli_error(capsys, lambda: _write_predictions_like(path, 40))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert err == (
        f"error: file size limit reached (filesystem or ulimit -f): could not write {path} "
        "(any previous file is kept)\n"
    )
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["predictions.hdf5"]


@pytest.mark.slow  # two infer.py processes; the in-process full-disk test above runs by default
def test_fault_injection_predictions_on_a_full_disk(trained, tiny_data_root, tmp_path):
    """``python -m benchmarks.fault_injection``'s predictions.hdf5 case, on the tiny run."""
    from benchmarks.fault_injection import case_predictions_disk_full

    row = case_predictions_disk_full(
        tiny_data_root, tmp_path, trained, "data.datasets=[navier_stokes_2d]"
    )
    assert row["ok"], row


@pytest.mark.slow
def test_fault_injection_sigterm_on_two_ranks(tmp_path):
    """The benchmark's 2-rank case: SIGTERM to rank 0 of 2 DDP ranks, exit 143, the resume
    finishes."""
    from benchmarks.fault_injection import case_sigterm_two_ranks
    from walrus.data.synthetic import generate

    data = tmp_path / "data"
    generate("navier_stokes_2d", data, n_traj=[2, 1, 1], resolution=32, steps=12, progress=False)
    row = case_sigterm_two_ranks(data, tmp_path, 3)
    assert row["ok"], row
