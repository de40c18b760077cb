"""Attention kernels agree with a float64 reference; chunked stays O(block) in memory."""

from __future__ import annotations

import pytest
import torch

from walrus.nn.attention import KERNEL_NAMES, KERNEL_OPTIONS, attention
from walrus.nn.chunked_attention import make_plan

FAST = [
    ("sdpa", {}),
    ("chunked", {}),  # unchunked fast path at these sizes
    ("chunked", {"q_chunk": 3, "kv_chunk": 4}),  # lengths not multiples of the chunks
    ("chunked", {"q_chunk": 1, "kv_chunk": 1}),
    ("chunked", {"chunk_bytes": 4 * 5 * 6}),  # budget-planned small blocks
    ("math", {}),
]
# (leading dims, Lq, Lk, bias shape or None)
SHAPES = [
    ((2, 3), 7, 7, None),
    ((2, 3), 5, 11, (3, 5, 11)),  # Lq != Lk, per-head bias
    ((4,), 13, 13, (13, 13)),
    ((2, 3), 9, 9, (2, 1, 9, 9)),  # per-batch bias
    ((2, 3), 1, 10, (1, 10)),  # a single query, key-only bias
    ((2, 2, 3), 6, 8, (2, 1, 3, 6, 8)),  # three leading dims
]


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return list(torch.autograd.grad(out, inputs, g))


def _make(lead, lq, lk, bshape, dtype=torch.float32, e=8, ev=5, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen).to(dtype).requires_grad_()

    q, k, v = r(*lead, lq, e), r(*lead, lk, e), r(*lead, lk, ev)
    return q, k, v, (None if bshape is None else r(*bshape))


def _reference(q, k, v, bias, causal):
    """Float64 math-kernel output and gradients."""
    ins = [t.detach().double().requires_grad_() for t in (q, k, v) if t is not None]
    b = None if bias is None else bias.detach().double().requires_grad_()
    out = attention(*ins, bias=b, causal=causal, kernel="math")
    return out, _grads(out, ins + ([b] if b is not None else []), seed=1)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("kernel,opts", FAST, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_float64_reference(kernel, opts, causal, shape):
    lead, lq, lk, bshape = shape
    q, k, v, bias = _make(lead, lq, lk, bshape)
    out = attention(q, k, v, bias=bias, causal=causal, kernel=kernel, **opts)
    ins = [q, k, v] + ([bias] if bias is not None else [])
    grads = _grads(out, ins, seed=1)
    ref_out, ref_grads = _reference(q, k, v, bias, causal)
    assert out.shape == (*lead, lq, 5)
    assert _rel(out, ref_out) < 1e-5
    for name, g, rg in zip("qkvb", grads, ref_grads):
        assert _rel(g, rg) < 1e-5, name
    with torch.no_grad():  # the inference path (in-place softmax) gives the same output
        assert (
            _rel(attention(q, k, v, bias=bias, causal=causal, kernel=kernel, **opts), ref_out)
            < 1e-5
        )


def test_bias_gradient_along_broadcast_key_axis_is_zero():
    """A bias constant over keys cancels in softmax: its gradient is 0 in every kernel."""
    q, k, v, bias = _make((2, 3), 6, 8, (2, 1, 6, 1))
    for kernel, opts in FAST:
        out = attention(q, k, v, bias=bias, causal=True, kernel=kernel, **opts)
        (gb,) = torch.autograd.grad(out.sum(), [bias])
        assert gb.shape == bias.shape
        assert gb.abs().max() < 1e-5, kernel


@pytest.mark.parametrize(
    "kernel,opts",
    [
        ("sdpa", {}),
        ("chunked", {}),
        ("chunked", {"q_chunk": 4, "kv_chunk": 3}),
        ("chunked", {"chunk_bytes": 2 * 16 * 16 * 4}),
    ],
    ids=str,
)
def test_bf16_within_tolerance(kernel, opts):
    q, k, v, bias = _make((2, 4), 11, 16, (4, 11, 16), dtype=torch.bfloat16)
    out = attention(q, k, v, bias=bias, causal=True, kernel=kernel, **opts)
    grads = _grads(out, [q, k, v, bias], seed=1)
    ref_out, ref_grads = _reference(q, k, v, bias, causal=True)
    assert out.dtype == torch.bfloat16
    assert _rel(out, ref_out) < 2e-2
    for g, rg, t in zip(grads, ref_grads, (q, k, v, bias)):
        assert g.dtype == t.dtype
        assert _rel(g, rg) < 2e-2


def test_temporal_shape_batch_chunked_matches():
    """Whole short sequences in batch chunks (budget < full score matrix) stay exact."""
    q, k, v, bias = _make((24, 4), 6, 6, (4, 6, 6))
    plan = make_plan(q, k, bias, True, 1.0, {"chunk_bytes": 8 * 36 * 4})
    assert (plan.nb, plan.cq, plan.ck) == (8, 6, 6)
    out = attention(q, k, v, bias=bias, causal=True, kernel="chunked", chunk_bytes=8 * 36 * 4)
    grads = _grads(out, [q, k, v, bias], seed=1)
    ref_out, ref_grads = _reference(q, k, v, bias, causal=True)
    assert _rel(out, ref_out) < 1e-5
    for g, rg in zip(grads, ref_grads):
        assert _rel(g, rg) < 1e-5


def test_plan_follows_budget():
    q = torch.zeros(1, 8, 4096, 64)
    plan = make_plan(q, q, None, False, 1.0, {"chunk_bytes": 8 << 20})
    assert 8 * plan.cq * plan.ck * 4 <= 8 << 20
    assert (plan.cq, plan.ck) == (512, 512)
    small = torch.zeros(6144, 16, 64)
    plan = make_plan(small, small, None, True, 1.0, {"chunk_bytes": 8 << 20})
    assert (plan.nb, plan.cq, plan.ck) == (6144, 16, 16)  # no chunking at all


class _OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Record the largest op output and count calls by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.calls[name] = self.calls.get(name, 0) + 1
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


@pytest.mark.parametrize("grad", [False, True])
def test_long_sequence_never_materialises_scores(grad):
    n, budget = (1024, 1 << 16) if grad else (8192, 4 << 20)
    q, k, v = (torch.randn(1, n, 16, requires_grad=grad) for _ in range(3))
    with _OpRecorder() as rec:
        out = attention(q, k, v, causal=True, kernel="chunked", chunk_bytes=budget)
        if grad:
            out.sum().backward()
    assert rec.max_numel <= budget // 4 < n * n  # no op output exceeds one score block
    assert sum(c for name, c in rec.calls.items() if "bmm" in name) > 2


def test_fully_masked_causal_blocks_are_skipped():
    q, k, v = (torch.randn(2, 64, 8) for _ in range(3))
    counts = {}
    for causal in (False, True):
        with _OpRecorder() as rec:
            attention(q, k, v, causal=causal, kernel="chunked", q_chunk=16, kv_chunk=16)
        counts[causal] = sum(c for name, c in rec.calls.items() if "bmm" in name)
    # 4 x 4 blocks, 2 matmuls each; causal keeps the 10 on or below the diagonal
    assert counts == {False: 2 * 16, True: 2 * 10}


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_non_contiguous_inputs(kernel):
    """(B, L, H, E) projections viewed as (B, H, L, E) work without the caller copying."""
    q, k, v = (torch.randn(2, 7, 3, 8).transpose(1, 2) for _ in range(3))  # (B, H, L, E)
    out = attention(q, k, v, causal=True, kernel=kernel, q_chunk=3, kv_chunk=2)
    ref = attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, kernel="math")
    assert torch.allclose(out, ref, atol=1e-5)


def test_backward_twice_with_retained_graph():
    q, k, v, bias = _make((2, 3), 9, 9, (3, 9, 9))
    for opts in ({}, {"q_chunk": 4, "kv_chunk": 4}):
        out = attention(q, k, v, bias=bias, causal=True, kernel="chunked", **opts)
        first = torch.autograd.grad(out.sum(), [q, bias], retain_graph=True)
        second = torch.autograd.grad(out.sum(), [q, bias])
        assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_kernel_names_exported():
    assert set(KERNEL_NAMES) == {"sdpa", "chunked", "math"}
    assert set(KERNEL_OPTIONS) == set(KERNEL_NAMES)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kernel": "flash3"}, "unknown attention kernel 'flash3'"),
        ({"kernel": "chunked", "chunk_size": 4}, "unknown attention option"),
        ({"kernel": "chunked", "q_chunk": 0}, "q_chunk=0"),
        ({"bias": torch.zeros(3, 5, 7)}, "does not broadcast"),
        ({"bias": torch.zeros(5, 7, dtype=torch.bool)}, "float tensor"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    q, k, v = torch.zeros(2, 5, 4), torch.zeros(2, 7, 4), torch.zeros(2, 7, 3)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((2, 5, 4), (2, 7, 3), (2, 7, 3)), "head dims differ"),
        (((2, 5, 4), (2, 7, 4), (2, 6, 3)), "lengths differ"),
        (((2, 5, 4), (3, 7, 4), (3, 7, 3)), "leading dims differ"),
        (((4,), (4,), (4,)), "must be a tensor"),
    ],
)
def test_bad_shapes_raise(shapes, match):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v)


def test_causal_needs_lq_le_lk():
    with pytest.raises(ValueError, match="Lq <= Lk"):
        attention(torch.zeros(1, 6, 4), torch.zeros(1, 3, 4), torch.zeros(1, 3, 4), causal=True)


def test_options_of_other_kernels_are_ignored():
    q = torch.randn(2, 5, 4)
    out = attention(q, q, q, kernel="sdpa", chunk_bytes=1024)
    assert torch.allclose(out, attention(q, q, q, kernel="math"), atol=1e-6)


def test_chunked_runs_under_bf16_autocast():
    q, k, v = (torch.randn(2, 3, 6, 8, dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(3, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v, bias=bias, causal=True, kernel="chunked")
    ref = attention(
        q.double(), k.double(), v.double(), bias=bias.double(), causal=True, kernel="math"
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("lk", [6, 24])
def test_chunked_keeps_float64_exact_with_and_without_grad(lk):
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, lk, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, lk, lk, dtype=torch.float64)
    ref = attention(q, k, v, bias=bias, causal=True, kernel="math")
    out = attention(q, k, v, bias=bias, causal=True, kernel="chunked")  # training path
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        blocked = attention(
            q, k, v, bias=bias, causal=True, kernel="chunked", q_chunk=5, kv_chunk=4
        )
    torch.testing.assert_close(blocked, ref.detach(), rtol=1e-12, atol=1e-12)
