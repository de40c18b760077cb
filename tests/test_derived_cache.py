"""The fused blocks' inference caches of derived weights follow the weights, also after an
optimiser that updates them without bumping their version counters (fused AdamW)."""

from __future__ import annotations

import copy

import torch

from walrus.model.fast_blocks import _CACHES, clear_derived
from walrus.model.walrus import Walrus
from walrus.training.module import WalrusModule


def _model() -> Walrus:
    torch.manual_seed(0)
    return Walrus(4, 32, 2, 4, projection_dim=8, intermediate_dim=16, groups=4, jitter=False)


def _eval_out(model: Walrus, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x, torch.tensor([0, 1]), [[2, 2], [2, 2]])


def test_clear_derived_after_a_fused_optimiser_step():
    model, x = _model(), torch.randn(1, 3, 2, 16, 16)
    _eval_out(model, x)  # fills the caches
    assert any(m in _CACHES for m in model.modules())
    model.train()
    model(x, torch.tensor([0, 1]), [[2, 2], [2, 2]]).square().mean().backward()
    versions = [p._version for p in model.parameters()]
    torch.optim.AdamW(model.parameters(), lr=0.1, fused=True).step()
    # the hazard: the weights moved, their versions did not
    assert [p._version for p in model.parameters()] == versions
    fresh = _eval_out(copy.deepcopy(model), x)  # a copy starts with no caches
    assert not torch.allclose(_eval_out(model, x), fresh, atol=1e-4)  # stale caches
    clear_derived(model)
    assert not any(m in _CACHES for m in model.modules())
    torch.testing.assert_close(_eval_out(model, x), fresh)


def test_validation_start_clears_the_caches():
    model, x = _model(), torch.randn(1, 3, 2, 16, 16)
    module = WalrusModule(model, optimizer=torch.optim.AdamW)
    _eval_out(model, x)
    assert any(m in _CACHES for m in model.modules())
    module.on_validation_start()
    assert not any(m in _CACHES for m in model.modules())
