"""Optimiser parameter groups and the warmup + cosine schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from walrus.training.optim import WarmupCosine, param_groups


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.field_embed = nn.Parameter(torch.zeros(3, 4))
        self.gamma = nn.Parameter(torch.ones(4))
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_no_weight_decay_on_norms_biases_embeddings_and_gains():
    net = _Net()
    decay, no_decay = param_groups(net, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [id(p) for p in decay["params"]] == [id(net.proj.weight)]
    expected = {
        id(p) for p in (net.proj.bias, net.norm.weight, net.norm.bias, net.field_embed, net.gamma)
    }
    assert {id(p) for p in no_decay["params"]} == expected


def test_warmup_then_cosine():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = WarmupCosine(opt, total_steps=100, warmup_steps=10, min_ratio=0.1, warmup_start=0.0)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(1.0) and lrs[10] == pytest.approx(2.0)
    mid = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90))
    assert lrs[55] == pytest.approx(2.0 * mid)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert sched.factor(100) == pytest.approx(0.1)


def test_fractional_warmup_and_bad_total():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    assert WarmupCosine(opt, total_steps=200, warmup_steps=0.05).warmup_steps == 10
    with pytest.raises(ValueError, match="total_steps"):
        WarmupCosine(opt, total_steps=0)
