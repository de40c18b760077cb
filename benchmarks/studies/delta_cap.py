"""How the delta unit of a rollout decides its stability: one checkpoint, several rollout modes.

``python -m benchmarks.studies.delta_cap CKPT [--root DATA] [--dataset NAME] [--name delta_cap]``

Rolls every test trajectory of the checkpoint's dataset out to its end, in these modes:

- ``window``: each step's delta unit is refitted on its window (the rollout's own frames);
- ``capped``: the same, capped at the true context window's unit (``walrus.rollout``'s default);
- ``fixed``: the true context window's unit for every step;
- ``capped+jitter``: capped, with inference jitter (seed 0).

It prints windowed VRMSE per field against persistence and writes
``benchmarks/results/<name>.json``: :func:`benchmarks.harness.evaluate`'s scores (one-step and
windowed rollout VRMSE, fidelity measures) per mode. Modes are compared on the test split of a
checkpoint already trained; nothing is chosen here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from benchmarks.common import print_table
from benchmarks.harness import DatasetRef, Forecaster, evaluate
from benchmarks.record import finish_record, portable_path, run_record, save_result
from walrus.data.batch import Batch
from walrus.data.normalization import NormStats
from walrus.inference.loading import load_inference_checkpoint

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


class FixedUnitForecaster(Forecaster):
    """A forecaster with a :class:`FixedDeltaUnit` normaliser that restarts with each rollout."""

    def rollout(self, batch: Batch, steps: int) -> Iterator[Tensor]:
        """As :meth:`Forecaster.rollout`, with the unit of this batch's true context window."""
        self.normalizer.first = None
        yield from super().rollout(batch, steps)


def forecasters(ckpt: Any) -> dict[str, Forecaster]:
    """One :class:`~benchmarks.harness.Forecaster` per rollout mode of ``MODES``."""
    out = {}
    for mode in MODES:
        fixed = mode == "fixed"
        out[mode] = (FixedUnitForecaster if fixed else Forecaster)(
            ckpt.model,
            FixedDeltaUnit(ckpt.normalizer) if fixed else ckpt.normalizer,
            ckpt.predict_delta,
            jitter_seed=0 if mode.endswith("jitter") else None,
            cap_delta_unit=mode not in ("window", "fixed"),
        )
    return out


def run(ckpt_path: str, root: str | None, dataset: str | None) -> dict[str, Any]:
    """Score every mode and persistence on the test split (:func:`benchmarks.harness.evaluate`)."""
    ckpt = load_inference_checkpoint(ckpt_path)
    data = ckpt.data_config
    root = root or data["root"]
    spec = dataset or data["datasets"][0]
    name = spec if isinstance(spec, str) else spec["name"]
    result = evaluate(
        DatasetRef(Path(root), name),
        forecasters(ckpt),
        split="test",
        n_steps_input=int(data.get("n_steps_input", 4)),
        time_stride=data.get("time_stride", 1),
        vocab=ckpt.vocab,
    )
    return {"checkpoint": portable_path(ckpt_path), "dataset": name, **result}


def main() -> None:
    record = run_record(sys.argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("--root", help="data root (default: the checkpoint's)")
    parser.add_argument("--dataset", help="dataset name (default: the checkpoint's first)")
    parser.add_argument("--name", default="delta_cap", help="results file stem")
    args = parser.parse_args()
    out = run(args.ckpt, args.root, args.dataset)
    out["record"] = finish_record(record)
    rows = [
        {"mode": mode, "field": f, **out["models"][mode]["rollout"]["per_field"][f]}
        for mode in ("persistence", *MODES)
        for f in out["fields"]
    ]
    print_table(rows)
    print(f"wrote {save_result(args.name, out)}")


if __name__ == "__main__":
    main()
