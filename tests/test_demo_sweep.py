"""benchmarks.studies.demo_sweep: what it reads from a rollout's metrics.json and how it averages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.studies.demo_sweep import MEASURES, main, summarise, table

WINDOWS = ["1", "2-10", "11-30"]


def _metrics(tmp_path: Path, scale: float, amp_steps: list[float]) -> Path:
    model = {
        key: {"mean_over_fields": {"windows": {w: scale * (i + 1) for i, w in enumerate(WINDOWS)}}}
        for key in MEASURES.values()
    }
    model["amplitude_ratio"]["mean_over_fields"]["per_step"] = amp_steps
    data = {"datasets": {"navier_stokes_2d": {"metrics": {"model": model}}}}
    path = tmp_path / f"m{scale}.json"
    path.write_text(json.dumps(data))
    return path


def test_summarise_and_table_average_over_seeds(tmp_path: Path) -> None:
    a = summarise(_metrics(tmp_path, 1.0, [0.9, None, 1.2]))
    assert a["vrmse 11-30"] == 3.0 and a["corr 1"] == 1.0 and a["hik 2-10"] == 2.0
    assert (a["amp min"], a["amp max"]) == (0.9, 1.2)  # undefined steps skipped
    b = summarise(_metrics(tmp_path, 3.0, [1.0, 1.1]))
    runs = [
        {"candidate": "base", "seed": s, "jitter_average": 4, **r} for s, r in enumerate((a, b))
    ]
    runs.append({"candidate": "base", "seed": 0, "jitter_average": 1, **a})
    rows = table({"runs": runs})
    assert [(r["candidate"], r["K"], r["seeds"]) for r in rows] == [("base", 1, 1), ("base", 4, 2)]
    assert rows[1]["vrmse 1"] == pytest.approx(2.0) and rows[1]["amp max"] == pytest.approx(1.15)


def test_bad_candidate_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--data-dir", str(tmp_path), "--candidate", "x=${oops}"])


def test_markdown_table_rows_per_candidate_and_k(tmp_path: Path) -> None:
    from benchmarks.studies.demo_sweep import markdown

    a = summarise(_metrics(tmp_path, 1.0, [1.0]))
    result = {
        "candidates": {"base": [], "wide": ["model.dim=192"]},
        "runs": [
            {"candidate": "base", "seed": 0, "jitter_average": 4, **a},
            {"candidate": "wide", "seed": 0, "jitter_average": 1, **a},
        ],
    }
    lines = markdown(result).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| candidate | overrides |")
    assert lines[2].startswith("| base | - | 4 | 1 | 1 |")
    assert lines[3].startswith("| wide | `model.dim=192` | 1 | 1 |")
    assert "n/a" in lines[2]  # a window the runs lack (31-60)


def test_rollout_data_dir_rolls_out_existing_checkpoints_there(tmp_path: Path, monkeypatch) -> None:
    """A run folder that holds last.ckpt is not retrained; its rollout reads --rollout-data-dir
    (validation split), and the JSON names that root without its absolute path."""
    import benchmarks.studies.demo_sweep as sweep

    ckpt = tmp_path / "work" / "base-s0" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"")
    commands: list[list[str]] = []

    def fake_run(cmd: list[str], log: Path, threads: int) -> float:
        commands.append(cmd)
        out = Path(next(a for a in cmd if a.startswith("out="))[4:])
        out.mkdir(parents=True)
        (out / "metrics.json").write_text(_metrics(tmp_path, 1.0, [1.0]).read_text())
        return 1.0

    monkeypatch.setattr(sweep, "_run", fake_run)
    big = tmp_path / "valid16"
    main(["--data-dir", str(tmp_path / "data"), "--rollout-data-dir", str(big),
          "--work-dir", str(tmp_path / "work"), "--jitter-average", "4", "--name", "x",
          "--results-dir", str(tmp_path / "results")])  # fmt: skip
    assert len(commands) == 1 and commands[0][1] == "infer.py"  # no training
    assert "split=valid" in commands[0] and f"paths.data_dir={big}" in commands[0]
    assert f"out={ckpt.parents[1] / 'valid_valid16_k4'}" in commands[0]  # beside, not over
    result = json.loads((tmp_path / "results" / "x.json").read_text())
    assert result["rollout_data"] == "valid16"
    assert [(r["candidate"], r["jitter_average"], r["vrmse 1"]) for r in result["runs"]] == [
        ("base", 4, 1.0)
    ]
