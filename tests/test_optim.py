"""Optimiser parameter groups and the warmup + cosine schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from walrus.training.optim import WarmupCosine, check_lr_scales, param_groups, scale_group_lrs


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


def test_lr_scales_give_a_part_its_own_rate_through_the_schedule():
    net = _Net()
    plain = param_groups(net, weight_decay=0.1)
    assert [g["lr_scale"] for g in plain] == [1.0, 1.0]  # the groups of earlier checkpoints
    groups = param_groups(net, weight_decay=0.1, lr_scales={"proj": 0.25})
    by_id = {id(p): (g["lr_scale"], g["weight_decay"]) for g in groups for p in g["params"]}
    assert by_id[id(net.proj.weight)] == (0.25, 0.1) and by_id[id(net.proj.bias)] == (0.25, 0.0)
    assert by_id[id(net.norm.weight)] == (1.0, 0.0) and id(net.frozen.weight) not in by_id
    assert groups[0]["lr_scale"] == 1.0 and groups[0]["weight_decay"] == 0.1  # kept, now empty
    opt = scale_group_lrs(torch.optim.AdamW(groups, lr=2.0))
    sched = WarmupCosine(opt, total_steps=10, warmup_steps=0, min_ratio=0.5)
    for _ in range(10):
        opt.step()
        sched.step()
    rates = {g["lr_scale"]: g["lr"] for g in opt.param_groups}
    assert rates[1.0] == pytest.approx(1.0) and rates[0.25] == pytest.approx(0.25)


@pytest.mark.parametrize(
    "scales, message",
    [
        ({"blocks": 0.3}, "module.lr_scales: 'blocks' is not a part of the model; its parts: proj"),
        ({"proj": 0}, "module.lr_scales.proj must be a number > 0"),
        ({"proj": "fast"}, "module.lr_scales.proj must be a number > 0"),
        ({"proj": float("inf")}, "module.lr_scales.proj must be finite"),
    ],
)
def test_lr_scales_are_checked(scales, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_lr_scales(_Net(), scales)


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


def test_time_budget_drives_the_schedule_to_its_floor():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    used = [0.0]
    sched = WarmupCosine(
        opt, total_steps=1000, warmup_steps=0.1, min_ratio=0.05, time_fraction=lambda: used[0]
    )
    used[0] = 0.05  # halfway through warmup by time, though only step 1 of 1000
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 + 0.99 * 0.5)
    used[0] = 0.55  # halfway through the cosine
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 + 0.95 * 0.5)
    used[0] = 1.0
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    # the budget's callable is not saved with the scheduler (checkpoints load weights-only)
    state = sched.state_dict()
    assert "time_fraction" not in state
    fresh = WarmupCosine(opt, total_steps=1000, time_fraction=lambda: 1.0)
    fresh.load_state_dict(state)
    assert fresh.time_fraction() == 1.0 and fresh.last_epoch == 3


def test_time_only_run_needs_a_fractional_warmup():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = WarmupCosine(opt, total_steps=None, warmup_steps=0.0, time_fraction=lambda: 0.5)
    assert sched.factor(10**6) == pytest.approx(0.01 + 0.99 * 0.5)
    with pytest.raises(ValueError, match="warmup_steps must be a fraction"):
        WarmupCosine(opt, total_steps=None, warmup_steps=100, time_fraction=lambda: 0.0)
    with pytest.raises(ValueError, match="max_time"):
        WarmupCosine(opt, total_steps=None)


def test_time_budget_fraction_is_rank_zeros_measure():
    """Every rank uses rank 0's measure, so distributed ranks share the lr and the stop step."""
    from types import SimpleNamespace

    from walrus.training.budget import TimeBudget

    now = [0.0]
    budget = TimeBudget(100, clock=lambda: now[0])
    budget.on_fit_start(None, None)
    rank0 = SimpleNamespace(broadcast=lambda value: 0.25)  # what rank 0 measured
    trainer = SimpleNamespace(strategy=rank0, global_step=1, should_stop=False)
    now[0] = 60.0  # this rank's clock says 60 % is used
    budget.on_before_optimizer_step(trainer, None, None)
    assert budget.measure() == pytest.approx(0.6)
    assert budget.fraction() == 0.25
    budget.on_train_batch_start(trainer, None, None, 0)
    budget.on_train_batch_end(trainer, None, None, None, 0)
    assert not trainer.should_stop  # rank 0 has time left
    trainer.strategy = SimpleNamespace(broadcast=lambda value: 1.0)
    budget.on_before_optimizer_step(trainer, None, None)
    budget.on_train_batch_end(trainer, None, None, None, 0)
    assert trainer.should_stop and budget.fraction() == 1.0


def test_the_schedule_follows_the_budget_that_is_furthest_along():
    from functools import partial
    from types import SimpleNamespace

    from walrus.training.budget import BudgetCallback
    from walrus.training.module import WalrusModule

    class Share(BudgetCallback):
        def __init__(self, share: float) -> None:
            self.share = share

        def fraction(self) -> float:
            return self.share

    module = WalrusModule(
        nn.Linear(2, 2),
        optimizer=partial(torch.optim.SGD, lr=1.0),
        lr_scheduler=partial(WarmupCosine, warmup_steps=0.0, min_ratio=0.0),
    )
    early, late = Share(0.25), Share(0.5)
    module._trainer = SimpleNamespace(callbacks=[early, late], estimated_stepping_batches=1000)
    sched = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    assert sched.progress(0) == 0.5  # the larger share, far ahead of step 0 of 1000
    late.share = 0.1
    assert sched.progress(0) == 0.25
    assert sched.factor(0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))


def test_module_lr_scales_slow_one_part_and_refuse_unknown_parts():
    from functools import partial
    from types import SimpleNamespace

    from walrus.training.module import WalrusModule

    model = nn.Sequential()
    model.add_module("blocks", nn.Linear(2, 2))
    model.add_module("embed", nn.Linear(2, 2))
    module = WalrusModule(
        model,
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
        lr_scheduler=partial(WarmupCosine, warmup_steps=0.0, min_ratio=0.0),
        lr_scales={"blocks": 0.1},
    )
    module._trainer = SimpleNamespace(callbacks=[], estimated_stepping_batches=10)
    opt = module.configure_optimizers()["optimizer"]
    rate = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert rate[id(model.blocks.weight)] == pytest.approx(1e-4)
    assert rate[id(model.embed.weight)] == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="'processor' is not a part of the model; its parts: "):
        WalrusModule(model, optimizer=partial(torch.optim.AdamW), lr_scales={"processor": 0.1})
