"""Performance work: bf16 autocast, fused vs plain float64 equivalence, work accounting."""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.accounting import account
from walrus.bcs import BoundaryType
from walrus.model.compile import compile_mode, compile_model
from walrus.model.fast_blocks import run_processor
from walrus.model.flops import estimate_mfu, processor_flops
from walrus.model.walrus import Walrus

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


@pytest.mark.parametrize(
    ("train", "kernel"), [(False, "sdpa"), (True, "sdpa"), (True, "chunked"), (True, "math")]
)
def test_fused_matches_plain_float64(train, kernel):
    fused = tiny(temporal_kernel=kernel, spatial_kernel=kernel).train(train)
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


@pytest.mark.parametrize("ckpt", [False, True])
def test_fused_with_drop_path_matches_plain_float64(ckpt):
    """Training with drop path: modules with a rate > 0 take the reference forward, the rest
    the fused one (same random draws), with or without gradient checkpointing."""
    fused = tiny(drop_path=0.3, grad_checkpointing=ckpt).double().train()
    plain = copy.deepcopy(fused)
    plain.set_fused(False)
    x = torch.randn(2, 3, 2, 32, 24, dtype=torch.float64)
    fields = torch.tensor([4, 1])
    outs = []
    for model in (fused, plain):
        torch.manual_seed(5)
        y = model(x, fields, BCS, jitter_seed=1)
        y.square().sum().backward()
        outs.append(y)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-12)
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
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
    """Records every GEMM: (op, output width, first operand contiguous)."""

    def __init__(self):
        super().__init__()
        self.gemms: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if any(g in name for g in ("addmm", ".mm.", "bmm")):
            a, w = args[:2] if "bmm" in name else args[1:3]
            self.gemms.append((name, w.shape[-1], a.is_contiguous()))
        return out


@torch.no_grad()
def test_inference_gemms_read_contiguous_operands():
    """Per block: the spatial projections are GEMMs of one contiguous token matrix ([ff | v],
    q, k), and RoPE is one batched GEMM per operand on the contiguous LayerNorm output."""
    model = tiny().eval()
    m, c, e = model.mlp_dim, model.dim, model.blocks[0].space_mixing.head_dim
    with _GemmTracer() as tracer:
        model(torch.randn(2, 3, 2, 32, 32), torch.tensor([0, 1]), BCS)
    assert all(g[2] for g in tracer.gemms if g[0] != "aten.addmm_.default")  # not SwiGLU's
    assert [g[0] for g in tracer.gemms if g[1] == m + c] == ["aten.addmm.out"] * model.depth
    assert [g[0] for g in tracer.gemms if "bmm" in g[0]] == ["aten.bmm.out"] * 2 * model.depth
    assert all(g[1] == e for g in tracer.gemms if "bmm" in g[0])
    assert not [g for g in tracer.gemms if ".mm." in g[0]]


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
    # the inference path rotates q and k with one (E, E) matrix per position: 2 * 2C * E per token
    with torch.no_grad():
        model(torch.randn(1, 3, 2, 32, 32), torch.tensor([0, 1]), BCS)
    (grid, *_), *_ = model.rope._cache  # the latent grid of this input (walls pad it)
    tokens = 2 * 3 * math.prod(grid)
    rope = 2 * 2 * model.dim * model.blocks[0].space_mixing.head_dim * tokens * model.depth
    assert fused.flops == plain.flops + rope > rope
    assert fused.materialised_bytes < plain.materialised_bytes
    assert fused.calls < plain.calls


def test_accounting_counts_flops_bytes_and_syncs():
    with FakeTensorMode():
        a, b = torch.empty(8, 16), torch.empty(16, 4)

        def fn():
            y = a @ b  # 2*8*16*4 FLOPs, 8*4*4 bytes
            y.view(32)  # a view: a call, no bytes
            y.new_empty(64)  # an allocation: a call, nothing written
            y.add_(1.0)  # in place
            y.addmm_(a, b)  # an in-place GEMM: not counted by stock FlopCounterMode
            return float(y.sum())  # a host sync

        r = account(fn)
    assert r.flops_stock == 2 * 8 * 16 * 4
    assert r.flops == 2 * (2 * 8 * 16 * 4)
    assert r.materialised_bytes == 8 * 4 * 4 + 4  # mm output + the sum scalar
    assert r.calls == 6 and r.ops["aten.new_empty.default"].bytes == 0
    assert r.inplace_bytes == 2 * 8 * 4 * 4
    assert len(r.syncs) == 1 and "_local_scalar_dense" in r.syncs[0]


def test_analytic_processor_flops_official_size():
    flops = processor_flops(1408, 40, 5632, 6, 32 * 32)
    assert abs(flops / 1e12 - 15.07) < 0.01


@pytest.mark.parametrize("frames, grid", [(3, (4, 6, 1)), (1, (8, 1, 1))])
def test_analytic_processor_flops_match_flop_counter(frames, grid):
    """Exact match with FlopCounterMode on the reference blocks with the math kernel: every
    GEMM and attention matmul is counted, nothing else is."""
    model = tiny(temporal_kernel="math", spatial_kernel="math")
    b, s = 2, grid[0] * grid[1] * grid[2]
    z = torch.randn(b, frames, s, model.dim)
    rope = model.rope.tables(grid, z.device, z.dtype)
    with FlopCounterMode(display=False) as counter:
        run_processor(model.blocks, z, [rope] * model.depth, fused=False)
    expected = b * processor_flops(model.dim, model.depth, model.mlp_dim, frames, s)
    assert counter.get_total_flops() == expected


def test_estimate_mfu():
    assert estimate_mfu(3e12, 0.5, 12e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="seconds"):
        estimate_mfu(1e9, 0.0, 1e12)
    with pytest.raises(ValueError, match="tokens=0"):
        processor_flops(32, 2, 64, 3, 0)


def test_scale_script_runs_on_the_tiny_preset(tmp_path):
    from benchmarks.scale import load_preset, main, previous_writers

    argv = ["--preset", "tiny", "--grid", "32", "32", "--batches", "1", "--frames", "2"]
    rows = main(argv + ["--results-dir", str(tmp_path)])["rows"]
    assert (tmp_path / "scale.json").is_file()
    fused, plain = rows
    assert fused["fused"] and not plain["fused"] and fused["syncs"] == 0
    assert fused["GB"] < plain["GB"] and fused["calls"] < plain["calls"]
    first = json.loads((tmp_path / "scale.json").read_text())
    assert first["previous"] is None  # no earlier file
    for run in first["runs"]:  # the ten largest writers, from the per-op totals
        gb = [w["written_GB"] for w in run["top_writers"]]
        totals = sorted((v["bytes"] + v["inplace_bytes"]) / 1e9 for v in run["ops"].values())
        assert len(gb) == 10 and gb == pytest.approx(totals[::-1][:10])
    run = first["runs"][0]
    split = first["call_breakdown"]["fused=True"]  # one block + the rest = the whole forward
    depth = load_preset("tiny")["depth"]
    whole = split["per_block_GB"] * depth + split["outside_GB"]
    assert whole == pytest.approx(run["written_GB"]) and split["per_block_token_matrices"] > 10
    # a second run would keep this file's largest writers as its "before" listing
    same = argparse.Namespace(preset="tiny", grid=[32, 32], frames=2)
    previous = previous_writers(tmp_path / "scale.json", same, 1)
    assert previous["top_writers"] == run["top_writers"]
    assert previous["written_GB"] == run["written_GB"] and previous["B"] == 1
    other = argparse.Namespace(preset="tiny", grid=[32, 32], frames=3)
    assert previous_writers(tmp_path / "scale.json", other, 1) is None  # not comparable


_NO_CXX = not any(shutil.which(c) for c in ("g++", "c++", "clang++"))
needs_cxx = pytest.mark.skipif(_NO_CXX, reason="inductor on CPU needs a C++ compiler (none found)")


def test_compile_modes():
    assert [compile_mode(v) for v in (False, None, True, "blocks", "Model", "false")] == [
        "false",
        "false",
        "blocks",
        "blocks",
        "model",
        "false",
    ]
    with pytest.raises(ValueError, match="module.compile must be false, blocks or model"):
        compile_mode("fast", "module.compile")
    model = tiny()
    keys = list(model.state_dict())
    assert compile_model(model, "model") == "model"
    assert model._compiled_call_impl is not None and list(model.state_dict()) == keys


@pytest.mark.slow  # ~40 s of compilation; .ci/run runs it after `make test`
@needs_cxx
def test_whole_model_compile_matches_eager_inference():
    # inference took the in-place workspace path, which inductor mis-handled across graph breaks
    model = tiny().eval()
    x, fields = torch.randn(2, 3, 2, 32, 32), torch.tensor([0, 3])
    with torch.no_grad():
        ref = model(x, fields, BCS)
        compile_model(model, "model")
        y = model(x, fields, BCS)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # ~20 s of compilation
@needs_cxx
def test_block_compile_compiles_one_graph_for_every_block():
    # filling the derived-weight and bucket caches inside the compiled region changed globals
    # the guards watch: one recompile per block, then one more on the next step
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = tiny().train()
    compiled = copy.deepcopy(eager)
    assert len(compiled.blocks) >= 2
    compile_model(compiled, "blocks")
    x, fields = torch.randn(2, 3, 2, 32, 32), torch.tensor([0, 3])
    for seed in range(2):
        outs = [m(x, fields, BCS, jitter_seed=seed) for m in (eager, compiled)]
        for y in outs:
            y.square().mean().backward()
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)
            p.grad = q.grad = None
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
@needs_cxx
def test_whole_model_compile_matches_eager_training():
    eager = tiny().train()
    compiled = copy.deepcopy(eager)
    compile_model(compiled, "model")
    x, fields = torch.randn(2, 3, 2, 32, 32), torch.tensor([0, 3])
    for seed in range(2):  # a new jitter draw recompiles
        outs = [m(x, fields, BCS, jitter_seed=seed) for m in (eager, compiled)]
        for y in outs:
            y.square().mean().backward()
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
        scale = max(p.grad.abs().max() for p in eager.parameters() if p.grad is not None)
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:  # relative to the largest gradient (some are exactly ~0)
                assert (p.grad - q.grad).abs().max() <= 1e-4 * scale, name
            p.grad = q.grad = None


def test_gemm_rate_floor_records_the_steps_gemms_forward_and_backward():
    from benchmarks.kernels import (
        KernelReplay,
        TensorSpec,
        call_flops,
        floor_summary,
        op_breakdown,
        step_gemms,
    )

    model = tiny().train()
    x, fields = torch.randn(2, 3, 2, 32, 32), torch.tensor([0, 3])

    def forward() -> torch.Tensor:
        return model(x, fields, BCS, jitter_seed=0)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        forward().abs().mean().backward()

    calls = step_gemms(step)
    n_forward = len(step_gemms(forward))
    assert n_forward > 0 and len(calls) > n_forward  # the backward's GEMMs are recorded too
    # the same GEMMs, and FLOPs, as the profiler sees in one step
    assert sum(call_flops(f, a) for f, a, _ in calls) == op_breakdown(step)["gemm_flops"]
    specs = [a for _, args, _ in calls for a in args if isinstance(a, TensorSpec)]
    transposed = [s for s in specs if len(s.size) >= 2 and s.stride[-2:] == (1, s.size[-2])]
    assert transposed  # backward GEMMs read transposed operands; the layout is kept
    floor = KernelReplay(calls)
    assert floor.flops == sum(call_flops(f, a) for f, a, _ in calls)
    for (func, args, _), (rfunc, rargs, _) in zip(calls, floor.calls, strict=True):
        assert rfunc is func
        for spec, t in zip(args, rargs, strict=True):
            if isinstance(spec, TensorSpec):
                assert (tuple(t.shape), t.stride(), t.dtype) == (spec.size, spec.stride, spec.dtype)
    floor()
    summary = floor_summary(calls)
    assert sum(e["count"] for e in summary) == len(calls)
    assert sum(e["count"] * e["flops"] for e in summary) == floor.flops


def test_gemm_rate_kernel_replay_covers_every_kind_of_kernel():
    from benchmarks.kernels import KERNEL_KINDS, KernelReplay, kernel_kind, step_kernels

    assert [
        kernel_kind(n)
        for n in (
            "aten::addmm",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
            "aten::native_layer_norm_backward",
            "aten::linalg_vector_norm",
            "aten::silu_backward",
            "aten::silu_",
            "aten::stack",
            "aten::mul",
        )
    ] == ["gemm", "attention", "norm", "norm", "activation", "activation", "copy", "other"]
    model = tiny().train()
    x, fields = torch.randn(2, 3, 2, 32, 32), torch.tensor([0, 3])

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x, fields, BCS, jitter_seed=0).abs().mean().backward()

    kernels = step_kernels(step)
    assert set(kernels) == set(KERNEL_KINDS)
    assert all(kernels[k] for k in ("gemm", "norm", "activation", "copy", "other"))
    names = {str(f) for calls in kernels.values() for f, _, _ in calls}
    assert "aten.native_layer_norm_backward.default" in names  # the backward is recorded
    assert not any(f.is_view for calls in kernels.values() for f, _, _ in calls)
    for kind, calls in kernels.items():
        replay = KernelReplay(calls)
        replay()  # every recorded call replays on fresh tensors of its layout
        assert (replay.flops > 0) == (kind == "gemm")


def test_gemm_rate_kernel_split_and_tables(tmp_path, monkeypatch):
    import benchmarks.gemm_rate as gr
    import benchmarks.gemm_rate_tables as tables

    rounds = [
        {
            "round": i,
            "load1": 0.5,
            "small_ms": step,
            "small_floor_ms": 50.0,
            "small_attention_alone_ms": 5.0,
            "small_norm_alone_ms": 8.0,
            "small_activation_alone_ms": 2.0,
            "small_copy_alone_ms": 10.0,
            "small_other_alone_ms": 15.0,
            "small_over_floor": step / 50.0,
            "small_floor_fraction": 0.6,
        }
        for i, step in enumerate((100.0, 120.0, 100.0))
    ]
    split = gr.kernel_split(rounds, {"gemm": 10, "norm": 4})
    assert split["kernels_ms"] == 90.0 and split["overhead_ms"] == 10.0  # median step 100
    assert split["required_over_floor"] == pytest.approx((50 + 5 + 8 + 2) / 50)
    shares = {r["kind"]: r["of_step"] for r in split["table"]}
    assert shares["gemm"] == 0.5 and shares["overhead"] == pytest.approx(0.1)
    assert sum(shares.values()) == pytest.approx(1.0)
    median = {k: rounds[0][k] for k in rounds[0] if k != "round"}
    median["small_non_gemm_share"] = 0.5
    data = {
        "environment": {"time": "2026-12-05T09:00:00+00:00"},
        "median": median,
        "rounds": rounds,
        "floor": {"kernels": split},
    }
    (tmp_path / "gemm_rate.json").write_text(json.dumps(data))
    page = tmp_path / "performance.md"
    page.write_text(
        "a\n<!-- gemm-floor:start -->\nold\n<!-- gemm-floor:end -->\n"
        "<!-- step-kernels:start -->\n<!-- step-kernels:end -->\n"
        "<!-- step-compile:start -->\nkept\n<!-- step-compile:end -->\n"
    )
    monkeypatch.setattr(tables, "PAGE", page)
    assert tables.write_tables(tmp_path) == page
    text = page.read_text()
    assert "old" not in text and "**2.00×** (rounds 2.00–2.40" in text
    assert "| overhead |  | 10.0 ms | 10% |" in text and "**1.30× the floor**" in text
    assert "kept" in text  # no gemm_rate_compile.json: that table is left alone
    with pytest.raises(FileNotFoundError, match="no gemm_rate.json"):
        tables.write_tables(tmp_path / "empty")
    labels = [
        tables.policy_label(env)
        for env in (
            {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": None},
            {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "10000"},
            {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None},
        )
    ]
    assert [label.split()[0] for label in labels] == ["passive", "short", "spinning"]


def test_gemm_rate_compile_break_even():
    from benchmarks.gemm_rate import compile_facts

    warm = {"mode": "model", "warmup_steps": 3, "warmup_s": [30.0, 10.0, 0.5]}
    rows = [
        {"small_ms": 200.0, "small_compiled_ms": 150.0},
        {"small_ms": 400.0, "small_compiled_ms": 340.0},  # a busy round: pairs, not columns
        {"small_ms": 210.0, "small_compiled_ms": 170.0},
    ]
    facts = compile_facts(warm, rows, run_steps=600)
    assert facts["compile_s"] == pytest.approx(39.0)  # 40.5 s less 3 steady 0.5 s steps
    assert facts["gain_ms_per_step"] == pytest.approx(50.0)  # median of 50, 60, 40
    assert facts["break_even_steps"] == 780  # 39 s / 0.05 s per step
    assert facts["run_s"]["compiled"] > facts["run_s"]["eager"]
    slower = compile_facts(warm, [{"small_ms": 200.0, "small_compiled_ms": 210.0}])
    assert slower["break_even_steps"] is None


def test_gemm_rate_op_breakdown_counts_gemm_flops_exactly():
    from benchmarks.kernels import gemm_flops, op_breakdown, op_kind

    a, b = torch.randn(8, 16), torch.randn(16, 4)
    x, y, c = torch.randn(3, 5, 6), torch.randn(3, 6, 7), torch.randn(3, 5, 7)

    def work() -> None:
        torch.mm(a, b)  # 2*8*16*4 = 1024
        torch.addmm(torch.zeros(4), a, b)  # 1024
        torch.baddbmm(c, x, y)  # 2*3*5*6*7 = 1260
        torch.cat([a, a]).mul(2.0)

    parts = op_breakdown(work)
    assert parts["gemm_flops"] == 1024 + 1024 + 1260
    assert set(parts["seconds"]) == {"gemm", "attention", "copy", "other"}
    assert math.isclose(parts["total_s"], sum(parts["seconds"].values()))
    assert parts["seconds"]["gemm"] > 0 and parts["seconds"]["copy"] > 0
    assert gemm_flops("aten::bmm", [[2, 3, 4], [2, 4, 5]]) == 2 * 2 * 3 * 4 * 5
    assert gemm_flops("aten::addmm_", [[3, 5], [3, 4], [4, 5]]) == 2 * 3 * 4 * 5
    assert gemm_flops("aten::mm", [[], []]) == 0
    assert [op_kind(n) for n in ("aten::addmm_", "aten::cat", "aten::silu")] == [
        "gemm",
        "copy",
        "other",
    ]
    assert op_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
