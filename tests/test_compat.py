"""Official Walrus weights: conversion, exact numerics on the reference fixture, bad input."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from walrus.bcs import BoundaryType
from walrus.checkpoint import load_model
from walrus.compat import convert_state_dict, load_official, read_official_file, unwrap_state_dict
from walrus.data.batch import Batch
from walrus.model.encoder import official_strides
from walrus.model.jitter import PatchJitterer, plan_axis
from walrus.model.profile import WALRUS_OFFICIAL
from walrus.model.walrus import Walrus
from walrus.rollout import rollout

REPO = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "walrus_reference_tiny.pt"
FIELDS = ["density", "energy", "pressure", "velocity_x", "velocity_y", "buoyancy"]
needs_fixture = pytest.mark.skipif(
    not FIXTURE.is_file(), reason=f"reference fixture {FIXTURE} not found (../shared next to repo)"
)


@pytest.fixture(scope="module")
def fixture() -> dict:
    return torch.load(FIXTURE, map_location="cpu", weights_only=True)


def official_state(fixture: dict) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in fixture["state_dict"].items()}


def rel_error(model: torch.nn.Module, fixture: dict) -> float:
    """max |y - y_ref| / max |y_ref| on the fixture input (official (T, B, ...) layout)."""
    with torch.no_grad():
        y = model.eval()(fixture["x"].transpose(0, 1), fixture["state_labels"], fixture["bcs"][:2])
    ref = fixture["y"]
    return ((y.transpose(0, 1) - ref).abs().max() / ref.abs().max()).item()


@needs_fixture
def test_fixture_numerics_match_official(fixture: dict) -> None:
    model, vocab = load_official(official_state(fixture), fields=FIELDS)
    assert rel_error(model, fixture) < 1e-4
    assert vocab.names == FIELDS
    assert model.compat == "walrus_official" and not model.training
    assert all(p.requires_grad for p in model.parameters())
    assert "encoder_dummy" in model.conversion_report.official_only


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The fixture converted by the CLI (once per module): (checkpoint path, CLI stdout)."""
    tmp = tmp_path_factory.mktemp("cli")
    fields = tmp / "fields.yaml"
    fields.write_text(yaml.safe_dump({n: i for i, n in enumerate(FIELDS)}))
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump({"model": {"hidden_dim": 64, "num_heads": 4, "n_states": 6}}))
    out = tmp / "out.ckpt"
    cmd = [sys.executable, "-m", "walrus.compat", "convert", str(FIXTURE), str(out)]
    cmd += ["--fields", str(fields), "--config", str(config)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    return out, res.stdout


@needs_fixture
def test_cli_writes_checkpoint_that_load_model_rebuilds(fixture: dict, converted) -> None:
    out, stdout = converted
    assert "encoder_dummy" in stdout and "rope.freqs" in stdout
    model, vocab = load_model(out)
    assert vocab.names == FIELDS
    assert rel_error(model, fixture) < 1e-4
    meta = torch.load(out, weights_only=True)["walrus"]
    assert meta["predict_delta"] is True
    assert meta["model_config"]["compat"] == "walrus_official"
    # Inference and fine-tuning pick up the official per-sample mean/std normalisation.
    from walrus.data.normalization import MeanStdNormalizer
    from walrus.inference.loading import load_inference_checkpoint

    assert isinstance(load_inference_checkpoint(out).normalizer, MeanStdNormalizer)


@needs_fixture
def test_rollout_from_converted_checkpoint(fixture: dict, converted) -> None:
    model, _ = load_model(converted[0])
    x = fixture["x"].transpose(0, 1)[:1, :, :, :64, :64]  # (B, T, C, H, W)
    batch = Batch(x, x[:, -1:], fixture["state_labels"], fixture["bcs"][:2])
    frames = list(rollout(model.eval(), batch, 2))
    assert len(frames) == 2 and frames[1].shape == (1, 3, 64, 64)
    assert all(f.isfinite().all() for f in frames)


@needs_fixture
def test_cli_bad_input_exits_2_with_message(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("not a checkpoint\n")
    cmd = [sys.executable, "-m", "walrus.compat", "convert", str(bad), str(tmp_path / "o.ckpt")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2
    assert "not a readable PyTorch checkpoint" in res.stderr
    assert not (tmp_path / "o.ckpt").exists()


@needs_fixture
@pytest.mark.parametrize("wrap", ["bare_module", "model_state_dict", "state_dict", "app_model"])
def test_wrappers_and_prefix(fixture: dict, wrap: str) -> None:
    sd = official_state(fixture)
    obj = {
        "bare_module": {"module." + k: v for k, v in sd.items()},
        "model_state_dict": {"model_state_dict": sd, "epoch": 3},
        "state_dict": {"state_dict": sd},
        "app_model": {"app": {"model": sd}},
    }[wrap]
    state = unwrap_state_dict(obj)
    assert set(state) == set(sd)
    conv = convert_state_dict(state)
    assert not state  # popped as it went
    assert torch.equal(conv.state_dict["rope.freqs"], sd["blocks.0.space_mixing.rotary_emb.freqs"])


@needs_fixture
def test_load_official_from_file_path(tmp_path: Path, fixture: dict) -> None:
    path = tmp_path / "official.pt"
    torch.save({"model_state_dict": official_state(fixture)}, path)
    model, vocab = load_official(path)
    assert len(vocab) == 6 and vocab.names[0] == "official_field_0"
    assert rel_error(model, fixture) < 1e-4


def test_not_a_checkpoint(tmp_path: Path) -> None:
    text = tmp_path / "a.pt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="not a readable PyTorch checkpoint"):
        read_official_file(text)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_official_file(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="no tensors found"):
        unwrap_state_dict({"epoch": 1, "lr": 0.1})


def test_pickle_refused_unless_trusted(tmp_path: Path) -> None:
    path = tmp_path / "pickled.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=1)}, path)
    with pytest.raises(ValueError, match="--trust-pickle"):
        read_official_file(path)
    with pytest.warns(UserWarning, match="trust"):
        obj = read_official_file(path, trust_pickle=True)
    assert torch.equal(unwrap_state_dict(obj)["w"], torch.ones(2))


def test_other_architecture_lists_missing_and_extra_keys() -> None:
    ours = Walrus(n_fields=4, dim=32, depth=1, heads=4, projection_dim=8, groups=4).state_dict()
    with pytest.raises(ValueError) as err:
        convert_state_dict(dict(ours), source="ours.pt")
    msg = str(err.value)
    assert "\n" not in msg  # one line
    assert msg.startswith("ours.pt is not an official Walrus state dict (closest: the legacy")
    assert re.search(r"missing keys \(\d+\): .*encoder_dummy.*; unexpected keys .*rope\.freqs", msg)


def test_partial_current_layout_names_its_missing_keys() -> None:
    state = {
        "embed.2.proj1.weight": torch.zeros(4, 7, 2, 2, 2),
        "blocks.0.space_mixing.ff_out.weight": torch.zeros(4, 8),
    }
    with pytest.raises(
        ValueError, match=r"closest: the current layout\).*missing keys.*encoder_dummy"
    ):
        convert_state_dict(state)


@needs_fixture
def test_fields_length_mismatch(fixture: dict, tmp_path: Path) -> None:
    path = tmp_path / "fields.yaml"
    path.write_text(yaml.safe_dump(FIELDS[:5]))
    with pytest.raises(ValueError, match=r"lists 5 fields .* has 6"):
        convert_state_dict(official_state(fixture), fields=path)


@needs_fixture
def test_shape_mismatch_names_key_and_shapes(fixture: dict) -> None:
    sd = official_state(fixture)
    sd["blocks.1.space_mixing.attn_out.weight"] = torch.zeros(64, 60)
    with pytest.raises(
        ValueError, match=r"attn_out\.weight: official \(64, 60\) vs ours \(64, 64\)"
    ):
        convert_state_dict(sd)


@needs_fixture
def test_config_disagreeing_with_weights(fixture: dict) -> None:
    with pytest.raises(ValueError, match=r"num_heads=8 \(weights: 4\)"):
        convert_state_dict(official_state(fixture), config={"model": {"num_heads": 8}})


@needs_fixture
def test_resize_vocab_keeps_outputs_under_compat(fixture: dict) -> None:
    model, _ = load_official(official_state(fixture))
    x = fixture["x"].transpose(0, 1)[:1, :2, :, :64, :64]  # (B, T, C, H, W)
    args = (fixture["state_labels"], [[2, 2], [0, 1]])
    with torch.no_grad():
        before = model(x, *args)
        model.resize_vocab(9)
        after = model(x, *args)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)


def test_compat_option_is_off_by_default_and_checked() -> None:
    model = Walrus(n_fields=4, dim=32, depth=1, heads=4, projection_dim=8, groups=4)
    assert model.compat is None and not model.space_bag.scale_bias
    assert all(d.kernel_reduce == "sum" for d in model.debed.values())
    assert model.blocks[0].time_mixing.norm1.groups == 4
    with pytest.raises(ValueError, match="compat='walrus'"):
        Walrus(n_fields=4, dim=32, depth=1, heads=4, projection_dim=8, groups=4, compat="walrus")


def test_official_strides_and_padding_plan() -> None:
    assert official_strides([128, 256], 32) == [(2, 2), (4, 2)]
    with pytest.raises(ValueError, match="stride table"):
        official_strides([100], 32)
    periodic = (BoundaryType.PERIODIC, BoundaryType.PERIODIC)
    plan = WALRUS_OFFICIAL.plan_axis
    h = plan(128, (2, 2), (8, 4), periodic, False, 0)
    w = plan(256, (4, 2), (8, 4), periodic, False, 0)
    assert (h.lo, h.hi, w.lo, w.hi) == (1, 1, 2, 2)  # latent 30 x 31, as the official model


def test_corners_get_the_sum_of_both_tokens() -> None:
    jit = PatchJitterer(2)
    with torch.no_grad():
        jit.padding_tokens.copy_(torch.tensor([[1.0, 10.0], [100.0, 1000.0]]).view(2, 2, 1, 1, 1))
    wall, open_ = int(BoundaryType.WALL), int(BoundaryType.OPEN)
    plans = [
        plan_axis(8, (2, 2), (4, 2), (wall, open_), False, 0),
        plan_axis(8, (2, 2), (4, 2), (open_, open_), False, 0),
    ]
    y = jit.jitter(torch.zeros(1, 2, 8, 8), plans)[0, 0]  # channel 0: WALL 1, OPEN 100
    p0, p1 = plans
    assert y[0, 0] == 1 + 100  # WALL (axis 0 lo) + OPEN (axis 1 lo)
    assert y[-1, -1] == 100 + 100  # OPEN (axis 0 hi) + OPEN (axis 1 hi)
    assert y[0, p1.lo] == 1 and y[p0.lo, 0] == 100  # edges get one token
    assert y[p0.lo : -p0.hi, p1.lo : -p1.hi].abs().max() == 0  # interior untouched
