"""The sample-efficiency mode of benchmarks.transfer: the data-efficiency factor, the rate grid,
the summary and its tables, the refusals and an end-to-end smoke run."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import pages, transfer
from benchmarks import sample_efficiency as se
from benchmarks import transfer_sample_efficiency as tse
from walrus.data.synthetic import generate

# ---------------------------------------------------------------------- data-efficiency factor


def test_a_power_law_curve_is_read_exactly_by_log_log_interpolation():
    ns = [1, 2, 4, 8, 24]
    scratch = [n**-0.5 for n in ns]
    m = se.match_trajectories(ns, scratch, 6**-0.5)
    assert m["bound"] == "interpolated" and m["trajectories"] == pytest.approx(6.0)
    f = se.efficiency_factor(ns, scratch, 12**-0.5, reference=2)
    assert f["trajectories"] == pytest.approx(12.0) and f["factor"] == pytest.approx(6.0)
    # a target on a grid point is that point
    assert se.match_trajectories(ns, scratch, 4**-0.5)["trajectories"] == pytest.approx(4.0)


def test_a_curve_that_is_not_monotone_counts_its_first_crossing():
    ns, scratch = [1, 2, 4, 8], [1.0, 0.5, 0.7, 0.3]
    first = se.match_trajectories(ns, scratch, 0.6)
    assert first["bound"] == "interpolated"
    assert first["trajectories"] == pytest.approx(2 ** (math.log(0.6) / math.log(0.5)))
    # 0.4: scratch passes it only between 4 and 8, after going back up
    later = se.match_trajectories(ns, scratch, 0.4)
    expected = math.exp(math.log(4) + math.log(0.4 / 0.7) / math.log(0.3 / 0.7) * math.log(2))
    assert later["trajectories"] == pytest.approx(expected) and 4 < expected < 8


def test_scratch_that_never_matches_is_more_than_all_and_one_that_starts_there_is_at_most():
    ns = [1, 2, 4, 8, 24]
    never = se.efficiency_factor(ns, [0.9, 0.8, 0.7, 0.6, 0.5], 0.4, reference=2)
    assert never == {"trajectories": None, "bound": "more than all", "factor": None}
    assert se.factor_cell(never) == "more than all"
    early = se.efficiency_factor(ns, [0.3, 0.2, 0.2, 0.1, 0.1], 0.4, reference=2)
    assert early == {"trajectories": 1.0, "bound": "at most", "factor": 0.5}
    assert se.factor_cell(early) == "≤ 0.5× (1 traj.)"
    # missing points are skipped; no target is n/a
    gap = se.match_trajectories([1, 2, 4], [0.8, None, 0.2], 0.4)
    assert gap["trajectories"] == pytest.approx(2.0)
    assert se.match_trajectories(ns, [0.5] * 5, None)["bound"] == "n/a"


# ---------------------------------------------------------------------- rate grid


def test_the_grid_edges_and_widening():
    grid = [1e-3, 3e-3, 1e-2]
    assert (se.edge(1e-3, grid), se.edge(3e-3, grid), se.edge(1e-2, grid)) == ("low", None, "high")
    wide = se.widen(grid)
    assert wide == pytest.approx([1e-3 / 3, 1e-3, 3e-3, 1e-2, 1e-2 * (1e-2 / 3e-3)])
    assert se.widen([1e-3]) == pytest.approx([1e-3 / 3, 1e-3, 3e-3])


def _trainer(best_lr):
    """A fake ``train(side, lr)`` whose validation score is lowest at ``best_lr[side]``; it
    records every run it is asked for."""
    calls = []

    def train(side, lr):
        calls.append((side, lr))
        return {"best": {"val": abs(math.log(lr / best_lr[side]))}, "steps": 4}

    return train, calls


def test_both_sides_choose_on_one_grid_and_an_edge_choice_is_flagged():
    train, calls = _trainer({"finetune": 3e-3, "scratch": 1e-1})
    point = se_point = tse.choose_rates(train, [1e-3, 3e-3, 1e-2], False, 3)
    assert point["finetune"]["lr"] == 3e-3 and point["finetune"]["at_edge"] is None
    assert se_point["scratch"]["lr"] == 1e-2 and point["scratch"]["at_edge"] == "high"
    assert point["widened"] == 0 and len(calls) == 6
    assert set(point["scratch"]["val_by_lr"]) == {"0.001", "0.003", "0.01"}


def test_widening_reruns_until_neither_choice_is_at_the_edge():
    train, calls = _trainer({"finetune": 3e-4, "scratch": 3e-2})
    point = tse.choose_rates(train, [1e-3, 3e-3, 1e-2], True, 3)
    assert point["widened"] == 2 and len(point["grid"]) == 7
    # the nearest rates of the twice-widened grid, now inside it
    assert (
        point["finetune"]["lr"] == pytest.approx(1e-3 / 3) and point["finetune"]["at_edge"] is None
    )
    assert point["scratch"]["lr"] == pytest.approx(1e-2 * 10 / 3)
    assert point["scratch"]["at_edge"] is None
    assert len(calls) == len(set(calls)) == 2 * 7  # each rate trained once per side
    capped = tse.choose_rates(_trainer({"finetune": 1.0, "scratch": 1e-3})[0], [1e-3], True, 1)
    assert capped["widened"] == 1 and capped["finetune"]["at_edge"] == "high"


# ---------------------------------------------------------------------- summary and tables


def _side(v1, v2):
    return {"test": {"model": {"vrmse": {"1": v1, "2-10": v2}}}, "at_edge": None}


def _run(held, group, seed, ft, scratch, matched=None):
    """A sample-efficiency run record: ``ft`` / ``scratch`` map N to the window-1 VRMSE
    (window 2-10 is twice it)."""
    run = {
        "held_out": held,
        "group": group,
        "seed": seed,
        "train_trajectories_all": 16,
        "curve": {
            n: {"finetune": _side(ft[n], 2 * ft[n]), "scratch": _side(scratch[n], 2 * scratch[n])}
            for n in ft
        },
    }
    if matched is not None:
        run["compute_matched"] = {"test": {"model": {"vrmse": {"1": matched, "2-10": matched}}}}
    return run


GRID = ["1", "2", "4", "8", "all"]
FT = dict(zip(GRID, [0.5, 0.4, 0.3, 0.25, 0.2]))
SCRATCH = {n: 1.6 * (16 if n == "all" else int(n)) ** -1.0 for n in GRID}  # 1.6 / N


def _data():
    runs = [
        _run("navier_stokes_2d", "2D", 0, FT, SCRATCH, matched=0.5),
        _run("navier_stokes_2d", "2D", 1, FT, SCRATCH, matched=0.3),
        _run("gray_scott_pypde", "near", 0, FT, {n: 0.3 for n in GRID}),
    ]
    runs[0]["curve"]["2"]["scratch"]["at_edge"] = "high"
    args = {"seeds": [0, 1], "pretrain_time": 1800.0, "finetune_steps": [300], "val_every": 25}
    args |= {"lrs": [1e-3, 3e-3, 1e-2], "widen_grid": True, "reference_n": 2}
    return {
        "runs": runs,
        "summary": se.summarize(runs, 2),
        "args": args,
        "record": {"commit": "abc", "started": "then"},
    }


def test_the_summary_reads_the_factor_from_the_seed_mean_curves():
    s = _data()["summary"]["navier_stokes_2d"]
    assert s["trajectories"] == {"1": 1, "2": 2, "4": 4, "8": 8, "all": 16}
    assert s["curve"]["2"]["ratio"]["1"] == pytest.approx(0.4 / 0.8)
    assert s["curve"]["2"]["ratio_by_seed"] == [{"1": 0.5, "2-10": 0.5}] * 2
    # scratch = 1.6 / N reaches the fine-tuned 0.4 at N = 4: twice the reference N
    assert s["factor"]["1"]["trajectories"] == pytest.approx(4.0)
    assert s["factor"]["1"]["factor"] == pytest.approx(2.0)
    assert [f["1"]["factor"] for f in s["factor_by_seed"]] == pytest.approx([2.0, 2.0])
    assert s["ft_over_compute_matched"]["1"] == pytest.approx(0.4 / 0.4)
    assert s["at_edge"] == [{"seed": 0, "n": "2", "side": "scratch", "edge": "high"}]
    near = _data()["summary"]["gray_scott_pypde"]
    assert near["factor"]["1"]["bound"] == "at most" and near["ft_over_compute_matched"] is None


def test_the_table_and_the_readme_headline():
    data = _data()
    table = se.render_table(data)
    assert table.startswith("| held out | set | row | 1 | 2-10 |\n|---|---|---|---|---|\n")
    assert "| navier_stokes_2d | 2D | fine-tuned / scratch, N=2 | 0.50 | 0.50 |" in table
    assert "| navier_stokes_2d | 2D | fine-tuned / scratch, N=all (16) | 2.00 | 2.00 |" in table
    assert "| navier_stokes_2d | 2D | data-efficiency factor (N=2) | 2× (4 traj.) |" in table
    assert "| navier_stokes_2d | 2D | fine-tuned N=2 / compute-matched scratch | 1.00 |" in table
    assert "| gray_scott_pypde | near | data-efficiency factor (N=2) | ≤ 0.5× (1 traj.) |" in table
    assert "1 choice(s) left at the grid's edge; commit abc" in table
    head = se.headline(data).splitlines()
    assert head[2] == "| 1 | 0.50 / 0.50 | 2× | 2.00 |"
    assert se.headline({"summary": {}}) == se.not_run()


def test_pages_get_the_rendering_or_the_not_run_note(tmp_path):
    page, readme = tmp_path / "results.md", tmp_path / "README.md"
    for path, name in ((page, se.TABLE), (readme, se.HEADLINE)):
        start, end = pages.markers(name)
        path.write_text(f"before\n{start}\nold\n{end}\nafter\n")
    se.render_pages(None, page, readme)
    assert pages.between(page.read_text(), se.TABLE) == se.not_run()
    assert se.COMMAND in pages.between(readme.read_text(), se.HEADLINE)
    data = _data()
    se.render_pages(data, page, readme)
    assert pages.between(page.read_text(), se.TABLE) == se.render_table(data)
    assert pages.between(readme.read_text(), se.HEADLINE) == se.headline(data)
    assert readme.read_text().startswith("before\n") and readme.read_text().endswith("after\n")


def test_the_results_page_and_readme_match_the_saved_json():
    path = transfer.RESULTS_DIR / f"{se.NAME}.json"
    data = json.loads(path.read_text()) if path.is_file() else None
    results = pages.RESULTS_PAGE.read_text()
    readme = pages.README.read_text()
    assert pages.between(results, se.TABLE) == (se.render_table(data) if data else se.not_run())
    assert pages.between(readme, se.HEADLINE) == (se.headline(data) if data else se.not_run())


# ---------------------------------------------------------------------- refusals and smoke run


def _tiny_root(tmp_path):
    root = tmp_path / "data"
    for system in ("navier_stokes_2d", "gray_scott_2d"):
        generate(system, root, n_traj=(2, 1, 1), resolution=32, steps=12, progress=False)
    return root


TINY = [
    "model=tiny",
    "trainer=cpu",
    "data.batch_size=2",
    "data.max_val_windows=2",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "logger=csv",
]


def _args(root, tmp_path, *extra):
    args = ["--sample-efficiency", "--systems", "navier_stokes_2d,gray_scott_2d"]
    args += ["--held-out", "gray_scott_2d", "--data-root", str(root), "--seeds", "0"]
    args += ["--results-dir", str(tmp_path / "res"), "--min-test-trajectories", "1"]
    args += ["--work-dir", str(tmp_path / "work"), "--pretrain-time", "3"]
    return [*args, *extra, *(f"--override={o}" for o in TINY)]


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--trajectories", "2,4", "--finetune-steps", "4", "--val-every", "2"],
            "--trajectories asks for 4 train trajectories; the train split holds 2",
        ),
        (
            ["--trajectories", "1,2", "--finetune-steps", "5", "--val-every", "2"],
            "--val-every 2 must divide the step cap --finetune-steps 5",
        ),
        (
            ["--trajectories", "1,all", "--finetune-steps", "4", "--val-every", "2"],
            "--reference-n 2 is not in --trajectories 1,all",
        ),
        (["--trajectories", "2,1"], "the trajectory counts must increase"),
    ],
)
def test_a_setup_that_cannot_run_is_refused_in_one_line(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        transfer.main(_args(_tiny_root(tmp_path), tmp_path, *extra))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    # argparse's own refusals put the usage above the line
    assert message in err[-1] and (len(err) == 1 or err[0].startswith("usage:"))
    assert not (tmp_path / "res").exists() and not (tmp_path / "work").exists()


@pytest.mark.slow
def test_sample_efficiency_smoke(tmp_path):
    root = _tiny_root(tmp_path)
    extra = ["--finetune-steps", "4", "--val-every", "2", "--trajectories", "1,2"]
    data = transfer.main(_args(root, tmp_path, *extra, "--lrs", "1e-3,3e-3"))
    saved = json.loads((tmp_path / "res" / f"{se.NAME}.json").read_text())
    assert saved["summary"] == data["summary"]
    (run,) = saved["runs"]
    assert run["group"] == "2D" and run["train_trajectories_all"] == 2
    assert run["pretrain"]["systems"] == ["navier_stokes_2d"] and run["pretrain"]["cpu_s"] > 0
    assert list(run["curve"]) == ["1", "2"]
    for n, point in run["curve"].items():
        assert point["grid"] == [1e-3, 3e-3]
        for side in ("finetune", "scratch"):
            m = point[side]
            # the best-validation checkpoint within the cap, validated every 2 steps
            assert m["steps"] == 4 and m["best"]["step"] in (2, 4)
            assert m["best"]["monitor"] == "val/rollout_vrmse"
            assert m["best"]["val"] == min(m["val_by_lr"].values())
            assert m["at_edge"] in ("low", "high")  # a grid of two rates has no middle
            assert m["test"]["model"]["vrmse"]["1"] > 0
        config = (tmp_path / "work" / "gray_scott_2d" / "seed_0" / f"n{n}").glob("*/config.yaml")
        assert all(f"train_trajectories: {n}" in c.read_text() for c in config)
    matched = run["compute_matched"]
    budget = run["pretrain"]["cpu_s"] + run["curve"]["2"]["finetune"]["cpu_s"]
    assert matched["cpu_budget_s"] == pytest.approx(budget) and matched["trajectories"] == 2
    assert "persistence" in run
    summary = saved["summary"]["gray_scott_2d"]
    assert set(summary["factor"]) == set(summary["windows"])
    assert len(summary["at_edge"]) == 4


def test_held_out_sets_are_grouped_by_dimension_and_near_is_apart(tmp_path, capsys):
    assert [tse.group_of(n) for n in ("burgers_1d", "gray_scott_2d")] == ["1D", "2D"]
    assert tse.group_of("advection_diffusion_3d") == "3D"
    assert tse.group_of("gray_scott_pypde", near=True) == "near"
    assert tse.group_of("gray_scott_pypde") == "external"
    root = _tiny_root(tmp_path)
    args = _args(root, tmp_path, "--near", str(root / "gray_scott_2d"))[1:]
    with pytest.raises(SystemExit):
        transfer.main(args)
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("--near is for --sample-efficiency; hold the set out with --dataset")
    )
