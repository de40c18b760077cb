"""The released Walrus layout ("current"): exact numerics, jitter replay, the 1.3B key set,
boundaries and dimensions, vocabulary growth, latent rolls, CLI, rollout and fine-tune."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import CONFIG_DIR, REPO, tiny_train_overrides
from walrus.bcs import BoundaryType
from walrus.checkpoint import load_checkpoint_file, load_model
from walrus.compat import check_layout, convert_state_dict, load_official
from walrus.compat.__main__ import main as cli_main
from walrus.compat.released import RELEASED_FIELDS, RELEASED_N_PARAMS
from walrus.model.encoder import Decoder
from walrus.model.jitter import AxisPlan, PatchJitterer, flag_jitter
from walrus.model.walrus import Walrus

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
CURRENT = FIXTURES / "walrus_current_tiny2d.pt"
CURRENT_JSON = FIXTURES / "walrus_current_tiny2d.json"
RELEASED_CONFIG = FIXTURES / "walrus_released_config.json"
RELEASED_KEYS = FIXTURES / "walrus_released_keys.json"
needs_fixture = pytest.mark.skipif(
    not (CURRENT.is_file() and CURRENT_JSON.is_file()),
    reason=f"reference fixture {CURRENT} not found (../shared next to repo)",
)
needs_released = pytest.mark.skipif(
    not (RELEASED_CONFIG.is_file() and RELEASED_KEYS.is_file()),
    reason=f"released config/keys not found in {FIXTURES}",
)
W, OP, P = int(BoundaryType.WALL), int(BoundaryType.OPEN), int(BoundaryType.PERIODIC)
# The fixture's 8 vocabulary slots, named after released fields so fine-tuning data matches.
FIELDS = list(RELEASED_FIELDS[:6]) + ["density", "energy"]


@pytest.fixture(scope="module")
def fixture() -> dict:
    return torch.load(CURRENT, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads(CURRENT_JSON.read_text())


def fresh(fixture: dict, meta: dict) -> Walrus:
    state = {k: v.clone() for k, v in fixture["state_dict"].items()}
    model, _ = load_official(state, config={"model": meta["model"]}, fields=FIELDS)
    return model


def run(model: Walrus, fixture: dict, **kw) -> torch.Tensor:
    """The model on the fixture input, back in the official (T, B, ...) layout."""
    x = fixture["x"].transpose(0, 1)  # (B, T, C, H, W)
    return model(x, fixture["state_labels"], fixture["bcs"][0], **kw).transpose(0, 1)


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).abs().max() / ref.abs().max()).item()


def recorded_draws(meta: dict, run_name: str = "y_jitter_fixed") -> list[int]:
    rec = meta["jitter_run"][run_name]
    patch = rec["patch_jitterer_draws"]["rolls"]
    return patch + [d["value"] for d in rec["processor_roll_draws_in_order"]]


@needs_fixture
def test_fixture_output_matches_official(fixture: dict, meta: dict) -> None:
    model = fresh(fixture, meta)
    assert model.compat == "walrus_current" and not model.training
    assert model.conversion_report.layout == "current"
    assert model.num_params() == meta["model"]["n_parameters"]
    assert model.space_bag is None and model.blocks[0].time_mixing.gamma is None
    with torch.no_grad():
        y = run(model, fixture)
    assert rel(y, fixture["y"]) < 1e-5


@needs_fixture
@pytest.mark.parametrize("grad", [False, True], ids=["inference_path", "autograd_path"])
def test_fixture_fixed_jitter_replayed(fixture: dict, meta: dict, grad: bool) -> None:
    model = fresh(fixture, meta)
    model.jitter = model.latent_roll = True  # the fixture model was built with jitter off
    with torch.set_grad_enabled(grad), model.replay_jitter(recorded_draws(meta)):
        y = run(model, fixture, jitter_seed=0).detach()
    ref = fixture["y_jitter_fixed"]
    assert rel(y, ref) < 1e-5
    assert rel(fixture["y"], ref) > 0.1  # the jitter changes the output: the replay matters


@needs_fixture
def test_jitter_is_seeded_and_can_be_turned_off(fixture: dict, meta: dict) -> None:
    model = fresh(fixture, meta)
    model.jitter = model.latent_roll = True
    x = fixture["x"].transpose(0, 1)[:1, :2]  # (1, 2, C, H, W)
    args = (fixture["state_labels"], fixture["bcs"][0])
    with torch.no_grad():
        a, b = model(x, *args, jitter_seed=3), model(x, *args, jitter_seed=3)
        c = model(x, *args, jitter_seed=4)
        off = model(x, *args)  # no seed in eval: no jitter
        model.jitter = False
        plain = model(x, *args, jitter_seed=3)
    assert torch.equal(a, b) and not torch.allclose(a, c)
    assert torch.equal(off, plain)
    model.jitter = True
    with pytest.raises(ValueError, match="outside the range"), model.replay_jitter([500] * 6):
        model(x, *args, jitter_seed=0)


@needs_released
def test_released_key_set_converts_on_meta_with_exact_parameter_count() -> None:
    spec = json.loads(RELEASED_KEYS.read_text())
    state = {k: torch.empty(s, device="meta") for k, s in spec["keys"].items()}
    assert len(state) == 857 and check_layout(state) == "current"
    conv = convert_state_dict(state, source="walrus.pt")
    assert conv.report.n_params == spec["n_parameters"] == RELEASED_N_PARAMS
    cfg = {k: v for k, v in conv.model_config.items() if k != "_target_"}
    with torch.device("meta"):
        model = Walrus(**cfg)
    result = model.load_state_dict(conv.state_dict, strict=True, assign=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert model.num_params() == RELEASED_N_PARAMS
    # The vocabulary, settings and preset come without any user YAML.
    released = json.loads(RELEASED_CONFIG.read_text())
    index = released["field_index_map"]
    assert conv.vocab.names == sorted(index, key=index.get)
    preset = yaml.safe_load((CONFIG_DIR / "model" / "walrus_released.yaml").read_text())
    knobs = ("temporal_kernel", "spatial_kernel", "grad_checkpointing")
    assert {k: v for k, v in preset.items() if k not in knobs} == conv.model_config
    meta = conv.checkpoint()["walrus"]
    assert meta["inference"] == {"jitter": True}
    assert meta["data_config"] == {"n_steps_input": 6}
    assert conv.model_config["groups"] == released["model"]["groups"]
    # The released config file gives the same result and is checked against the weights.
    state = {k: torch.empty(s, device="meta") for k, s in spec["keys"].items()}
    again = convert_state_dict(state, config=RELEASED_CONFIG, fields=RELEASED_CONFIG)
    assert again.model_config == conv.model_config and again.vocab == conv.vocab
    state = {k: torch.empty(s, device="meta") for k, s in spec["keys"].items()}
    with pytest.raises(ValueError, match=r"walrus\.pt: .*processor_blocks=24 \(weights: 40\)"):
        convert_state_dict(state, config={"model": {"processor_blocks": 24}}, source="walrus.pt")


@needs_released
@pytest.mark.parametrize(
    "config, match",
    [
        ({"model": {"jitter_patches": "yes"}}, r"jitter_patches='yes' must be true or false"),
        ({"model": {"drop_path": 2}}, r"drop_path=2 must be a number in \[0, 1\)"),
        ({"reserved_indices": {"5": "x"}}, r"walrus\.pt: reserved_indices .* differ"),
        ({"trainer_and_data": {"n_steps_input": 0}}, r"n_steps_input=0 must be an integer"),
        ({"field_index_map": {"a": 0}}, r"lists 1 fields but .* has 67 \(embed"),
    ],
)
def test_bad_config_values_are_named(config: dict, match: str) -> None:
    spec = json.loads(RELEASED_KEYS.read_text())
    state = {k: torch.empty(s, device="meta") for k, s in spec["keys"].items()}
    with pytest.raises(ValueError, match=match):
        convert_state_dict(state, config=config, source="walrus.pt")


@needs_fixture
@pytest.mark.parametrize(
    "shape, bcs",
    [
        ((1, 2, 3, 64, 32), [[W, OP], [OP, W]]),  # walls and open sides
        ((1, 2, 3, 64, 128), [[P, P], [W, W]]),  # mixed, two stride pairs
        ((1, 2, 3, 32, 32, 32), [[P, P], [W, OP], [P, P]]),  # 3D: the "3" encoder
        ((2, 2, 3, 64), [[W, OP]]),  # 1D: the "2" encoder, kernels summed
    ],
)
def test_boundaries_and_dimensions_run(fixture: dict, meta: dict, shape, bcs) -> None:
    model = fresh(fixture, meta)
    model.jitter = model.latent_roll = True
    x = torch.randn(shape)
    labels = fixture["state_labels"]
    with torch.no_grad():
        y = model(x, labels, bcs)
        yj = model(x, labels, bcs, jitter_seed=2)  # seed 1 draws a 0 shift here
    assert y.shape == yj.shape == x.shape
    assert torch.isfinite(y).all() and torch.isfinite(yj).all()
    assert not torch.allclose(y, yj)


def test_flag_channels_mark_boundary_padding() -> None:
    plans = [AxisPlan(2, 1, 0, W, OP), AxisPlan(1, 1, 0, P, P)]
    x = torch.ones(1, 1, 4, 3)
    h = flag_jitter(x, plans)[0]  # (1 + 3, 7, 5): field, ones, wall, open
    assert h.shape == (4, 7, 5)
    assert h[0, :2].abs().max() == 0 and h[0, 6].abs().max() == 0  # zeros in the padding
    assert h[0, 2:6].min() == 1  # data, wrapped around the periodic axis
    assert h[1, :2].max() == 0 and h[1, 6].max() == 0 and h[1, 2:6].min() == 1  # ones channel
    assert h[2, :2].min() == 1 and h[2, 2:].max() == 0  # wall flag on the low side only
    assert h[3, 6].min() == 1 and h[3, :6].max() == 0  # open flag on the high side only
    corner = flag_jitter(x, [AxisPlan(1, 1, 0, W, W), AxisPlan(1, 1, 0, W, OP)])[0]
    assert corner[2, 0, 0] == 2 and corner[2, 0, -1] == 1 and corner[3, 0, -1] == 1


def test_flag_jitter_shift_is_undone() -> None:
    x = torch.randn(2, 3, 16, 12)
    plans = [AxisPlan(5, 5, -3, W, OP), AxisPlan(6, 6, 4, P, P)]
    h = flag_jitter(x, plans)
    assert h.shape == (2, 6, 26, 24)
    assert torch.equal(PatchJitterer.unjitter(h[:, :3], plans), x)


def test_decoder_wrap_equals_decoding_the_tiled_grid() -> None:
    torch.manual_seed(0)
    z = torch.randn(1, 4, 6)  # (N, C, n) on a periodic axis
    w = torch.randn(4, 2, 8)  # kernel 8, stride 2: 3 tokens of wrap per side
    wrapped = Decoder._conv_t(z, w, None, [2], [True])
    tiled = Decoder._conv_t(z.repeat(1, 1, 3), w, None, [2], [False])
    n, s = z.shape[-1], 2
    assert wrapped.shape[-1] == (n - 1) * s + 8
    torch.testing.assert_close(wrapped, tiled[..., n * s : n * s + wrapped.shape[-1]])


@needs_fixture
def test_resize_vocab_keeps_outputs_and_flag_columns(fixture: dict, meta: dict) -> None:
    model = fresh(fixture, meta)
    x = fixture["x"].transpose(0, 1)[:1, :2, :, :64, :64]  # (B, T, C, H, W)
    args = (fixture["state_labels"], [[W, OP], [P, P]])
    flags = model.embed["2"].proj1.weight[:, :2].clone()  # wall, open columns
    with torch.no_grad():
        before = model(x, *args)
        model.resize_vocab(11)
        after = model(x, *args)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    assert model.n_fields == 11 and model.embed["3"].proj1.weight.shape[1] == 11
    assert torch.equal(model.embed["2"].proj1.weight[:, :2], flags)
    with torch.no_grad():
        y = model(x, torch.tensor([10, 3, 5]), args[1])  # a new field runs
    assert torch.isfinite(y).all()
    with pytest.raises(ValueError, match=r"ids \[0\], reserved for the boundary flag channels"):
        model(x, torch.tensor([0, 3, 5]), args[1])


def test_latent_roll_equals_rolling_tokens() -> None:
    """A native model: rolled RoPE tables give the block's result on rolled tokens."""
    torch.manual_seed(0)
    model = Walrus(5, 32, 1, 4, projection_dim=8, intermediate_dim=16, groups=4).eval()
    blk, grid = model.blocks[0], [4, 6, 1]
    z = torch.randn(2, 3, 24, 32)  # (B, T, S, D)
    rope = model.rope.tables(tuple(grid), z.device, z.dtype)

    class Draws:
        def randint(self, low: int, high: int) -> int:
            return {4: 3, 6: 5}[high]

    model.latent_roll = True
    (rolled,) = model._block_ropes(rope, grid, [0, 1], Draws())
    shifts, dims = (3, 5), (2, 3)
    with torch.no_grad():
        tokens = z.view(2, 3, 4, 6, 32).roll(shifts, dims).reshape(2, 3, 24, 32)
        ref = blk(tokens, rope).view(2, 3, 4, 6, 32).roll((-3, -5), dims).reshape(z.shape)
        torch.testing.assert_close(blk(z, rolled), ref, rtol=1e-5, atol=1e-6)


def test_latent_roll_is_a_seeded_native_option() -> None:
    torch.manual_seed(0)
    kw = dict(projection_dim=8, intermediate_dim=16, groups=4)
    model = Walrus(5, 32, 2, 4, latent_roll=True, **kw).eval()
    x = torch.randn(1, 2, 2, 32, 32)
    bcs = [[P, P], [W, W]]
    with torch.no_grad():
        a = model(x, [0, 1], bcs, jitter_seed=7)
        assert torch.equal(a, model(x, [0, 1], bcs, jitter_seed=7))
        plain = model(x, [0, 1], bcs)  # eval without a seed: no jitter at all
        model.latent_roll = False
        b = model(x, [0, 1], bcs, jitter_seed=7)  # same patch shift, no rolls
        assert torch.equal(model(x, [0, 1], bcs), plain)
        model.latent_roll = True
    assert not torch.allclose(a, b)
    with torch.enable_grad():
        g = model(x, [0, 1], bcs, jitter_seed=7)  # autograd path: same draws, same result
    torch.testing.assert_close(g.detach(), a, rtol=1e-5, atol=1e-6)
    # Draw order: one shift per strided axis, then one roll per periodic axis per block.
    with torch.no_grad(), model.replay_jitter([1, -1, 3, 0]):  # latent grid 8 x 8
        model(x, [0, 1], bcs, jitter_seed=0)
    unused = pytest.raises(ValueError, match="1 of 5 recorded draws were not used")
    with unused, torch.no_grad(), model.replay_jitter([1, -1, 3, 0, 2]):
        model(x, [0, 1], bcs, jitter_seed=0)


# ---------------------------------------------------------------------- files, CLI, training


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The fixture file converted by the CLI (once per module): (checkpoint, stdout)."""
    tmp = tmp_path_factory.mktemp("cli_current")
    fields = tmp / "fields.yaml"
    fields.write_text(yaml.safe_dump(FIELDS))
    out = tmp / "out.ckpt"
    cmd = [sys.executable, "-m", "walrus.compat", "convert", str(CURRENT), str(out)]
    cmd += ["--fields", str(fields), "--config", str(CURRENT_JSON)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    return out, res.stdout


@needs_fixture
def test_cli_checkpoint_loads_and_records_inference_jitter(fixture: dict, converted) -> None:
    out, stdout = converted
    assert "official layout: current (compat walrus_current)" in stdout
    model, vocab = load_model(out)
    assert vocab.names == FIELDS and model.compat == "walrus_current"
    with torch.no_grad():
        assert rel(run(model.eval(), fixture), fixture["y"]) < 1e-5
    meta = load_checkpoint_file(out)["walrus"]
    assert meta["source"]["layout"] == "current"
    assert meta["inference"] == {"jitter": False}  # this fixture was built with jitter off
    assert "data_config" not in meta  # its config does not say how many input steps


@needs_fixture
def test_cli_truncated_file_gets_one_line(tmp_path: Path, capsys) -> None:
    cut = tmp_path / "walrus.pt"
    cut.write_bytes(CURRENT.read_bytes()[:100_000])
    assert cli_main(["convert", str(cut), str(tmp_path / "o.ckpt")]) == 2
    assert not (tmp_path / "o.ckpt").exists()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(cut) in lines[0] and "truncated" in lines[0]


@needs_fixture
def test_finetune_converted_checkpoint_on_a_new_field(
    compose_cfg, tiny_data_root, tmp_path, converted, fixture
) -> None:
    from walrus.training.train import train

    overrides = tiny_train_overrides(tiny_data_root, tmp_path, "finetune")
    overrides += [
        f"init_from={converted[0]}",
        "data=navier_stokes_2d",
        "data.generate_if_missing=false",
        "data.batch_size=1",
        "data.max_val_windows=1",
        "optimizer.lr=0.0",
    ]
    train(compose_cfg("train", overrides))
    model, vocab = load_model(tmp_path / "checkpoints" / "last.ckpt")
    assert vocab.names == FIELDS + ["vorticity"] and model.n_fields == 9
    assert model.compat == "walrus_current"
    original, _ = load_model(converted[0])
    x = fixture["x"].transpose(0, 1)[:1, :2, :, :32, :32]
    bcs = [[P, P], [P, P]]
    with torch.no_grad():  # lr 0: the grown model is the converted one on the old fields
        torch.testing.assert_close(
            model.eval()(x, fixture["state_labels"], bcs),
            original.eval()(x, fixture["state_labels"], bcs),
            rtol=1e-5,
            atol=1e-6,
        )
