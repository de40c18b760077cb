"""The built-in systems added for multi-physics pretraining: each solver against a known solution or
invariant, each system's default generation read by our reader and by The Well's, and data of a 1D
and a 2D system feeding a tiny model for two training steps."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from the_well.data import WellDataset as TheWellDataset

from tests.conftest import tiny_train_overrides
from walrus.bcs import BoundaryType
from walrus.compat.released import RELEASED_FIELDS
from walrus.data.synthetic import SYSTEMS, generate
from walrus.data.synthetic import acoustics as ac
from walrus.data.synthetic import burgers as bg
from walrus.data.synthetic import cahn_hilliard as ch
from walrus.data.synthetic import euler as eu
from walrus.data.synthetic import kuramoto_sivashinsky as ks
from walrus.data.synthetic.__main__ import main as cli
from walrus.data.well_file import WellFile
from walrus.training.train import train

NEW = {
    "burgers_1d": ({"x": "periodic"}, ["velocity_x"]),
    "kuramoto_sivashinsky_1d": ({"x": "periodic"}, ["velocity_x"]),
    "cahn_hilliard_2d": ({"x": "periodic", "y": "periodic"}, ["concentration"]),
    "euler_riemann_2d": (
        {"x": "open", "y": "open"},
        ["density", "energy", "pressure", "momentum_x", "momentum_y"],
    ),
    "acoustic_scattering_2d": (
        {"x": "wall", "y": "wall"},
        ["pressure", "density", "speed_of_sound", "velocity_x", "velocity_y"],
    ),
}


# ---------------------------------------------------------------- Burgers


def test_burgers_matches_cole_hopf_solution():
    # phi = a + exp(-nu t) cos x solves the heat equation; u = -2 nu phi_x / phi solves Burgers
    n, nu, a, dt, steps = 64, 0.1, 1.5, 0.25, 5
    x = np.arange(n) * 2 * np.pi / n

    def exact(t: float) -> np.ndarray:
        e = np.exp(-nu * t)
        return 2 * nu * e * np.sin(x) / (a + e * np.cos(x))

    u = bg.solve(exact(0.0)[None], nu, dt, steps)  # (1, T, N)
    scale = np.abs(exact(0.0)).max()
    for t in range(steps):
        assert np.abs(u[0, t] - exact(t * dt)).max() < 1e-5 * scale
    assert np.abs(u[0, -1] - u[0, 0]).max() > 0.1 * scale


def test_burgers_random_run_keeps_mean_max_principle_and_total_variation():
    p = {k: np.full(3, v) for k, v in bg.REGIMES["shocks"].items()}
    sim = bg.simulate(p, 128, 40, np.random.default_rng(0))
    u = sim.vector_fields["velocity"][..., 0]  # (3, T, N)
    mean = u.mean(-1)
    assert np.abs(mean - mean[:, :1]).max() < 1e-12 and np.ptp(mean[:, 0]) > 0.05
    peak = np.abs(u).max(-1)
    assert (peak <= peak[:, :1] + 1e-9).all()
    tv = np.abs(np.diff(u, axis=-1, append=u[..., :1])).sum(-1)
    assert (np.diff(tv, axis=1) < 1e-9).all() and (tv[:, -1] < 0.6 * tv[:, 0]).all()
    slope = np.abs(np.diff(u, axis=-1)).max(-1)  # (3, T)
    assert (slope.max(1) > 2 * slope[:, 0]).all()  # fronts steepen before they decay


# ---------------------------------------------------------------- Kuramoto-Sivashinsky


def test_kuramoto_sivashinsky_small_modes_grow_at_the_linear_rate():
    length, n = 32 * np.pi, 64
    x = np.arange(n) * length / n
    for m in (3, 10, 20):  # growing, fastest growing, damped
        q = 2 * np.pi * m / length
        u = ks.solve(1e-6 * np.cos(q * x)[None], length, save_dt=1.0, steps=5)
        amp = np.abs(np.fft.rfft(u[0], axis=-1)[:, m])
        assert np.abs(amp / amp[0] - np.exp((q**2 - q**4) * np.arange(5))).max() < 1e-9


def test_kuramoto_sivashinsky_chaotic_run_conserves_mean_and_converges_in_dt():
    rng = np.random.default_rng(1)
    n, length = 64, 22.0
    u0 = 0.1 * rng.standard_normal((2, n))
    u0[1] += 0.3  # a nonzero mean is carried along, not changed
    u = ks.solve(u0, length, save_dt=1.0, steps=6, burn_in=60.0)  # (2, T, N)
    mean = u.mean(-1)
    assert np.abs(mean - u0.mean(-1, keepdims=True)).max() < 1e-12
    assert u.std(-1).min() > 0.5  # saturated, not decayed
    # fourth order: halving dt shrinks the difference to a finer run about 16x
    coarse, fine, finest = (ks.solve(u[:, 0], length, 1.0, 4, dt=h) for h in (0.25, 0.125, 0.0625))
    err_coarse, err_fine = np.abs(coarse - finest).max(), np.abs(fine - finest).max()
    assert err_coarse > 1e-8 and 10 < err_coarse / err_fine < 25


# ---------------------------------------------------------------- Cahn-Hilliard


def test_cahn_hilliard_conserves_mass_and_lowers_free_energy():
    p = {k: np.full(2, v) for k, v in ch.REGIMES["spinodal"].items()}
    sim = ch.simulate(p, 32, 40, np.random.default_rng(0))
    c = sim.fields["concentration"]  # (2, T, N, N)
    mass = c.mean(axis=(2, 3))
    assert np.abs(mass - mass[:, :1]).max() < 1e-12
    energy = ch.free_energy(c, p["eps"][0])  # (2, T)
    assert (np.diff(energy, axis=1) <= 1e-12).all() and (energy[:, -1] < 0.8 * energy[:, 0]).all()
    assert np.abs(c[:, -1]).max() > 0.9  # separated into the two phases


def test_cahn_hilliard_linear_stage_follows_the_scheme_and_the_growth_rate():
    n, eps, m = 32, 1.5, 3
    x = np.arange(n)
    q = 2 * np.pi * m / n
    c0 = 1e-7 * np.cos(q * x)[None, :, None] * np.ones((1, 1, n))
    growth = q**2 * (1 - eps**2 * q**2)  # of dc/dt = -lap(c) - eps^2 lap^2(c) near c = 0
    errors = []
    for dt in (0.5, 0.05):
        c = ch.solve(c0, eps, save_dt=1.0, steps=4, dt=dt)
        amp = c[0, :, :, 0].dot(np.cos(q * x)) / c0[0, :, 0].dot(np.cos(q * x))
        factor = (1 + dt * 2 * q**2 + dt * q**2) / (1 + dt * 2 * q**2 + dt * eps**2 * q**4)
        assert np.abs(amp - factor ** (np.arange(4) / dt)).max() < 1e-6
        errors.append(np.abs(amp / np.exp(growth * np.arange(4)) - 1).max())
    assert errors[1] < 0.02 and errors[1] < 0.2 * errors[0]  # first order in dt


# ---------------------------------------------------------------- Euler


def _exact_riemann(left, right, gamma: float, s: np.ndarray) -> np.ndarray:
    """Exact solution ``(rho, u, p)`` of a 1D Riemann problem at ``s = x / t``, ``(3, len(s))``."""
    (rl, ul, pl), (rr, ur, pr) = left, right
    cl, cr = np.sqrt(gamma * pl / rl), np.sqrt(gamma * pr / rr)
    g1, g2 = (gamma - 1) / (2 * gamma), (gamma + 1) / (2 * gamma)

    def f(p, rho, pk, c):
        if p > pk:  # shock
            a, b = 2 / ((gamma + 1) * rho), (gamma - 1) / (gamma + 1) * pk
            return (p - pk) * np.sqrt(a / (p + b)), np.sqrt(a / (p + b)) * (
                1 - (p - pk) / (2 * (b + p))
            )
        return 2 * c / (gamma - 1) * ((p / pk) ** g1 - 1), (p / pk) ** (-g2) / (rho * c)

    p = 0.5 * (pl + pr)
    for _ in range(50):
        (fl, dl), (fr, dr) = f(p, rl, pl, cl), f(p, rr, pr, cr)
        p = max(p - (fl + fr + ur - ul) / (dl + dr), 1e-8)
    u_star = 0.5 * (ul + ur) + 0.5 * (f(p, rr, pr, cr)[0] - f(p, rl, pl, cl)[0])
    out = np.empty((3, s.size))
    for i, si in enumerate(s):
        sign = 1.0 if si <= u_star else -1.0  # mirror the right side onto the left
        rho, u, pk, c = (rl, ul, pl, cl) if sign > 0 else (rr, -ur, pr, cr)
        x, us = sign * si, sign * u_star
        if p > pk:  # shock at speed u - c sqrt(g2 p*/pk + g1)
            behind = (
                rho
                * (p / pk + (gamma - 1) / (gamma + 1))
                / ((gamma - 1) / (gamma + 1) * p / pk + 1)
            )
            state = (rho, u, pk) if x < u - c * np.sqrt(g2 * p / pk + g1) else (behind, us, p)
        elif x < u - c:
            state = (rho, u, pk)
        elif x > us - c * (p / pk) ** g1:
            state = (rho * (p / pk) ** (1 / gamma), us, p)
        else:  # inside the rarefaction fan
            uf = 2 / (gamma + 1) * (c + (gamma - 1) / 2 * u + x)
            cf = 2 / (gamma + 1) * (c + (gamma - 1) / 2 * (u - x))
            state = (
                rho * (cf / c) ** (2 / (gamma - 1)),
                uf,
                pk * (cf / c) ** (2 * gamma / (gamma - 1)),
            )
        out[:, i] = state[0], sign * state[1], state[2]
    return out


@pytest.mark.parametrize("axis", [0, 1])
def test_euler_sod_shock_tube_matches_the_exact_solution(axis):
    gamma, t = 1.4, 0.2
    errors = []
    for n in (100, 200):
        x = (np.arange(n) + 0.5) / n
        left = x < 0.5
        w = np.stack([np.where(left, 1.0, 0.125), 0 * x, 0 * x, np.where(left, 1.0, 0.1)])
        w0 = w[None, :, :, None] if axis == 0 else w[None][:, [0, 2, 1, 3], None, :]
        q = eu.solve(w0, save_dt=t, steps=2, gamma=gamma)[0, -1]  # (4, Nx, Ny)
        prim = eu.primitive(q[None], gamma)[0].reshape(4, n)  # (rho, u, v, p)
        exact = _exact_riemann((1.0, 0.0, 1.0), (0.125, 0.0, 0.1), gamma, (x - 0.5) / t)
        assert np.abs(prim[2 - axis]).max() < 1e-12  # no flow across the sweep
        errors.append(
            [np.abs(prim[i] - exact[j]).mean() for i, j in ((0, 0), (1 + axis, 1), (3, 2))]
        )
    errors = np.array(errors)  # (resolution, rho/u/p)
    assert errors[1].max() < 0.01 and (errors[1] < 0.7 * errors[0]).all()


@pytest.mark.parametrize("bcs", [("periodic", "periodic"), ("wall", "wall"), ("periodic", "wall")])
def test_euler_conserves_mass_momentum_and_energy_in_a_closed_box(bcs):
    rng = np.random.default_rng(0)
    w0 = eu.quadrant_states(rng, 2, 24, np.full(2, 0.5))
    q = eu.solve(w0, save_dt=0.05, steps=4, bcs=bcs)  # (2, T, 4, N, N)
    totals = q.sum(axis=(3, 4))  # (2, T, 4)
    change = np.abs(totals - totals[:, :1])
    kept = [0, 3] + [1 + a for a, bc in enumerate(bcs) if bc == "periodic"]
    assert change[..., kept].max() < 1e-10 * np.abs(totals).max()
    assert np.abs(q[:, -1] - q[:, 0]).max() > 0.1  # the waves did move
    if "wall" in bcs:  # the pressure on a wall pushes momentum normal to it
        assert change[..., 1 + bcs.index("wall")].max() > 1e-3


def test_euler_open_boundaries_let_waves_leave():
    w0 = eu.quadrant_states(np.random.default_rng(2), 1, 24, np.full(1, 0.5))
    q = eu.solve(w0, save_dt=0.1, steps=4)
    mass = q[:, :, 0].sum(axis=(2, 3))
    assert np.abs(mass[0, -1] / mass[0, 0] - 1) > 1e-3
    with pytest.raises(ValueError, match="unknown boundary types"):
        eu.solve(w0, 0.1, 2, bcs=("open", "outflow"))


# ---------------------------------------------------------------- acoustics


@pytest.mark.parametrize("mode", [(1, 0), (2, 3)])
def test_acoustics_standing_wave_follows_the_discrete_dispersion(mode):
    n, save_dt = 32, 0.05
    x = (np.arange(n) + 0.5) / n
    xx, yy = np.meshgrid(x, x, indexing="ij")
    shape = np.cos(mode[0] * np.pi * xx) * np.cos(mode[1] * np.pi * yy)  # satisfies the walls
    one = np.ones((1, n, n))
    p, u = ac.solve(shape[None], one, one, save_dt, steps=8)
    dt = save_dt / int(np.ceil(save_dt / (0.5 / n)))
    # Stormer-Verlet on an eigenmode of the staggered Laplacian: p = cos(theta t / dt) exactly
    omega = np.hypot(*(2 * n * np.sin(k * np.pi / (2 * n)) for k in mode))
    theta = np.arccos(1 - (dt * omega) ** 2 / 2)
    expected = np.cos(theta / dt * save_dt * np.arange(8))[:, None, None] * shape
    assert np.abs(p[0] - expected).max() < 1e-12
    assert np.abs(expected[-1] - np.cos(np.pi * np.hypot(*mode) * 7 * save_dt) * shape).max() < 0.02
    assert np.abs(u[0]).max() > 0.1


def test_acoustics_walls_keep_the_volume_and_energy_in_a_heterogeneous_box():
    p = {k: np.full(2, v) for k, v in ac.REGIMES["inclusions"].items()}
    sim = ac.simulate(p, 64, 60, np.random.default_rng(0))  # waves reflect off walls and scatter
    rho, c = sim.fields["density"], sim.fields["speed_of_sound"]  # (2, N, N)
    pres, vel = sim.fields["pressure"], sim.vector_fields["velocity"]
    bulk = (rho * c * c)[:, None]
    volume = (pres / bulk).sum(axis=(2, 3))
    assert np.abs(volume - volume[:, :1]).max() < 1e-12 * np.abs(pres).sum()
    potential = 0.5 * (pres**2 / bulk).sum(axis=(2, 3))
    energy = potential + 0.5 * (rho[:, None] * (vel**2).sum(-1)).sum(axis=(2, 3))
    assert np.abs(energy / energy[:, :1] - 1).max() < 0.05
    assert (potential[:, -1] < 0.8 * potential[:, 0]).all()  # energy moved into motion
    assert (np.ptp(rho, axis=(1, 2)) > 0.1).all()
    assert np.abs(pres[:, :, 0, :]).max() > 1e-2  # the waves reached a wall


# ---------------------------------------------------------------- generation and readers


def test_new_systems_are_registered_with_the_released_field_names():
    vocab = set(RELEASED_FIELDS)
    dims = {SYSTEMS[name].n_spatial for name in NEW}
    assert {1, 2} <= dims
    for name, (_, fields) in NEW.items():
        assert name in SYSTEMS and all(f in vocab for f in fields), name


@pytest.mark.parametrize("system", sorted(NEW))
def test_default_generation_reads_with_ours_and_the_wells(tmp_path, system, capsys):
    spec = SYSTEMS[system]
    regime = next(iter(spec.regimes))
    cli([system, "--out", str(tmp_path), "--n-traj", "1,1,1", "--regimes", regime])
    assert "wrote" in capsys.readouterr().out
    bcs, fields = NEW[system]
    path = tmp_path / system / "data" / "train" / f"{system}_{regime}.hdf5"
    wf = WellFile(path)
    assert wf.field_names == fields
    expected = [[int(BoundaryType.parse(b))] * 2 for b in bcs.values()]
    assert wf.bcs.tolist() == expected
    assert wf.n_time == spec.steps and wf.spatial_shape == (spec.resolution,) * spec.n_spatial
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        theirs = TheWellDataset(
            path=str(tmp_path / system), well_split_name="test", n_steps_input=2
        )
        sample = theirs[0]
    assert theirs.metadata.dataset_name == system
    assert theirs.metadata.n_spatial_dims == spec.n_spatial
    assert sample["boundary_conditions"].tolist() == expected
    spatial = (spec.resolution,) * spec.n_spatial
    frames = sample["input_fields"]  # (2, *spatial, C_time_varying)
    constant = sample.get("constant_fields", torch.zeros(*spatial, 0))  # (*spatial, C_constant)
    assert frames.shape[:-1] == (2, *spatial) and constant.shape[:-1] == spatial
    assert frames.shape[-1] + constant.shape[-1] == len(fields)
    assert torch.isfinite(frames).all() and frames.std() > 0


@pytest.mark.parametrize("system", ["burgers_1d", "acoustic_scattering_2d"])
def test_new_system_feeds_a_tiny_model(compose_cfg, tmp_path, system):
    generate(system, tmp_path / "data", n_traj=(2, 1, 1), resolution=32, steps=10, progress=False)
    overrides = tiny_train_overrides(tmp_path / "data", tmp_path / "run")
    cfg = compose_cfg("train", [*overrides, f"data.datasets=[{system}]", "trainer.max_steps=2"])
    metrics, objects = train(cfg)
    assert objects["trainer"].global_step == 2
    assert np.isfinite(metrics["train/loss"]) and np.isfinite(metrics["val/vrmse"])
