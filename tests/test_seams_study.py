"""benchmarks/studies/jitter_average_seams.py reads rollout metrics the way infer.py writes them."""

from __future__ import annotations

import pytest

from benchmarks.studies.jitter_average_seams import summarise


def test_worst_factor_counts_too_little_power_as_much_as_too_much():
    def high(ratios):
        return {
            "windows": {f: {"1": r, "2-3": 1.0} for f, r in ratios.items()},
            "mean_over_fields": {"windows": {"1": sum(ratios.values()) / 2, "2-3": 1.0}},
        }

    vrmse = {"mean_over_fields": {"windows": {"1": 0.1, "2-3": 0.2}}}
    metrics = {
        "datasets": {
            "ns": {
                "metrics": {
                    "model": {"power_ratio_high": high({"u": 0.25, "v": 3.0}), "vrmse": vrmse}
                }
            }
        }
    }
    row = summarise(metrics)["ns"]
    assert row["worst_factor_step1"] == pytest.approx(4.0)  # u at 1/4 is further off than v at 3
    assert row["power_ratio_high"]["v"]["1"] == 3.0
    assert row["vrmse"] == {"1": 0.1, "2-3": 0.2}


def _scores(high: dict[str, float], vrmse: float, mid: float) -> dict:
    windows = ("1", "2-10", "11-30")
    return {
        "vrmse": {f: {w: vrmse for w in windows} for f in high},
        "power_ratio_low": {f: {w: 1.0 for w in windows} for f in high},
        "power_ratio_mid": {f: {"1": 1.0, "2-10": 9.0, "11-30": mid} for f in high},
        "power_ratio_high": {f: {"1": r, "2-10": 1.0, "11-30": 1.0} for f, r in high.items()},
        "amplitude_ratio": {f: {w: 1.0 for w in windows} for f in high},
        "change_correlation": {f: {w: 1.0 for w in windows} for f in high},
    }


def test_seam_fixes_study_reads_the_worst_field_and_seed_per_candidate():
    import argparse

    from benchmarks.studies.seam_fixes import aggregate, markdown, parse_candidate, verdict

    assert parse_candidate("none") == ("none", 0.0, 8, 0.0)
    assert parse_candidate("filter=0.3:2") == ("filter=0.3:2", 0.3, 2, 0.0)
    assert parse_candidate("limit=1.5") == ("limit=1.5", 0.0, 8, 1.5)
    for bad in ("limit", "filter=a", "cap=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not none"):
            parse_candidate(bad)
    one = verdict(_scores({"u": 0.4, "v": 1.9}, 0.1, 1.2))
    assert one["high_step1_worst"] == (0.4, "u")  # 1/0.4 = 2.5 is further off than 1.9
    assert not one["pass_high_step1"] and one["pass_low_mid"]  # step 2-10 is not judged
    ckpts = {
        "seed0": {"by_candidate": {"none": _scores({"u": 3.0}, 0.2, 1.0)}},
        "seed1": {"by_candidate": {"none": _scores({"u": 1.5}, 0.4, 0.5)}},
    }
    row = aggregate(ckpts, "none")
    assert row["checkpoints"] == 2 and row["vrmse"]["1"] == pytest.approx(0.3)
    assert row["high_step1_worst"] == ((3.0, "u"), "seed0")
    assert row["band_worst"] == ((0.5, "u mid"), "seed1")
    assert not row["pass_high_step1"]
    table = markdown({"datasets": {"ns": {"checkpoints": ckpts}}})
    assert "| ns | none | 2 | 0.3 (0.4 u) |" in table and "3 (u, seed0)" in table
