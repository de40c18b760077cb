"""DDP without unused parameters: every parameter gets a gradient, a 2-process gloo run trains,
and the model holds (and grows) only the encoder/decoder sets its data needs. Sharded training
(FSDP2, ``trainer=fsdp_cpu``) matches unsharded training, and its checkpoints are plain walrus
checkpoints that resume under either strategy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

from tests.conftest import REPO, tiny_train_overrides
from walrus.bcs import BoundaryType
from walrus.checkpoint import load_checkpoint_file, load_model, model_state_dict
from walrus.model.walrus import Walrus

TINY = dict(n_fields=8, dim=32, depth=2, heads=4, projection_dim=8, intermediate_dim=16, groups=4)


def _grads_missing(model: Walrus, x: torch.Tensor, bc: int) -> list[str]:
    model.zero_grad(set_to_none=True)
    fields = torch.tensor([3, 4])
    bcs = torch.full((x.ndim - 3, 2), bc)
    model(x, fields, bcs).square().mean().backward()
    return [n for n, p in model.named_parameters() if p.grad is None]


@pytest.mark.parametrize("compat", [None, "walrus_current"])
@pytest.mark.parametrize("bc", [BoundaryType.PERIODIC, BoundaryType.WALL, BoundaryType.OPEN])
@pytest.mark.parametrize("shape", [(32, 32), (16, 16, 16)])
def test_every_parameter_gets_a_gradient(compat, bc, shape):
    """Whatever the batch's dimensionality and boundaries, no parameter is left without a
    gradient (what ``find_unused_parameters: false`` needs)."""
    torch.manual_seed(0)
    model = Walrus(**TINY, include_d=(1, 2, 3), compat=compat).train()
    x = torch.randn(1, 2, 2, *shape)
    assert _grads_missing(model, x, int(bc)) == []


def test_unused_sets_get_zero_gradients_and_eval_output_is_unchanged():
    torch.manual_seed(0)
    model = Walrus(**TINY, include_d=(2, 3)).train()
    x = torch.randn(1, 2, 2, 32, 32)
    _grads_missing(model, x, int(BoundaryType.PERIODIC))
    assert all(p.grad.abs().max() == 0 for p in model.embed["3"].parameters())
    assert all(p.grad.abs().max() == 0 for p in model.debed["3"].parameters())
    assert model.patch_jitterer.padding_tokens.grad.abs().max() == 0
    assert any(p.grad.abs().max() > 0 for p in model.embed["2"].parameters())


def test_grow_dims_adds_only_unserved_sets_and_keeps_outputs():
    torch.manual_seed(0)
    model = Walrus(**TINY, include_d=(2,)).eval()
    x = torch.randn(1, 2, 2, 32, 32)
    fields, bcs = torch.tensor([3, 4]), [[2, 2], [2, 2]]
    before = model(x, fields, bcs)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.grow_dims([1, 2]) == []  # 1-D data is served by the 2-D set
    assert model.grow_dims([2, 3]) == [3]
    assert model.include_d == (2, 3) and model.config.include_d == (2, 3)
    assert torch.equal(model(x, fields, bcs), before)
    new = model.state_dict()
    assert all(torch.equal(new[k], v) for k, v in old.items())
    assert any(k.startswith("embed.3.") for k in new) and any(k.startswith("debed.3.") for k in new)
    y = model(torch.randn(1, 2, 2, 16, 16, 16), fields, [[2, 2]] * 3)
    assert y.shape == (1, 2, 2, 16, 16, 16) and torch.isfinite(y).all()
    rebuilt = Walrus(model.config)
    rebuilt.load_state_dict(new)  # the grown config describes the grown weights


def test_model_without_a_set_for_the_data_says_so():
    model = Walrus(**TINY, include_d=(2,))
    with pytest.raises(ValueError, match=r"no encoder for 3-D data: include_d is \(2,\)"):
        model(torch.randn(1, 2, 2, 16, 16, 16), torch.tensor([3, 4]), [[2, 2]] * 3)
    with pytest.raises(ValueError, match="grow_dims"):
        Walrus(**TINY, include_d=(2,), n_spatial_max=2).grow_dims([3])


def test_fresh_run_holds_only_the_data_dimensionality(compose_cfg, tiny_data_root, tmp_path):
    """A fresh run builds one encoder/decoder set per data dimensionality (here 2-D only)."""
    from walrus.training.train import train

    cfg = compose_cfg("train", tiny_train_overrides(tiny_data_root, tmp_path))
    _, objects = train(cfg)
    model = objects["module"].model
    assert model.include_d == (2,) and list(model.embed) == ["2"] and list(model.debed) == ["2"]
    ckpt = load_checkpoint_file(tmp_path / "checkpoints" / "last.ckpt")
    assert ckpt["walrus"]["model_config"]["include_d"] == [2]


@pytest.mark.slow  # .ci/run runs it after make test
def test_ddp_two_gloo_processes_without_unused_parameter_search(tiny_data_root, tmp_path):
    """``trainer=ddp`` (find_unused_parameters: false) trains with 2 CPU processes."""
    overrides = [
        o for o in tiny_train_overrides(tiny_data_root, tmp_path) if not o.startswith("trainer=")
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            *overrides,
            "trainer=ddp",
            "trainer.accelerator=cpu",
            "trainer.limit_train_batches=3",
            "trainer.max_epochs=2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = load_checkpoint_file(tmp_path / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 6  # 3 batches per rank and epoch, 2 epochs
    assert all(torch.isfinite(v).all() for v in model_state_dict(ckpt).values())


def test_fsdp_single_process_matches_unsharded_training(compose_cfg, tiny_data_root, tmp_path):
    """``trainer=fsdp_cpu`` with one process runs the whole sharded path in-process:
    ``configure_model`` shards every processor block and the model, the run trains and
    validates like an unsharded one, and ``last.ckpt`` is a plain walrus checkpoint."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from walrus.training.train import train

    def run(name: str, trainer: str):
        overrides = [*tiny_train_overrides(tiny_data_root, tmp_path / name), "trainer.devices=1"]
        cfg = compose_cfg("train", [*overrides, f"trainer={trainer}", "trainer.accelerator=cpu"])
        with mock.patch.dict(os.environ):  # drop MASTER_PORT, LOCAL_RANK etc. afterwards
            try:
                return train(cfg)
            finally:
                if torch.distributed.is_initialized():
                    torch.distributed.destroy_process_group()

    # the reference is DDP on one process: both strategies reseed their processes the same way
    plain_metrics, _ = run("plain", "ddp")
    metrics, objects = run("fsdp", "fsdp_cpu")
    model = objects["module"].model
    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.blocks)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert not model.fused  # the fused paths read weights outside a block's forward
    for key in ("train/loss", "val/loss", "val/rollout_vrmse"):
        assert metrics[key] == pytest.approx(plain_metrics[key], rel=1e-4), key
    plain = model_state_dict(load_checkpoint_file(tmp_path / "plain" / "checkpoints" / "last.ckpt"))
    path = tmp_path / "fsdp" / "checkpoints" / "last.ckpt"
    assert load_checkpoint_file(path)["walrus"]["checksums"]
    loaded, _ = load_model(path)
    assert loaded.config.fused and _max_diff(loaded.state_dict(), plain) < 1e-5


def test_sharding_refuses_tensor_parallelism():
    from types import SimpleNamespace

    from walrus.training.sharding import shard_model

    class Mesh:
        mesh_dim_names = ("data_parallel", "tensor_parallel")

        def __getitem__(self, name):
            return SimpleNamespace(size=lambda: 2)

    with pytest.raises(ValueError, match="no tensor parallelism.*tensor_parallel=2"):
        shard_model(Walrus(**TINY, include_d=(2,)), Mesh())


def _two_process_run(data_root, out_dir, *overrides: str) -> dict[str, torch.Tensor]:
    """``train.py`` with 2 CPU processes; the model weights of the run's ``last.ckpt``."""
    base = [o for o in tiny_train_overrides(data_root, out_dir) if not o.startswith("trainer=")]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            *base,
            f"hydra.run.dir={out_dir}",  # Hydra's own files too, not under the repository
            "trainer.accelerator=cpu",
            "lr_scheduler=constant",  # a resumed run's schedule does not depend on its length
            "data.max_val_windows=8",  # every rank validates
            *overrides,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return model_state_dict(load_checkpoint_file(out_dir / "checkpoints" / "last.ckpt"))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow  # ~35-80 s; .ci/run runs it after `make test`
def test_fsdp_two_gloo_processes_match_ddp_and_resume_under_either(tiny_data_root, tmp_path):
    """``trainer=fsdp_cpu`` (FSDP2, 2 gloo processes), stopped after 2 steps and resumed to 4,
    ends where an uninterrupted 4-step DDP run ends, and so does a DDP run resumed from the
    sharded run's checkpoint: that checkpoint is one plain walrus file."""
    ddp = _two_process_run(tiny_data_root, tmp_path / "ddp", "trainer=ddp", "trainer.max_epochs=2")
    first = tmp_path / "fsdp" / "checkpoints" / "last.ckpt"
    _two_process_run(tiny_data_root, tmp_path / "fsdp", "trainer=fsdp_cpu")
    ckpt = load_checkpoint_file(first)  # verifies every tensor's checksum
    assert ckpt["global_step"] == 2 and ckpt["walrus"]["checksums"]
    model, _ = load_model(first)
    adam = ckpt["optimizer_states"][0]["state"].values()  # gathered: whole tensors, not shards
    assert sorted(tuple(s["exp_avg"].shape) for s in adam) == sorted(
        tuple(p.shape) for p in model.parameters()
    )
    assert model.config.fused  # sharding switches the fast paths off, the config keeps them
    resumed = {
        strategy: _two_process_run(
            tiny_data_root,
            tmp_path / f"resume_{strategy}",
            f"trainer={strategy}",
            "trainer.max_epochs=2",
            f"ckpt_path={first}",
        )
        for strategy in ("fsdp_cpu", "ddp")
    }
    assert _max_diff(resumed["fsdp_cpu"], resumed["ddp"]) < 1e-6
    # an interrupted-and-resumed run lands where the uninterrupted one does (a step's lr is 1e-3)
    assert _max_diff(resumed["fsdp_cpu"], ddp) < 5e-5
    metrics = json.loads((tmp_path / "resume_fsdp_cpu" / "metrics.json").read_text())
    reference = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    assert metrics["val/rollout_vrmse"] == pytest.approx(reference["val/rollout_vrmse"], rel=1e-4)


@pytest.mark.slow  # two train.py runs, one of 2 processes: ~30-60 s
def test_ddp_validation_metrics_cover_the_whole_validation_set(tiny_data_root, tmp_path):
    """2 gloo processes log the validation metrics of one process: each rank's sums and counts
    are added over the ranks, and the repeat that evens out an odd number of batches (3 here)
    counts nothing. With lr 0 the weights stay the same, so every val/ metric must agree."""
    common = [
        "optimizer.lr=0.0",
        "data.max_val_windows=5",  # 3 batches of 2: rank 1 gets a repeat of the first
        "trainer.limit_val_batches=null",
        "trainer.max_epochs=1",
    ]
    _run_train(tiny_data_root, tmp_path / "one", *common)
    ddp = _run_train(
        tiny_data_root, tmp_path / "two", *common, "trainer=ddp", "trainer.accelerator=cpu"
    )
    assert "sync_dist" not in ddp.stderr
    one = json.loads((tmp_path / "one" / "metrics.json").read_text())
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    val = sorted(k for k in one if k.startswith("val/"))
    assert "val/vrmse_persistence" in val and len(val) >= 5
    assert sorted(k for k in two if k.startswith("val/")) == val
    for key in val:
        assert two[key] == pytest.approx(one[key], rel=1e-6), key


def _run_train(data_root, out_dir, *overrides: str) -> subprocess.CompletedProcess:
    base = [o for o in tiny_train_overrides(data_root, out_dir) if not o.startswith("trainer=")]
    if not any(o.startswith("trainer=") for o in overrides):
        base.append("trainer=cpu")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "train.py", *base, f"hydra.run.dir={out_dir}", *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow  # a 2-process train.py run: ~20-40 s
def test_ctrl_c_on_two_ddp_ranks_saves_and_exits_130(tiny_data_root, tmp_path):
    """Ctrl-C in a terminal sends SIGINT to every process of the group: both gloo ranks stop
    after the same step, last.ckpt is saved there, and train.py exits 130 with the resume line."""
    import signal

    from benchmarks.fault_injection import _wait_for_step

    base = [
        o for o in tiny_train_overrides(tiny_data_root, tmp_path) if not o.startswith("trainer=")
    ]
    last = tmp_path / "checkpoints" / "last.ckpt"
    proc = subprocess.Popen(
        [
            sys.executable, "train.py", *base, f"hydra.run.dir={tmp_path}", "trainer=ddp",
            "trainer.accelerator=cpu", "trainer.limit_train_batches=6", "trainer.max_epochs=3",
            "callbacks.last_checkpoint.every_n_steps=1",
        ],
        cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    seen = _wait_for_step(last, proc, 1)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert seen >= 1 and "Ctrl-C (SIGINT) at step" in err and f"ckpt_path={last}" in err
    saved = load_checkpoint_file(last)["global_step"]
    assert seen <= saved < 12  # stopped after the signal, not at the end (12 steps)
    assert "Traceback" not in err
