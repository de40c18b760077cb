"""RMS group norm: the fused-backward path against the plain composite it replaces."""

from __future__ import annotations

import pytest
import torch

from walrus.nn.norms import RMSGroupNorm, rms_group_normalize


def composite(x: torch.Tensor, w: torch.Tensor | None, dims: tuple[int, ...], eps: float):
    """``x * rsqrt(mean(x^2 over dims) + eps) * w`` in plain autograd ops."""
    count = 1
    for d in dims:
        count *= x.shape[d]
    inv = torch.rsqrt(x.square().sum(dims, keepdim=True) / count + eps)
    return x * inv if w is None else x * inv * w


def grads(fn, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Output and the gradients of a fixed random projection of it."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype))
    return [y.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("weighted", [True, False])
def test_rms_group_normalize_gradients_match_the_composite(weighted):
    x = torch.randn(6, 16, 24) * 3  # (N, S, C), 4 groups of 6
    w = 1 + 0.5 * torch.randn(24)

    def fused(x, w):
        return rms_group_normalize(x, 4, 1e-6, torch.float32, w if weighted else None)

    def plain(x, w):
        y = composite(x.view(6, 16, 4, 6), w.view(4, 6) if weighted else None, (1, 3), 1e-6)
        return y.reshape(-1, 24)

    for got, want in zip(grads(fused, x, w), grads(plain, x, w), strict=True):
        if want is None:  # unweighted: w gets no gradient from either
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [3, 12])  # 12: one channel per group (official profiles)
@pytest.mark.parametrize("channels_last", [True, False])
def test_rms_group_norm_module_gradients_match_the_composite(channels_last, groups):
    norm = RMSGroupNorm(12, groups, eps=1e-6, channels_last=channels_last)
    cg = 12 // groups
    with torch.no_grad():
        norm.weight.add_(0.5 * torch.randn(12))
    x = torch.randn(2, 5, 7, 12) if channels_last else torch.randn(2, 12, 5, 7)
    y = norm(x.requires_grad_())
    y.backward(torch.ones_like(y) + x.detach())
    if channels_last:  # (2, 5, 7, G, Cg): statistic over the 7 positions and Cg channels
        ref = composite(x.unflatten(-1, (groups, cg)), norm.weight.view(groups, cg), (-3, -1), 1e-6)
    else:  # (2, G, Cg, 35)
        w = norm.weight.view(groups, cg, 1)
        ref = composite(x.reshape(2, groups, cg, 35), w, (2, 3), 1e-6)
    want = torch.autograd.grad(ref.reshape(x.shape), (x, norm.weight), torch.ones_like(y) + x)
    torch.testing.assert_close(y, ref.reshape(x.shape), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm.weight.grad, want[1], rtol=1e-5, atol=1e-5)


def test_rms_fused_backward_passes_gradcheck_in_float64():
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.3 * torch.randn(8, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x, w: rms_group_normalize(x, 2, 1e-3, x.dtype, w), (x, w)
    )
    norm = RMSGroupNorm(8, 2, eps=1e-3, channels_last=False).double()
    assert torch.autograd.gradcheck(
        norm, (torch.randn(2, 8, 3, dtype=torch.float64).requires_grad_(),)
    )
