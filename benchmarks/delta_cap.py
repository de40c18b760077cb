"""How the delta unit of a rollout decides its stability: one checkpoint, several rollout modes.

``python -m benchmarks.delta_cap CKPT [--root DATA] [--dataset NAME] [--name delta_cap]``

Rolls every test trajectory of the checkpoint's dataset out to its end, in these modes:

- ``window``: each step's delta unit is refitted on its window (the rollout's own frames);
- ``capped``: the same, capped at the true context window's unit (``walrus.rollout``'s default);
- ``fixed``: the true context window's unit for every step;
- ``capped+jitter``: capped, with inference jitter (seed 0).

It prints windowed VRMSE per field against persistence and writes
``benchmarks/results/<name>.json`` with the checkpoint's training config next to the figures.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from benchmarks.common import print_table, save_json
from walrus import metrics
from walrus.data.batch import collate
from walrus.data.normalization import NormStats
from walrus.data.well_dataset import WellDataset
from walrus.inference.loading import load_inference_checkpoint
from walrus.rollout import rollout

MODES = ("window", "capped", "fixed", "capped+jitter")


class FixedDeltaUnit:
    """A normaliser whose delta unit is the one of the first window it is fitted on."""

    def __init__(self, base: Any) -> None:
        self.base, self.first = base, None

    def fit(self, x: Tensor, field_names: Sequence[str] | None = None) -> NormStats:
        stats = self.base.fit(x, field_names)
        if self.first is None:
            self.first = stats
        stats.delta_scale, stats.delta_shift = self.first.delta_scale, self.first.delta_shift
        return stats


def _windows(per_step: Tensor, names: Sequence[str]) -> dict[str, dict[str, float]]:
    """``(S, C)`` per-step values -> field -> window -> mean."""
    means = metrics.window_means(per_step)
    return {f: {w: float(v[c]) for w, v in means.items()} for c, f in enumerate(names)}


def run(ckpt_path: str, root: str | None, dataset: str | None) -> dict[str, Any]:
    ckpt = load_inference_checkpoint(ckpt_path)
    data = ckpt.data_config
    root = root or data["root"]
    spec = dataset or data["datasets"][0]
    name = spec if isinstance(spec, str) else spec["name"]
    ds = WellDataset(
        root, name, "test", n_steps_input=data.get("n_steps_input", 4), vocab=ckpt.vocab
    )
    batch = collate([ds.trajectory(i) for i in range(ds.n_trajectories)])
    truth = batch.output_fields.float()  # (B, S, C, *sp)
    steps = truth.shape[1]

    def score(frames: Tensor) -> dict[str, dict[str, float]]:  # frames (B, S, C, *sp)
        per_step = torch.stack(
            [metrics.vrmse(frames[:, s], truth[:, s]).mean(0) for s in range(steps)]
        )
        return _windows(torch.nan_to_num(per_step, nan=float("inf")), ds.field_names)

    last = batch.input_fields[:, -1:].float().expand_as(truth)  # (B, S, C, *sp)
    results = {"persistence": score(last)}
    for mode in MODES:
        kwargs: dict[str, Any] = {"normalizer": ckpt.normalizer, "check_finite": False}
        if mode == "window":
            kwargs["cap_delta_unit"] = False
        elif mode == "fixed":
            kwargs["normalizer"] = FixedDeltaUnit(ckpt.normalizer)
            kwargs["cap_delta_unit"] = False
        if mode.endswith("jitter"):
            kwargs["jitter_seed"] = 0
        preds = rollout(ckpt.model, batch, steps, predict_delta=ckpt.predict_delta, **kwargs)
        results[mode] = score(torch.stack(list(preds), dim=1))
    return {
        "checkpoint": str(ckpt_path),
        "dataset": name,
        "test_trajectories": ds.n_trajectories,
        "rollout_steps": steps,
        "fields": list(ds.field_names),
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("--root", help="data root (default: the checkpoint's)")
    parser.add_argument("--dataset", help="dataset name (default: the checkpoint's first)")
    parser.add_argument("--name", default="delta_cap", help="results file stem")
    args = parser.parse_args()
    load, t0 = os.getloadavg(), time.perf_counter()
    out = run(args.ckpt, args.root, args.dataset)
    out["loadavg_before"], out["wall_s"] = list(load), time.perf_counter() - t0
    rows = [
        {"mode": mode, "field": f, **out["results"][mode][f]}
        for mode in ("persistence", *MODES)
        for f in out["fields"]
    ]
    print_table(rows)
    print(f"wrote {save_json(args.name, out)}")


if __name__ == "__main__":
    main()
