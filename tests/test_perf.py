"""Performance work: bf16 autocast, fused vs plain float64 equivalence, work accounting."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from walrus.bcs import BoundaryType
from walrus.model.walrus import Walrus

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks/ scripts
from benchmarks.accounting import account, analytic_processor_flops  # noqa: E402

P, W = int(BoundaryType.PERIODIC), int(BoundaryType.WALL)
BCS = [[P, P], [W, W]]


def tiny(**kw) -> Walrus:
    torch.manual_seed(0)
    args = dict(projection_dim=8, intermediate_dim=16, groups=4, layer_scale_init=0.5)
    args.update(kw)
    model = Walrus(5, 32, 2, 4, **args)
    with torch.no_grad():  # non-trivial norms, biases and layer scales
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("fused", [True, False])
def test_bf16_autocast_forward(fused):
    model = tiny(fused=fused).eval()
    x = torch.randn(2, 3, 2, 32, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x, torch.tensor([0, 3]), BCS)
    ref = model.float()(x, torch.tensor([0, 3]), BCS).detach()
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert (y.float() - ref).norm() / ref.norm() < 0.05


def test_bf16_autocast_train_step():
    model = tiny(include_d=(2,)).train()
    x = torch.randn(1, 3, 2, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x, torch.tensor([0, 3]), BCS, jitter_seed=0)
    y.float().square().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


@pytest.mark.parametrize("train", [False, True])
def test_fused_matches_plain_float64(train):
    fused = tiny().train(train)
    plain = copy.deepcopy(fused).double()
    plain.set_fused(False)
    x = torch.randn(2, 3, 2, 32, 24)
    fields = torch.tensor([4, 1])
    y = fused(x, fields, BCS, jitter_seed=1)  # fp32, fused
    ref = plain(x.double(), fields, BCS, jitter_seed=1)  # plain float64 evaluation
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-5)
    fused64 = copy.deepcopy(plain)
    fused64.set_fused(True)
    y64 = fused64(x.double(), fields, BCS, jitter_seed=1)
    torch.testing.assert_close(y64, ref, rtol=1e-10, atol=1e-12)
    if train:
        y64.square().sum().backward()
        ref.square().sum().backward()
        for (name, a), b in zip(fused64.named_parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-8, atol=1e-12, msg=name)


@torch.no_grad()
def test_inference_cache_follows_parameter_updates():
    model = tiny().eval()
    x = torch.randn(1, 2, 2, 32, 32)
    fields = torch.tensor([0, 1])
    model(x, fields, BCS)  # fills the caches
    blk = model.blocks[0]
    blk.time_mixing.gamma.mul_(3.0)
    blk.space_mixing.q_norm.bias.add_(1.0)
    y = model(x, fields, BCS)
    model.set_fused(False)
    torch.testing.assert_close(y, model(x, fields, BCS), rtol=1e-5, atol=1e-6)


def _fake_report(model: Walrus, fused: bool, b: int = 2):
    fields = torch.tensor([0, 1])
    fake = copy.deepcopy(model)
    fake.set_fused(fused)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = fake.to_empty(device="cpu")
        x = torch.empty(b, 3, 2, 32, 32)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            account(lambda: fake(x, fields, BCS))  # warm the caches
            return account(lambda: fake(x, fields, BCS))


def test_accounting_on_fake_tensors():
    model = tiny().eval()
    fused, plain = _fake_report(model, True), _fake_report(model, False)
    assert fused.syncs == [] and plain.syncs == []
    assert fused.host_calls > 0  # the CPU field-id checks run for real, apart
    assert fused.flops == plain.flops > 0
    assert fused.materialised_bytes < plain.materialised_bytes
    assert fused.calls < plain.calls


def test_accounting_counts_flops_bytes_and_syncs():
    with FakeTensorMode():
        a, b = torch.empty(8, 16), torch.empty(16, 4)

        def fn():
            y = a @ b  # 2*8*16*4 FLOPs, 8*4*4 bytes
            y.view(32)  # a view: a call, no bytes
            y.add_(1.0)  # in place
            return float(y.sum())  # a host sync

        r = account(fn)
    assert r.flops == 2 * 8 * 16 * 4
    assert r.materialised_bytes == 8 * 4 * 4 + 4  # mm output + the sum scalar
    assert r.inplace_bytes == 8 * 4 * 4
    assert len(r.syncs) == 1 and "_local_scalar_dense" in r.syncs[0]


def test_analytic_processor_flops_official_size():
    flops = analytic_processor_flops(1408, 40, 5632, 6, 32 * 32)
    assert abs(flops / 1e12 - 15.07) < 0.01


def test_scale_script_runs_on_the_tiny_preset(tmp_path):
    from benchmarks.scale import main

    argv = ["--preset", "tiny", "--grid", "32", "32", "--batches", "1", "--frames", "2"]
    rows = main(argv + ["--results-dir", str(tmp_path)])["rows"]
    assert (tmp_path / "scale.json").is_file()
    fused, plain = rows
    assert fused["fused"] and not plain["fused"] and fused["syncs"] == 0
    assert fused["GB"] < plain["GB"] and fused["calls"] < plain["calls"]
