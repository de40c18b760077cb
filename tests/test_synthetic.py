"""Physics checks of the built-in solvers (small sizes) and the generator."""

import h5py
import numpy as np
import pytest

from walrus.data.synthetic import SYSTEMS, generate
from walrus.data.synthetic import advection_diffusion as ad
from walrus.data.synthetic import gray_scott as gs
from walrus.data.synthetic import navier_stokes as ns
from walrus.data.synthetic import shallow_water as sw
from walrus.data.synthetic.__main__ import main as cli
from walrus.data.well_dataset import WellDataset


def test_taylor_green_energy_decay():
    n, nu = 32, 0.05
    x = np.arange(n) * 2 * np.pi / n
    X, Y = np.meshgrid(x, x, indexing="ij")
    w0 = (2 * np.sin(X) * np.sin(Y))[None]  # u = (sin x cos y, -cos x sin y)
    w = ns.solve_vorticity(w0, nu, save_dt=0.5, steps=6)
    u = ns.velocity_from_vorticity(np.fft.rfft2(w[0]), n)  # (T, N, N, 2)
    assert np.allclose(u[0, ..., 0], np.sin(X) * np.cos(Y), atol=1e-12)
    energy = 0.5 * (u**2).sum(-1).mean(axis=(1, 2))
    exact = 0.25 * np.exp(-4 * nu * 0.5 * np.arange(6))
    assert np.abs(energy / exact - 1).max() < 1e-4


def test_navier_stokes_random_run_is_incompressible():
    p = {k: np.full(2, v) for k, v in ns.REGIMES["kolmogorov"].items()}
    sim = ns.simulate(p, 16, 4, np.random.default_rng(0))
    u = sim.vector_fields["velocity"]  # (2, 4, 16, 16, 2)
    assert np.isfinite(u).all() and np.abs(np.diff(sim.fields["vorticity"], axis=1)).max() > 1e-3
    k = np.fft.fftfreq(16, 1 / 16)
    div = 1j * k[:, None] * np.fft.fft2(u[..., 0]) + 1j * k[None, :] * np.fft.fft2(u[..., 1])
    assert np.abs(div).max() < 1e-9


def test_gray_scott_uniform_state_follows_ode():
    F, k = gs.REGIMES["maze"]["F"], gs.REGIMES["maze"]["k"]
    a0, b0 = 0.6, 0.3
    init = np.full((1, 16, 16), a0), np.full((1, 16, 16), b0)
    a, b = gs.solve(*init, F, k, save_dt=25.0, steps=9)  # default dt = 2.5
    a_fine, b_fine = gs.solve(*init, F, k, save_dt=25.0, steps=9, dt=0.5)
    assert np.ptp(a[0, -1]) < 1e-12  # stays uniform

    def rhs(s):
        r = s[0] * s[1] ** 2
        return np.array([-r + F * (1 - s[0]), r - (F + k) * s[1]])

    s, h, ref = np.array([a0, b0]), 0.01, [np.array([a0, b0])]
    for _ in range(8):
        for _ in range(2500):
            k1 = rhs(s)
            k2 = rhs(s + h / 2 * k1)
            k3 = rhs(s + h / 2 * k2)
            k4 = rhs(s + h * k3)
            s = s + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        ref.append(s)
    ref = np.array(ref)  # (9, 2)
    assert np.abs(ref[:, 1] - b0).max() > 0.05  # the ODE actually moves
    assert np.abs(a[0, :, 0, 0] - ref[:, 0]).max() < 1e-4
    assert np.abs(b[0, :, 0, 0] - ref[:, 1]).max() < 1e-4
    # fourth order: 5x smaller steps, ~600x smaller error
    assert np.abs(a_fine[0, :, 0, 0] - ref[:, 0]).max() < 1e-7
    assert np.abs(b_fine[0, :, 0, 0] - ref[:, 1]).max() < 1e-7


def test_gray_scott_regimes_differ():
    rng = np.random.default_rng(0)
    a0, b0 = gs.initial_state(rng, 1, 24)
    outs = [gs.solve(a0, b0, r["F"], r["k"], 25.0, 5)[1] for r in gs.REGIMES.values()]
    assert len(outs) >= 2 and np.abs(outs[0][0, -1] - outs[1][0, -1]).max() > 1e-2


def test_shallow_water_conserves_mass_with_walls():
    rng = np.random.default_rng(0)
    h0 = sw.initial_height(rng, 2, 24, np.array([0.5, 0.5]))
    q = sw.solve(h0, save_dt=0.05, steps=12)  # waves reach and reflect off the walls
    mass = q[:, :, 0].sum(axis=(2, 3))
    assert np.abs(mass / mass[:, :1] - 1).max() < 1e-6
    edge = q[:, -1, 0, 0, :] - 1.0
    assert np.abs(edge).max() > 1e-3  # disturbances reached the wall
    assert (q[:, :, 0] > 0).all()


def test_advection_diffusion_exact_solution_and_mass():
    n, kappa, dt, steps = 16, 0.05, 0.2, 4
    x = np.arange(n) * 2 * np.pi / n
    X, Y, Z = np.meshgrid(x, x, x, indexing="ij")
    c0 = (1.0 + np.sin(X + 2 * Y) + 0.5 * np.cos(3 * Z - Y + 0.3) + 0.2 * np.sin(5 * X - 4 * Z))[
        None
    ]
    drift = np.array([[0.7, -0.3, 0.5]])
    c = ad.solve(c0, drift, np.zeros((1, 3)), kappa, dt, steps)  # (1, T, N, N, N)
    ks = np.meshgrid(*[np.fft.fftfreq(n, 1 / n)] * 3, indexing="ij")
    c0_hat = np.fft.fftn(c0[0])
    for t in range(steps):
        phase = np.exp(
            -(1j * sum(d * k for d, k in zip(drift[0], ks)) + kappa * sum(k**2 for k in ks))
            * dt
            * t
        )
        exact = np.fft.ifftn(c0_hat * phase).real
        assert np.abs(c[0, t] - exact).max() < 1e-5 * np.abs(exact).max()
    c = ad.solve(c0, drift, np.array([[1.0, 0.7, 0.4]]), kappa, dt, steps)
    mass = c.astype(np.float64).sum(axis=(2, 3, 4))
    assert np.abs(mass / mass[:, :1] - 1).max() < 1e-6
    assert np.abs(c[0, -1] - c[0, 0]).max() > 0.05


def _arrays(path):
    out = {}
    with h5py.File(path) as f:
        f.visititems(
            lambda k, v: out.__setitem__(k, v[()]) if isinstance(v, h5py.Dataset) else None
        )
    return out


@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_generate_is_deterministic_and_readable(tmp_path, system):
    res = 16 if SYSTEMS[system].n_spatial == 2 else 8
    kw = dict(n_traj=(2, 1, 1), resolution=res, steps=4, progress=False)
    root_a = generate(system, tmp_path / "a", seed=3, **kw)
    root_b = generate(system, tmp_path / "b", seed=3, stats=False, **kw)
    files = sorted((root_a / "data").rglob("*.hdf5"))
    assert {p.parent.name for p in files} == {"train", "valid", "test"}
    assert (root_a / "stats.yaml").is_file()
    for p in files:
        a, b = _arrays(p), _arrays(root_b / p.relative_to(root_a))
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    ds = WellDataset(tmp_path / "a", system, "train", 2, 1)
    assert ds.n_spatial == SYSTEMS[system].n_spatial and ds[0].input_fields.isfinite().all()


def test_different_seed_differs(tmp_path):
    kw = dict(n_traj=(1, 1, 1), resolution=16, steps=3, progress=False, stats=False)
    a = (
        generate("navier_stokes_2d", tmp_path / "a", seed=0, **kw)
        / "data/train/navier_stokes_2d_decaying.hdf5"
    )
    b = (
        generate("navier_stokes_2d", tmp_path / "b", seed=1, **kw)
        / "data/train/navier_stokes_2d_decaying.hdf5"
    )
    assert not np.array_equal(_arrays(a)["t0_fields/vorticity"], _arrays(b)["t0_fields/vorticity"])


def test_cli_writes_dataset(tmp_path, capsys):
    cli(
        [
            "shallow_water_2d",
            "--out",
            str(tmp_path),
            "--n-traj",
            "1,1,1",
            "--resolution",
            "12",
            "--steps",
            "3",
        ]
    )
    assert "wrote" in capsys.readouterr().out
    ds = WellDataset(tmp_path, "shallow_water_2d", "test", 1, 1)
    assert ds.bcs.tolist() == [[0, 0], [0, 0]] and ds.field_names == [
        "height",
        "velocity_x",
        "velocity_y",
    ]


def test_generate_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown system 'burgers'"):
        generate("burgers", tmp_path)
    with pytest.raises(ValueError, match="unknown regimes"):
        generate("gray_scott_2d", tmp_path, regimes=["nope"])
    with pytest.raises(ValueError, match="n_traj"):
        generate("gray_scott_2d", tmp_path, n_traj=(1, 2))
