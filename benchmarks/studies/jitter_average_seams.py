"""Patch seams against jitter averaging: high-band power at step 1, per field, on validation.

For each ``jitter_average`` value, rolls a checkpoint out on the VALIDATION split
(``infer.py rollout split=valid steps=--steps``, plots and predictions written to a temporary
folder) and keeps, per field and mean over fields, the predicted / true power ratio in the high
wavenumber band at step 1 and over steps 2..N, with the rollout VRMSE of the same windows. The
target of the seams work is a step-1 high-band ratio within 2x of the truth's for every field
(between 0.5 and 2). Inference only: no training, the checkpoint is fixed::

    python -m benchmarks.studies.jitter_average_seams outputs/demo/checkpoints/last.ckpt \\
        --values 1 4 16 64 paths.data_dir=data

writes ``benchmarks/results/<--name>.json`` (default ``jitter_average_seams``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.record import finish_record, run_record, save_result

REPO = Path(__file__).resolve().parents[2]


def summarise(metrics: dict[str, Any]) -> dict[str, Any]:
    """Per dataset: the high-band power ratio per field and window, its mean over fields, the
    largest factor off 1 over fields at step 1, and the model's VRMSE per window."""
    out = {}
    for name, entry in metrics["datasets"].items():
        m = entry["metrics"]
        high = m["model"]["power_ratio_high"]
        step1 = [w["1"] for w in high["windows"].values() if w.get("1") is not None]
        out[name] = {
            "power_ratio_high": high["windows"],
            "power_ratio_high_mean": high["mean_over_fields"]["windows"],
            "worst_factor_step1": max(max(r, 1 / r) for r in step1) if step1 else None,
            "vrmse": m["model"]["vrmse"]["mean_over_fields"]["windows"],
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a walrus checkpoint")
    parser.add_argument("--values", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--steps", type=int, default=10, help="rollout steps (default 10)")
    parser.add_argument("--name", default="jitter_average_seams")
    parser.add_argument("overrides", nargs="*", help="infer.py overrides, e.g. paths.data_dir=DIR")
    args = parser.parse_intermixed_args(argv)
    record = run_record(sys.argv if argv is None else ["jitter_average_seams", *argv])
    runs = {}
    with tempfile.TemporaryDirectory(prefix="walrus-seams-") as tmp:
        for n in args.values:
            out = Path(tmp) / f"ja{n}"
            cmd = [sys.executable, "infer.py", "rollout", f"ckpt_path={args.ckpt}", "split=valid"]
            cmd += [f"steps={args.steps}", f"jitter_average={n}", f"out={out}", *args.overrides]
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"jitter_average={n} failed: {done.stderr.strip()[-500:]}")
            runs[str(n)] = summarise(json.loads((out / "metrics.json").read_text()))
            print(n, json.dumps(runs[str(n)]), flush=True)
    result = {"checkpoint": args.ckpt, "steps": args.steps, "split": "valid", "runs": runs}
    result["record"] = finish_record(record)
    print(f"saved {save_result(args.name, result)}")
    return result


if __name__ == "__main__":
    main()
