"""The field-agnostic input path (``field_embedding="shared"``): shapes, the default left as
it was, new fields starting from the known identities, and a fine-tune onto new fields."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_train_overrides
from tests.test_patch_encoder import assert_folded_equals_unfolded
from walrus.checkpoint import atomic_torch_save, load_checkpoint_file, model_state_dict
from walrus.model.config import WalrusConfig
from walrus.model.field_embedding import SharedFieldEmbedding
from walrus.model.walrus import Walrus
from walrus.training.train import train

TINY = dict(n_fields=8, dim=32, depth=1, heads=4, projection_dim=8, intermediate_dim=16, groups=4)
BCS = [[2, 2], [0, 0]]  # periodic x, wall y


def _model(encoder: str, field_embedding: str | None, seed: int = 0) -> Walrus:
    extra = {"encoder": encoder, "include_d": [2]}
    if encoder == "patch":
        extra["kernel_sizes"] = [4, 2]
    if field_embedding is not None:
        extra["field_embedding"] = field_embedding
    torch.manual_seed(seed)
    return Walrus(**TINY, **extra).eval()


@pytest.mark.parametrize("encoder", ["conv", "patch"])
def test_shared_model_shapes_and_parameters(encoder):
    model = _model(encoder, "shared")
    x = torch.randn(2, 3, 3, 32, 16)  # (B, T, C, H, W)
    y = model(x, torch.tensor([1, 4, 6]), BCS)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert isinstance(model.space_bag, SharedFieldEmbedding)
    assert model.space_bag.identity.shape == (8, 8)  # (n_fields, projection_dim)
    assert model.space_bag.lift.shape == (8,)
    assert model.debed["2"].proj2.weight.shape[1] == 8  # one decoder row per vocabulary field
    assert "space_bag.linear.weight" not in model.state_dict()
    y.sum().backward()
    assert model.space_bag.identity.grad[[1, 4, 6]].abs().sum() > 0
    assert model.space_bag.identity.grad[[0, 2, 3, 5, 7]].abs().sum() == 0


@pytest.mark.parametrize("encoder", ["conv", "patch"])
def test_columns_is_the_default_and_unchanged(encoder):
    default, columns = _model(encoder, None), _model(encoder, "columns")
    assert default.config.field_embedding == "columns" and not default.shared_fields
    a, b = default.state_dict(), columns.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert {k for k in a if k.startswith("space_bag.")} == {
        "space_bag.linear.weight",
        "space_bag.linear.bias",
    }
    assert default.debed["2"].proj2.weight.shape[1] == 8  # one row per vocabulary field
    x = torch.randn(1, 2, 2, 32, 16)
    assert torch.equal(default(x, torch.tensor([0, 5]), BCS), columns(x, torch.tensor([0, 5]), BCS))
    with pytest.raises(ValueError, match="field_embedding='shared'"):
        columns.init_new_fields([6], [0, 1])


def test_new_field_starts_at_the_mean_identity():
    model = _model("patch", "shared")
    bag = model.space_bag
    model.resize_vocab(10)  # grows the identities and the decoder rows
    assert bag.identity.shape == (10, 8) and model.n_fields == 10
    assert model.debed["2"].proj2.weight.shape[1] == 10
    model.init_new_fields([8], [0, 1, 2], spread=0.0)
    mean = bag.identity[:3].mean(dim=0)
    assert torch.allclose(bag.identity[8], mean)
    # so its embedding column is the mean of the known fields' columns
    w, _ = bag.weight_and_bias(torch.tensor([0, 1, 2, 8]))  # (P, 4), one 4-field batch
    assert torch.allclose(w[:, 3], w[:, :3].mean(dim=1), atol=1e-6)
    with pytest.raises(ValueError, match=r"ids must be in \[0, 10\)"):
        model.init_new_fields([10], [0])


def test_new_fields_start_apart_inside_the_known_spread():
    model = _model("conv", "shared", seed=1)
    model.resize_vocab(2008)
    bag, new = model.space_bag, list(range(8, 2008))
    model.init_new_fields(new, range(8))  # default spread 1
    std, mean = torch.std_mean(bag.identity[:8], dim=0, correction=0)  # (P,) each
    draws = bag.identity[8:]  # (2000, P)
    assert not torch.allclose(draws[0], draws[1])  # two new fields are told apart
    torch.testing.assert_close(
        draws.mean(dim=0), mean, atol=4 * std.max().item() / 2000**0.5, rtol=0
    )
    torch.testing.assert_close(draws.std(dim=0), std, rtol=0.1, atol=0.0)


def test_resize_keeps_old_fields_outputs():
    model = _model("conv", "shared")
    x, fields = torch.randn(1, 2, 2, 32, 16), torch.tensor([2, 3])
    before = model(x, fields, BCS)
    model.resize_vocab(12)
    assert torch.equal(model(x, fields, BCS), before)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"field_embedding": "tokens"}, "field_embedding='tokens' is not known"),
        ({"field_embedding": "shared", "compat": "walrus_official"}, "official profiles"),
    ],
)
def test_bad_field_embedding_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        WalrusConfig(**TINY, **changes)


def test_finetune_onto_new_fields_with_shared_embedding(compose_cfg, tiny_data_root, tmp_path):
    def run(out, *extra, experiment="quickstart"):
        overrides = tiny_train_overrides(tiny_data_root, out, experiment)
        return train(compose_cfg("train", [*overrides, "trainer.limit_train_batches=1", *extra]))

    run(tmp_path / "pre", "model.n_fields=3", "+model.field_embedding=shared")
    ckpt = load_checkpoint_file(tmp_path / "pre" / "checkpoints" / "last.ckpt")
    ckpt["state_dict"]["model.space_bag.identity"] += 100.0  # far from any fresh init
    src = tmp_path / "moved.ckpt"
    atomic_torch_save(ckpt, src)
    old = model_state_dict(load_checkpoint_file(src))["space_bag.identity"]  # (3, P)
    # rate 0: the one step runs end to end and leaves the weights where they started
    run(tmp_path / "ft", f"init_from={src}", "optimizer.lr=0.0", experiment="finetune")
    ckpt = load_checkpoint_file(tmp_path / "ft" / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 1
    assert ckpt["walrus"]["vocab"]["names"][3:] == ["A", "B"]
    assert ckpt["walrus"]["model_config"]["field_embedding"] == "shared"
    new = model_state_dict(ckpt)["space_bag.identity"]  # (5, P)
    assert torch.equal(new[:3], old)
    std, mean = torch.std_mean(old, dim=0, correction=0)  # (P,) each
    z = (new[3:] - mean) / std  # (2, P): the new fields' draws in units of the known spread
    assert z.abs().max() < 5 and not torch.allclose(new[3], new[4])


def test_shared_embedding_folds_into_the_patch_encoder():
    """The shared lift is linear: the folded patch forward equals embedding first (the path
    taken while input dropout is active), values and gradients, in float64."""
    model = _model("patch", "shared").double().train()
    with torch.no_grad():
        model.space_bag.bias.normal_()  # a bias that shows
    x = torch.randn(2, 3, 2, 16, 13, dtype=torch.float64)
    assert_folded_equals_unfolded(model, x, torch.tensor([1, 4]), [[2, 2], [0, 1]], 5)
