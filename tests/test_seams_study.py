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
