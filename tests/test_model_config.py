"""WalrusConfig: typed validation of stored model configs, round trips, numerics profiles."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import yaml

from walrus.checkpoint import atomic_torch_save, build_model, load_model
from walrus.data.vocab import FieldVocabulary
from walrus.model.config import MODEL_TARGET, WalrusConfig
from walrus.model.profile import NATIVE, PROFILES, WALRUS_CURRENT, WALRUS_OFFICIAL, get_profile
from walrus.model.walrus import Walrus

REPO = Path(__file__).resolve().parents[1]
BASE = {"_target_": MODEL_TARGET, "n_fields": 4, "dim": 32, "depth": 1, "heads": 4,
        "projection_dim": 8, "intermediate_dim": 16, "groups": 4}  # fmt: skip

KWARGS = {k: v for k, v in BASE.items() if k != "_target_"}


def _touch_config(marker: Path) -> dict:
    """A Hydra node that would create ``marker`` if it were ever instantiated."""
    return {"_target_": "pathlib.Path.touch", "self": {"_target_": "pathlib.Path", "_args_": [str(marker)]}}  # fmt: skip


@pytest.mark.parametrize(
    ("key", "value", "kind"),
    [
        ("groups", "nested", "an int"),
        ("causal", "nested", "true or false"),
        ("dim", "32", "an int"),
        ("dim", True, "an int"),
        ("dim", 32.0, "an int"),
        ("drop_path", "0.1", "a number"),
        ("jitter", 1, "true or false"),
        ("include_d", [2, "3"], "a list of ints"),
        ("kernel_sizes", [8], "a list of 2 ints"),
        ("stride_options", [[2, 2], [4]], r"a list of \(s1, s2\) pairs"),
        ("temporal_kernel", ["sdpa"], "a string"),
        ("heads", "${oc.env:HOME}", "an int"),
    ],
)
def test_wrong_kind_names_the_option(tmp_path, key, value, kind):
    marker = tmp_path / "pwned"
    if value == "nested":
        value = _touch_config(marker)
    with pytest.raises(ValueError, match=rf"entry '{key}' must be a plain value \({kind}"):
        WalrusConfig.from_dict({**BASE, key: value})
    with pytest.raises(ValueError, match=rf"cannot build the model from its config: .*'{key}'"):
        build_model({**BASE, key: value})
    assert not marker.exists()


def test_interpolations_are_never_resolved(monkeypatch):
    monkeypatch.setenv("WALRUS_SECRET", "s3cr3t-value")
    for key in ("temporal_kernel", "compat"):
        with pytest.raises(ValueError, match=key) as err:
            build_model({**BASE, key: "${oc.env:WALRUS_SECRET}"})
        assert "s3cr3t-value" not in str(err.value)
        assert "${oc.env:WALRUS_SECRET}" in str(err.value)


def test_unknown_missing_and_foreign_keys(tmp_path):
    with pytest.raises(ValueError, match="unknown option 'no_such_option'"):
        build_model({**BASE, "no_such_option": 1})
    with pytest.raises(ValueError, match=r"lacks required option\(s\) \['heads'\]"):
        WalrusConfig.from_dict({k: v for k, v in BASE.items() if k != "heads"})
    marker = tmp_path / "pwned"
    with pytest.raises(ValueError, match="not a walrus model"):
        build_model({**BASE, "_target_": "pathlib.Path.touch", "self": str(marker)})
    with pytest.raises(ValueError, match="unknown option 'self'"):
        WalrusConfig.from_dict({k: v for k, v in BASE.items() if k != "_target_"} | {"self": 1})
    with pytest.raises(ValueError, match="must be a mapping"):
        WalrusConfig.from_dict(["dim", 32])  # type: ignore[arg-type]
    assert not marker.exists()


def test_crafted_checkpoint_runs_nothing_when_loaded(tmp_path):
    marker = tmp_path / "pwned"
    good = Walrus(WalrusConfig.from_dict(BASE))
    meta = {"format": 1, "vocab": FieldVocabulary(["a", "b", "c", "d"]).to_dict()}
    state = {f"model.{k}": v for k, v in good.state_dict().items()}
    path = tmp_path / "crafted.ckpt"
    atomic_torch_save(
        {"state_dict": state, "walrus": {**meta, "model_config": {**BASE, "jitter": _touch_config(marker)}}},
        path,
    )  # fmt: skip
    with pytest.raises(ValueError, match="jitter"):
        load_model(path)
    assert not marker.exists()
    atomic_torch_save({"state_dict": state, "walrus": {**meta, "model_config": BASE}}, path)
    model, _ = load_model(path)
    assert model.config == WalrusConfig.from_dict(BASE)


def test_round_trip_as_plain_data():
    cfg = WalrusConfig(
        n_fields=5, dim=32, depth=2, heads=4, groups=4, strides=[4, 2], include_d=[3, 2],
        stride_options=[[2, 2], [4, 2]], compat="walrus_official",
    )  # fmt: skip
    data = cfg.to_dict()
    assert data["_target_"] == MODEL_TARGET and data["intermediate_dim"] == 8
    assert data["strides"] == [[4, 2]] and data["include_d"] == [2, 3]
    plain = (type(None), bool, int, float, str, list)
    assert all(isinstance(v, plain) for v in data.values())
    assert WalrusConfig.from_dict(yaml.safe_load(yaml.safe_dump(data))) == cfg
    a, b = Walrus(cfg), build_model(data)
    assert {k: v.shape for k, v in a.state_dict().items()} == {
        k: v.shape for k, v in b.state_dict().items()
    }
    assert b.config == cfg and b.compat == "walrus_official"


def test_resize_vocab_and_fused_update_the_config():
    model = Walrus(WalrusConfig.from_dict(BASE))
    model.resize_vocab(9)
    model.set_fused(False)
    assert model.config.n_fields == 9 == model.n_fields and model.config.fused is False
    assert build_model(model.config.to_dict()).state_dict()["space_bag.linear.weight"].shape == (
        8,
        9,
    )


@pytest.mark.parametrize(
    "path", sorted((REPO / "configs" / "model").glob("*.yaml")), ids=os.path.basename
)
def test_model_presets_are_valid_configs(path):
    raw = yaml.safe_load(path.read_text())
    cfg = WalrusConfig.from_dict(raw)
    with torch.device("meta"):
        assert Walrus(**{k: v for k, v in raw.items() if k != "_target_"}).config == cfg


def test_runtime_options_are_options():
    names = set(WalrusConfig.__dataclass_fields__)
    assert set(WalrusConfig.RUNTIME_OPTIONS) <= names
    assert not {"dim", "depth", "heads", "n_fields", "compat"} & set(WalrusConfig.RUNTIME_OPTIONS)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"dim": 36, "heads": 8}, "not divisible by heads"),
        ({"heads": 8}, "head_dim"),
        ({"groups": 5}, "not divisible by groups"),
        ({"mlp_ratio": 1.03}, "mlp_ratio"),
        ({"n_spatial_max": 4}, "n_spatial_max"),
        ({"drop_path": 1.0}, "drop_path"),
        ({"strides": [16, 4]}, "exceeds kernel_sizes"),
        ({"include_d": [4]}, "include_d"),
        ({"target_latent": [32, 32]}, "target_latent"),
        ({"compat": "walrus_current", "flag_fields": [0, 0, 1]}, "flag_fields"),
        ({"compat": "walrus"}, "compat='walrus' is not known"),
        ({"spatial_kernel": "nope"}, "spatial_kernel='nope' is not an attention kernel"),
    ],
)
def test_cross_field_checks(changes, match):
    with pytest.raises(ValueError, match=re.escape(match) if "'" in match else match):
        WalrusConfig.from_dict({**BASE, **changes})


def test_profiles_are_chosen_at_construction():
    assert get_profile(None) is NATIVE and PROFILES["walrus_current"] is WALRUS_CURRENT
    with pytest.raises(ValueError, match="compat='x' is not known"):
        get_profile("x")
    eps = torch.finfo(torch.float32).eps
    for profile in (WALRUS_OFFICIAL, WALRUS_CURRENT):
        model = Walrus(**KWARGS, compat=profile.name)
        assert model.profile is profile
        norms = [model.blocks[0].time_mixing.norm1, model.debed["3"].norm1, model.embed["2"].norm2]
        assert all(n.groups == n.dim and n.eps == eps for n in norms)
        assert all(d.kernel_reduce == "mean" for d in model.debed.values())
        assert all(d.periodic_wrap == (profile is WALRUS_CURRENT) for d in model.debed.values())
        assert (model.space_bag is None) == (profile is WALRUS_CURRENT)
    native = Walrus(WalrusConfig.from_dict(BASE))
    assert native.blocks[0].space_mixing.norm1.groups == 4
    assert native.blocks[0].space_mixing.norm1.eps == 1e-6


def test_no_module_branches_on_a_compat_name():
    """Only the profile registry and the converter name the official profiles."""
    allowed = {"model/profile.py", "model/config.py"}
    offenders = []
    for path in (REPO / "walrus").rglob("*.py"):
        rel = path.relative_to(REPO / "walrus").as_posix()
        if rel in allowed or rel.startswith("compat/"):
            continue
        if re.search(r"""["'](walrus_official|walrus_current)["']""", path.read_text()):
            offenders.append(rel)
    assert not offenders, offenders
