"""Walrus model: fused-linear contiguity guard, vocabulary resize, init, presets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from walrus.bcs import BoundaryType
from walrus.model.blocks import SpatialAttention
from walrus.model.walrus import Walrus

P = int(BoundaryType.PERIODIC)
CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"
GEMM = {torch.ops.aten.addmm.default, torch.ops.aten.mm.default}
BATCHED = {torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default}


class FusedWeightTracer(TorchDispatchMode):
    """Records every ATen op that touches ``weight``'s storage and flags bad uses.

    The fused linear must run as ONE ``addmm`` over a contiguous 2-D token matrix. A ``mm``
    means torch fell back to ``matmul`` (it copies a non-contiguous input first); ``bmm`` /
    ``baddbmm`` means a GEMM batched over a strided view.
    """

    def __init__(self, weight: torch.Tensor, backward: bool = False):
        super().__init__()
        self.backward = backward
        self.ptr = weight.untyped_storage().data_ptr()
        self.problems: list[str] = []
        self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(t.untyped_storage().data_ptr() == self.ptr for t in tensors):
            if func in BATCHED or (func == torch.ops.aten.mm.default and not self.backward):
                self.problems.append(f"{func} on the fused weight")
            elif func in GEMM and any(t.dim() != 2 for t in tensors[-2:]):
                self.problems.append(f"{func} on {[t.dim() for t in tensors[-2:]]}-D operands")
            elif func == torch.ops.aten.addmm.default:
                self.gemms += 1
                mat1 = args[1]
                if mat1.dim() != 2 or not mat1.is_contiguous():
                    self.problems.append(f"addmm input {tuple(mat1.shape)} stride {mat1.stride()}")
        return func(*args, **(kwargs or {}))


def test_guard_catches_a_non_contiguous_input():
    w, b = torch.randn(7, 4), torch.randn(7)
    x = torch.randn(2, 5, 3, 4).transpose(1, 2)  # channels-last view of a channels-first tensor
    with FusedWeightTracer(w) as tracer:
        F.linear(x, w, b)
    assert tracer.problems


@pytest.mark.parametrize("train", [False, True])
def test_fused_linear_is_one_gemm_on_contiguous_tokens(train):
    torch.manual_seed(0)
    model = Walrus(4, 32, 1, 4, projection_dim=8, intermediate_dim=16, groups=4).train(train)
    block = model.blocks[0].space_mixing
    assert isinstance(block, SpatialAttention)
    seen = []
    hook = block.fused_ff_qkv.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].is_contiguous())
    )
    x = torch.randn(2, 3, 4, 32, 32)
    with FusedWeightTracer(block.fused_ff_qkv.weight) as tracer:
        y = model(x, torch.arange(4), [[P, P], [P, P]], jitter_seed=0)
    hook.remove()
    assert not tracer.problems, tracer.problems
    assert tracer.gemms == 1 and seen == [True]
    if train:  # backward: plain 2-D GEMMs (grad input, grad weight), nothing batched
        with FusedWeightTracer(block.fused_ff_qkv.weight, backward=True) as tracer:
            y.sum().backward()
        assert not tracer.problems, tracer.problems
        assert block.fused_ff_qkv.weight.grad is not None


@torch.no_grad()
def test_resize_vocab_keeps_old_fields():
    torch.manual_seed(0)
    model = Walrus(4, 32, 1, 4, projection_dim=8, intermediate_dim=16, groups=4).eval()
    x = torch.randn(1, 2, 2, 32, 32)
    fields, bcs = torch.tensor([3, 1]), [[P, P], [P, P]]
    before = model(x, fields, bcs)
    rows = {k: (d.proj2.weight.clone(), d.proj2.bias.clone()) for k, d in model.debed.items()}
    model.resize_vocab(7)
    assert model.n_fields == 7 and model.space_bag.linear.weight.shape == (8, 7)
    torch.testing.assert_close(model(x, fields, bcs), before, rtol=1e-5, atol=1e-6)
    for k, dec in model.debed.items():
        assert dec.proj2.weight.shape[1] == 7
        assert torch.equal(dec.proj2.weight[:, :4], rows[k][0])
        assert torch.equal(dec.proj2.bias[:4], rows[k][1])
    assert torch.isfinite(model(x, torch.tensor([6, 1]), bcs)).all()
    with pytest.raises(ValueError, match="shrink"):
        model.resize_vocab(5)


def test_residual_outputs_start_small():
    model = Walrus(4, 64, 8, 4, projection_dim=8, intermediate_dim=16, groups=4)
    for blk in model.blocks:
        for lin in (
            blk.time_mixing.output_head,
            blk.space_mixing.attn_out,
            blk.space_mixing.ff_out[1],
        ):
            assert lin.weight.std() < 0.02 / 3
        assert torch.all(blk.time_mixing.gamma == model.layer_scale_init)


@pytest.mark.parametrize("name", ["tiny", "small", "base", "walrus_1b"])
def test_presets(name):
    cfg = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert cfg.pop("_target_") == "walrus.model.walrus.Walrus"
    with torch.device("meta"):
        model = Walrus(**cfg)
    n = model.num_params()
    if name == "walrus_1b":
        assert (model.dim, model.depth, model.heads) == (1408, 40, 16)
        assert 1.25e9 < n < 1.33e9, n
    if name == "tiny":
        x = torch.randn(1, 2, 2, 32, 32)
        y = Walrus(**cfg)(x, torch.tensor([0, 1]), [[P, P], [P, P]])
        assert y.shape == x.shape


def test_layer_norm_in_dtype_casts_the_affine_to_the_input_dtype():
    from walrus.nn.norms import layer_norm_in_dtype

    norm = torch.nn.LayerNorm(8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(4, 8).bfloat16()
    out = layer_norm_in_dtype(x, norm)  # CUDA refuses bf16 x with float32 weights
    assert out.dtype == torch.bfloat16
    ref = torch.nn.functional.layer_norm(
        x, (8,), norm.weight.bfloat16(), norm.bias.bfloat16(), norm.eps
    )
    assert torch.equal(out, ref)
    x32 = x.float()
    assert torch.equal(layer_norm_in_dtype(x32, norm), norm(x32))
