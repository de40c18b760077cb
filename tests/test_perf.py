"""Performance work: bf16 autocast, fused vs plain float64 equivalence, work accounting."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

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


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", ["sdpa", "chunked"])
def test_inference_path_matches_plain_float64(causal, kernel):
    model = tiny(causal=causal, temporal_kernel=kernel, spatial_kernel=kernel).double().eval()
    plain = copy.deepcopy(model)
    plain.set_fused(False)
    x = torch.randn(2, 3, 2, 32, 24, dtype=torch.float64)
    fields = torch.tensor([4, 1])
    with torch.no_grad():  # the in-place workspace path
        y = model(x, fields, BCS, jitter_seed=1)
        y2 = model(x, fields, BCS, jitter_seed=1)  # cached derived weights
    ref = plain(x, fields, BCS, jitter_seed=1).detach()
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-12)
    assert torch.equal(y, y2)


class _GemmTracer(TorchDispatchMode):
    """Records every GEMM: (op, output width, first operand 2-D and contiguous)."""

    def __init__(self):
        super().__init__()
        self.gemms: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if any(g in name for g in ("addmm", ".mm.", "bmm")):
            a = args[1]
            self.gemms.append((name, args[2].shape[-1], a.dim() == 2 and a.is_contiguous()))
        return out


@torch.no_grad()
def test_inference_fused_linear_is_one_gemm_on_contiguous_tokens():
    model = tiny().eval()
    width = model.mlp_dim + 3 * model.dim
    with _GemmTracer() as tracer:
        model(torch.randn(2, 3, 2, 32, 32), torch.tensor([0, 1]), BCS)
    fused = [g for g in tracer.gemms if g[1] == width]
    assert [g[0] for g in fused] == ["aten.addmm.out"] * model.depth
    assert all(g[2] for g in fused)
    assert not [g for g in tracer.gemms if "bmm" in g[0] or ".mm." in g[0]]


def test_inference_calls_per_block_stay_low():
    from benchmarks.scale import call_breakdown, load_preset

    args = argparse.Namespace(frames=3, channels=2, grid=[32, 32], grad=False)
    cfg = {**load_preset("tiny"), "temporal_kernel": "sdpa", "spatial_kernel": "sdpa"}
    fused = call_breakdown(cfg, True, 1, args)  # the walrus_1b kernels
    plain = call_breakdown(cfg, False, 1, args)
    assert fused["per_block_total"] <= 31 < plain["per_block_total"]
    rows = {r["op"]: r["per_block"] for r in fused["table"]}
    assert rows.get("aten.view.default", 0) == 0 and rows.get("aten._to_copy.default", 0) == 0


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
            y.addmm_(a, b)  # an in-place GEMM: not counted by stock FlopCounterMode
            return float(y.sum())  # a host sync

        r = account(fn)
    assert r.flops_stock == 2 * 8 * 16 * 4
    assert r.flops == 2 * (2 * 8 * 16 * 4)
    assert r.materialised_bytes == 8 * 4 * 4 + 4  # mm output + the sum scalar
    assert r.inplace_bytes == 2 * 8 * 4 * 4
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
