"""The patch encoder/decoder (``encoder="patch"``): conv equivalence, shapes, jitter, vocabulary
and dimensionality growth, checkpoints, FLOP and parameter accounting."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.utils.flop_counter import FlopCounterMode

from walrus.checkpoint import atomic_torch_save, check_config_fits, load_model, with_checksums
from walrus.data.vocab import FieldVocabulary
from walrus.model.config import WalrusConfig
from walrus.model.encoder import CONV, CONV_T, Decoder, Encoder, PatchDecoder, PatchEncoder
from walrus.model.flops import forward_flops, parameter_counts
from walrus.model.walrus import Walrus
from walrus.nn.norms import RMSGroupNorm

MODEL_DIR = Path(__file__).resolve().parent.parent / "configs" / "model"
TINY = dict(projection_dim=8, intermediate_dim=16, groups=4, encoder="patch", kernel_sizes=[4, 2])
PERIODIC, WALL, OPEN = 2, 0, 1


def patch_model(n_fields: int = 5, **kw) -> Walrus:
    torch.manual_seed(0)
    return Walrus(n_fields, 32, 1, 4, **{**TINY, **kw})


def _randomise(module: torch.nn.Module) -> None:
    """Random weights everywhere, norms included (so a mixed-up axis or channel shows)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))


def _norm(norm: RMSGroupNorm) -> RMSGroupNorm:
    """A channels-first copy of a channels-last norm (same weights)."""
    out = RMSGroupNorm(norm.dim, norm.groups, norm.eps, channels_last=False).double()
    out.weight.data.copy_(norm.weight)
    return out


def _squeeze(w: torch.Tensor, active: list[bool]) -> torch.Tensor:
    inactive = [2 + i for i, a in enumerate(active) if not a]
    return w.sum(inactive) if inactive else w


# shapes: d (weights), active axes of the weights, latent grid
CASES = [
    (1, [True], (3,)),
    (2, [True, True], (2, 3)),
    (3, [True, True, True], (2, 1, 3)),
    (3, [True, False, True], (2, 3)),  # 2D data on the 3D set: kernel summed over the gap
    (2, [False, True], (4,)),
]


@pytest.mark.parametrize("d, active, grid", CASES)
def test_patch_encoder_equals_strided_convs(d, active, grid):
    s1, s2 = 3, 2
    enc = PatchEncoder(5, 8, 12, (s1, s2), d, groups=4).double()
    _randomise(enc)
    x = torch.randn(2, 5, *[g * s1 * s2 for g in grid], dtype=torch.float64)
    got = enc(x, active)
    conv = CONV[len(grid)]
    ref = conv(x, _squeeze(enc.proj1.weight, active), stride=s1)
    ref = F.silu(_norm(enc.norm1)(ref))
    ref = conv(ref, _squeeze(enc.proj2.weight, active), stride=s2)
    ref = F.silu(_norm(enc.norm2)(ref))
    assert got.shape == (2, 12, *grid)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert got.movedim(1, -1).is_contiguous()  # channels last: the processor needs no copy


@pytest.mark.parametrize("d, active, grid", CASES)
def test_patch_decoder_equals_transposed_convs(d, active, grid):
    s1, s2 = 3, 2
    dec = PatchDecoder(12, 8, 7, (s1, s2), d, groups=4).double()
    _randomise(dec)
    fields = torch.tensor([5, 0, 3])
    x = torch.randn(2, *grid, 12, dtype=torch.float64).movedim(-1, 1)  # as the model passes it
    got = dec(x, fields, active)
    conv_t = CONV_T[len(grid)]
    ref = conv_t(x, _squeeze(dec.proj1.weight, active), stride=s2)
    ref = F.silu(_norm(dec.norm1)(ref))
    w2 = _squeeze(dec.proj2.weight[:, fields], active)
    ref = conv_t(ref, w2, dec.proj2.bias[fields], stride=s1)
    assert got.shape == (2, 3, *[g * s1 * s2 for g in grid])
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "spatial, bcs",
    [
        ((21,), [[PERIODIC, PERIODIC]]),
        ((16, 13), [[PERIODIC, PERIODIC], [WALL, OPEN]]),
        ((9, 8, 5), [[PERIODIC, PERIODIC], [WALL, WALL], [OPEN, OPEN]]),
        ((16, 1), [[WALL, WALL], [PERIODIC, PERIODIC]]),
        ((3, 16), [[PERIODIC, PERIODIC], [PERIODIC, PERIODIC]]),  # an axis shorter than a patch
    ],
)
@pytest.mark.parametrize("jitter_seed", [None, 3])
def test_forward_shapes_and_latent_grid(spatial, bcs, jitter_seed):
    model = patch_model().eval()
    seen = []
    key = str(len(spatial))
    model.embed[key].register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape[2:])))
    x = torch.randn(2, 3, 2, *spatial)
    y = model(x, torch.tensor([1, 4]), bcs, jitter_seed=jitter_seed)
    assert y.shape == x.shape and torch.isfinite(y).all()
    # ceil(size / 8) tokens per strided axis; a jittered wall or open axis gets half a patch
    # more padding on each side (one more token)
    want = [math.ceil(n / 8) + (bc[0] != PERIODIC) for n, bc in zip(spatial, bcs) if n > 1]
    assert seen == [tuple(want)]


def test_odd_patch_tiles_jittered_walls():
    """With an odd patch, half a patch per side is not a whole patch; the plan pads one more."""
    model = patch_model(kernel_sizes=[3, 1]).eval()
    x = torch.randn(1, 2, 2, 10, 7)
    bcs = [[WALL, WALL], [PERIODIC, PERIODIC]]
    padded, strides, periodic = model.encoder_layout((10, 7), bcs)
    assert padded == [15, 9] and strides == [(3, 1)] * 2 and periodic == [False, True]
    y = model(x, torch.tensor([0, 1]), bcs, jitter_seed=1)
    assert y.shape == x.shape


def test_jitter_shifts_the_patch_grid():
    """On periodic axes a jitter shift r equals rolling the input by r and the output back."""
    model = patch_model().eval()
    x = torch.randn(1, 2, 2, 16, 24)
    bcs = [[PERIODIC, PERIODIC]] * 2
    fields = torch.tensor([0, 2])
    plain = model(x, fields, bcs)
    with model.replay_jitter([3, -2]):
        shifted = model(x, fields, bcs, jitter_seed=0)
    ref = model(x.roll((3, -2), (-2, -1)), fields, bcs).roll((-3, 2), (-2, -1))
    torch.testing.assert_close(shifted, ref, rtol=1e-5, atol=1e-5)
    assert (shifted - plain).abs().max() > 1e-3  # the grid really moved


def test_resize_vocab_keeps_old_field_outputs():
    model = patch_model(include_d=[2]).eval()
    x = torch.randn(1, 2, 2, 16, 16)
    bcs = [[PERIODIC, PERIODIC], [WALL, WALL]]
    fields = torch.tensor([4, 1])
    before = model(x, fields, bcs)
    model.resize_vocab(9)
    assert model.debed["2"].proj2.weight.shape == (16, 9, 4, 4)
    torch.testing.assert_close(model(x, fields, bcs), before, rtol=1e-5, atol=1e-6)
    assert model(x, torch.tensor([4, 8]), bcs)[:, :, 1].abs().max() > 0  # a new field decodes


def test_grow_dims_adds_sets_of_the_right_dimensionality():
    model = patch_model(include_d=[1]).eval()
    x = torch.randn(1, 2, 2, 24)
    bcs = [[PERIODIC, PERIODIC]]
    fields = torch.tensor([0, 1])
    before = model(x, fields, bcs)
    assert model.grow_dims([2, 3]) == [2, 3]
    assert model.config.include_d == (1, 2, 3)
    assert model.embed["1"].proj1.weight.shape == (16, 8, 4)  # P * s1 inputs
    assert model.embed["2"].proj1.weight.shape == (16, 8, 4, 4)  # P * s1^2 inputs
    assert model.embed["3"].proj2.weight.shape == (32, 16, 2, 2, 2)  # inter * s2^3 inputs
    assert model.debed["3"].proj2.weight.shape == (16, 5, 4, 4, 4)
    torch.testing.assert_close(model(x, fields, bcs), before)
    y3 = model(torch.randn(1, 2, 2, 8, 8, 8), fields, bcs * 3)
    assert y3.shape == (1, 2, 2, 8, 8, 8)
    # training ties the unused sets in with zero gradients (no find_unused_parameters)
    model.train()
    model(x, fields, bcs).square().mean().backward()
    for d in ("2", "3"):
        for p in [*model.embed[d].parameters(), *model.debed[d].parameters()]:
            assert p.grad is not None and p.grad.abs().max() == 0
    assert all(p.grad.abs().max() > 0 for p in model.embed["1"].parameters())


def test_checkpoint_round_trip(tmp_path):
    model = patch_model(include_d=[2]).eval()
    cfg = model.config.to_dict()
    assert cfg["encoder"] == "patch"
    state = model.state_dict()
    assert check_config_fits(cfg, state, "mem") == model.config
    path = tmp_path / "patch.ckpt"
    ckpt = {
        "state_dict": {f"model.{k}": v for k, v in state.items()},
        "walrus": {
            "format": 1,
            "model_config": cfg,
            "vocab": FieldVocabulary([f"f{i}" for i in range(5)]).to_dict(),
        },
    }
    atomic_torch_save(with_checksums(ckpt), path)
    loaded, _ = load_model(path)
    x = torch.randn(1, 2, 2, 16, 16)
    bcs = [[PERIODIC, PERIODIC]] * 2
    fields = torch.tensor([0, 3])
    torch.testing.assert_close(loaded.eval()(x, fields, bcs), model(x, fields, bcs))
    # the conv form with the same kernels and strides has the same keys: its 3D kernels differ
    conv = {**cfg, "encoder": "conv", "strides": [4, 2], "stride_options": [[4, 2]]}
    with pytest.raises(ValueError, match=r"embed.2.proj1.weight is \(16, 8, 4, 4\) in the file"):
        check_config_fits(conv, state, "mem")


def _yaml(name: str) -> dict:
    return yaml.safe_load((MODEL_DIR / f"{name}.yaml").read_text())


def test_old_conv_small_config_still_builds_the_conv_model():
    """A config stored before the option existed (no ``encoder`` key) is the conv model."""
    old = _yaml("small_conv")
    assert "encoder" not in old
    model = Walrus(WalrusConfig.from_dict({**old, "include_d": [2]}))
    assert model.config.encoder == "conv"
    assert isinstance(model.embed["2"], Encoder) and isinstance(model.debed["2"], Decoder)
    assert model.embed["2"].proj1.weight.shape == (64, 32, 8, 8, 8)


@pytest.mark.parametrize("compat", ["walrus_official", "walrus_current"])
def test_official_profiles_refuse_patch(compat):
    with pytest.raises(
        ValueError, match=f"encoder='patch' is not available with compat='{compat}'"
    ):
        WalrusConfig(67, 64, 1, 4, groups=4, encoder="patch", compat=compat)


def test_patch_option_errors():
    with pytest.raises(ValueError, match="encoder='pixel' is not known"):
        WalrusConfig(4, 32, 1, 4, groups=4, encoder="pixel")
    with pytest.raises(ValueError, match="strides does not apply to encoder='patch'"):
        WalrusConfig(4, 32, 1, 4, groups=4, encoder="patch", strides=[2, 2])
    # stride modulation options play no part: kernel_sizes smaller than them is fine
    cfg = WalrusConfig(4, 32, 1, 4, groups=4, encoder="patch", kernel_sizes=[2, 2])
    assert cfg.kernel_sizes == (2, 2)


@pytest.mark.parametrize("encoder", ["patch", "patch_overlap", "conv"])
@pytest.mark.parametrize(
    "spatial, bcs",
    [
        ((40,), [[PERIODIC, PERIODIC]]),
        ((24, 17), [[WALL, OPEN], [PERIODIC, PERIODIC]]),
        ((16, 9, 8), [[WALL, WALL], [OPEN, WALL], [PERIODIC, PERIODIC]]),
        ((16, 1), [[WALL, WALL], [PERIODIC, PERIODIC]]),
    ],
)
def test_forward_flops_match_flop_counter(encoder, spatial, bcs):
    """Exact with the math attention kernels and unfused blocks: every GEMM, conv and
    attention matmul is counted, nothing else."""
    kernels = [8, 4] if encoder == "conv" else [4, 2]
    model = patch_model(
        encoder="conv" if encoder == "conv" else "patch",
        decoder_overlap=encoder == "patch_overlap",
        kernel_sizes=kernels,
        temporal_kernel="math",
        spatial_kernel="math",
        fused=False,
    ).train()
    x = torch.randn(2, 3, 2, *spatial)
    with FlopCounterMode(display=False) as counter:
        model(x, torch.tensor([0, 3]), bcs)
    parts = forward_flops(model, 2, 3, 2, spatial, bcs)
    assert counter.get_total_flops() == parts["total"]
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert min(parts.values()) > 0


def _quickstart_shape() -> tuple[int, int, int, tuple[int, int], list[list[int]]]:
    """Batch, input frames, fields, grid and BCs of ``experiment=quickstart``."""
    root = MODEL_DIR.parent
    quick = yaml.safe_load((root / "experiment" / "quickstart.yaml").read_text())
    well = yaml.safe_load((root / "data" / "base" / "well.yaml").read_text())
    batch = quick["data"].get("batch_size", well["batch_size"])
    # built-in navier_stokes_2d: vorticity and two velocity components on a periodic 64^2 grid
    return batch, well["n_steps_input"], 3, (64, 64), [[PERIODIC, PERIODIC]] * 2


def _model_from_yaml(name: str) -> Walrus:
    cfg = {k: v for k, v in _yaml(name).items()}
    cfg["include_d"] = [2]  # training derives it from the (2D) data
    return Walrus(WalrusConfig.from_dict(cfg))


def test_small_puts_most_params_and_flops_in_the_processor():
    batch, frames, channels, grid, bcs = _quickstart_shape()
    for name, patch in (("small", True), ("small_conv", False)):
        with torch.device("meta"):
            model = _model_from_yaml(name)
        params = parameter_counts(model)
        flops = forward_flops(model, batch, frames, channels, grid, bcs)
        assert params["total"] == sum(p.numel() for p in model.parameters())
        p_share = params["processor"] / params["total"]
        f_share = flops["processor"] / flops["total"]
        if patch:
            assert model.config.encoder == "patch"
            assert p_share >= 0.6 and f_share >= 0.6, (p_share, f_share)
        else:  # the old model: most of it in the encoder/decoder convs
            assert p_share < 0.6 and f_share < 0.6, (p_share, f_share)


def test_small_forward_flops_near_flop_counter_on_its_own_kernels():
    """The analytic count against FlopCounterMode on ``small`` as configured (fused blocks,
    its attention kernels; CPU SDPA and in-place GEMMs counted by the benchmarks' accounting):
    within 5 % (RoPE and the kernels' extra matmuls)."""
    from benchmarks.accounting import account

    _, frames, channels, grid, bcs = _quickstart_shape()
    model = _model_from_yaml("small").train()
    x = torch.randn(1, frames, channels, *grid)
    report = account(lambda: model(x, torch.arange(channels), bcs), fake=False)
    analytic = forward_flops(model, 1, frames, channels, grid, bcs)["total"]
    assert report.flops == pytest.approx(analytic, rel=0.05)


@pytest.mark.parametrize(
    "spatial, bcs",
    [
        ((21,), [[PERIODIC, PERIODIC]]),
        ((16, 13), [[PERIODIC, PERIODIC], [WALL, OPEN]]),
        ((9, 8, 5), [[OPEN, OPEN], [WALL, WALL], [PERIODIC, PERIODIC]]),
        ((16, 1), [[WALL, WALL], [PERIODIC, PERIODIC]]),
    ],
)
@pytest.mark.parametrize("jitter_seed", [None, 5])
def test_folded_embedding_equals_embedding_then_encoder(spatial, bcs, jitter_seed):
    """The patch forward folds field embedding, boundary tokens and bias into the first GEMM;
    it equals embedding, padding with tokens and encoding one after the other (the path taken
    while input dropout is active), values and gradients, in float64."""
    model = patch_model().double().train()
    _randomise(model)
    x = torch.randn(2, 3, 2, *spatial, dtype=torch.float64)
    fields = torch.tensor([1, 4])

    assert_folded_equals_unfolded(model, x, fields, bcs, jitter_seed)
    if any(bc[0] != PERIODIC for bc in bcs):  # the boundary tokens reached the output
        assert model.patch_jitterer.padding_tokens.grad.abs().max() > 0


def assert_folded_equals_unfolded(model, x, fields, bcs, jitter_seed) -> None:
    """The folded forward (no input dropout) equals the embed-first path (dropout active but
    keeping every value), values and gradients; the embed-first gradients stay on the parameters."""

    def run(drop: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        torch.manual_seed(1)  # the same jitter draws in training mode
        model.input_drop.p = drop
        assert model.embedding_folded() == (drop == 0)
        y = model(x, fields, bcs, jitter_seed=jitter_seed)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        return y.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    folded, g_folded = run(0.0)
    unfolded, g_unfolded = run(1e-300)  # dropout active, keeps every value: the unfolded path
    torch.testing.assert_close(folded, unfolded, rtol=1e-10, atol=1e-10)
    assert len(g_folded) == len(g_unfolded)
    for a, b in zip(g_folded, g_unfolded):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def _fold_periodic(y: torch.Tensor, ax: int, length: int) -> torch.Tensor:
    """Wrap what lies past ``length`` on axis ``ax`` around onto the start."""
    over = y.shape[ax] - length
    head = y.narrow(ax, 0, over) + y.narrow(ax, length, over)
    return torch.cat([head, y.narrow(ax, over, length - over)], dim=ax)


@pytest.mark.parametrize("s1", [3, 4])
@pytest.mark.parametrize(
    "d, active, grid, wrap",
    [
        (1, [True], (3,), [True]),
        (1, [True], (3,), [False]),
        (2, [True, True], (2, 3), [True, False]),
        (3, [True, True, True], (2, 1, 3), [False, True, True]),
        (3, [True, False, True], (2, 3), [True, True]),  # 2D data on the 3D set
    ],
)
def test_overlapping_patch_decoder_equals_centred_transposed_conv(s1, d, active, grid, wrap):
    """``overlap``: the last stage is a transposed conv with kernel 2 s1 at stride s1, cropped
    to be centred (offset s1 // 2) and wrapped around the periodic axes."""
    s2 = 2
    dec = PatchDecoder(12, 8, 7, (s1, s2), d, groups=4, overlap=True).double()
    _randomise(dec)
    assert dec.proj2.weight.shape[2:] == (2 * s1,) * d
    fields = torch.tensor([5, 0, 3])
    x = torch.randn(2, *grid, 12, dtype=torch.float64).movedim(-1, 1)
    got = dec(x, fields, active, wrap)
    conv_t = CONV_T[len(grid)]
    ref = conv_t(x, _squeeze(dec.proj1.weight, active), stride=s2)
    ref = F.silu(_norm(dec.norm1)(ref))
    ref = conv_t(ref, _squeeze(dec.proj2.weight[:, fields], active), stride=s1)
    lengths = [g * s1 * s2 for g in grid]
    for i, (length, w) in enumerate(zip(lengths, wrap)):
        if w:
            ref = _fold_periodic(ref, 2 + i, length).roll(-(s1 // 2), 2 + i)
        else:
            ref = ref.narrow(2 + i, s1 // 2, length)
    ref = ref + dec.proj2.bias[fields].view(1, 3, *[1] * len(grid))
    assert got.shape == (2, 3, *lengths)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_overlapping_decoder_runs_in_models():
    """Models with ``decoder_overlap`` build 2 s1 kernels and run on 1D-3D data with any
    boundaries (jittered); the option needs the patch encoder."""
    model = patch_model(decoder_overlap=True).eval()
    assert model.debed["2"].proj2.weight.shape[2:] == (8, 8)
    assert patch_model().debed["2"].proj2.weight.shape[2:] == (4, 4)
    for spatial, bcs in (
        ((21,), [[PERIODIC, PERIODIC]]),
        ((16, 13), [[PERIODIC, PERIODIC], [WALL, OPEN]]),
        ((9, 8, 5), [[OPEN, OPEN], [WALL, WALL], [PERIODIC, PERIODIC]]),
        ((3, 16), [[PERIODIC, PERIODIC], [PERIODIC, PERIODIC]]),  # padded periodic axis
    ):
        x = torch.randn(2, 3, 2, *spatial)
        for seed in (None, 3):
            y = model(x, torch.tensor([1, 4]), bcs, jitter_seed=seed)
            assert y.shape == x.shape and torch.isfinite(y).all()
    with pytest.raises(ValueError, match="decoder_overlap"):
        patch_model(encoder="conv", kernel_sizes=[8, 4], decoder_overlap=True)
