"""Fixes for patch seams applied at inference, judged on the VALIDATION split.

For each checkpoint (``NAME=PATH``, e.g. one per training seed) and each candidate
(``--candidates``), rolls every validation trajectory out to its end with the Python API
(:func:`walrus.rollout.rollout`, the checkpoint's default jitter averaging, seeded like
``infer.py rollout``). Candidates (inference only, no training; the model is the same):

- ``none``: neither fix;
- ``filter=CUTOFF[:ORDER]``: the model's spectral filter on its predicted deltas
  (:meth:`~walrus.model.walrus.Walrus.set_output_filter`, order 8 by default);
- ``limit=R``: the rollout's spectral limit (``walrus.rollout(spectral_limit=R)``).

Keeps, per
field and window: VRMSE, the predicted / true power per wavenumber band, the amplitude ratio
and the change correlation, and reads off issue 37's physics criteria per field: high band
at step 1 within 2x of the truth's, low and mid bands within [0.7, 1.4] from step 11::

    python -m benchmarks.studies.seam_fixes --data-dir data \\
        --candidates none filter=0.3:2 limit=1 limit=1.5 demo=outputs/demo/checkpoints/last.ckpt

adds its checkpoints to ``--dataset``'s entry of ``benchmarks/results/<--name>.json`` (default
``seam_fixes``; other datasets and checkpoints there are kept); ``--write`` only renders that
JSON's table onto ``docs/studies.md`` between ``<!-- seam-fixes:start -->`` and
``<!-- seam-fixes:end -->``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.common import RESULTS_DIR
from benchmarks.pages import STUDIES_PAGE, write_between
from benchmarks.record import finish_record, run_record, save_result
from benchmarks.studies.ensemble_candidates import validation_batches
from walrus.inference.loading import load_inference_checkpoint
from walrus.metrics import RolloutMetrics
from walrus.rollout import rollout

MEASURES = ("vrmse", "power_ratio_low", "power_ratio_mid", "power_ratio_high",
            "amplitude_ratio", "change_correlation")  # fmt: skip
BAND = (0.7, 1.4)  # low and mid band power from step 11
HIGH = (0.5, 2.0)  # high band power at step 1


def parse_candidate(text: str) -> tuple[str, float, int, float]:
    """``none``, ``filter=CUTOFF[:ORDER]`` or ``limit=R`` as ``(text, cutoff, order, limit)``."""
    kind, _, value = text.partition("=")
    try:
        if kind == "none" and not value:
            return text, 0.0, 8, 0.0
        if kind == "filter":
            cut, _, order = value.partition(":")
            return text, float(cut), int(order or 8), 0.0
        if kind == "limit":
            return text, 0.0, 8, float(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not none, filter=CUTOFF[:ORDER] or limit=R")


def score(
    path: str, data_dir: str, dataset: str, candidates: Sequence[tuple[str, float, int, float]],
    *, seed: int = 0, steps: int | None = None, batch_size: int = 4,
) -> dict[str, Any]:  # fmt: skip
    """Per candidate: the measures per field and window (``{measure: {field: {window: v}}}``)."""
    ckpt = load_inference_checkpoint(path)
    batches, n_steps, names = validation_batches(
        ckpt, data_dir, dataset, trajectories=None, steps=steps, batch_size=batch_size
    )
    draws = ckpt.default_jitter_average(seed)
    out: dict[str, Any] = {}
    for key, cut, order, limit in candidates:
        ckpt.model.set_output_filter(cut, order)
        acc = RolloutMetrics(names, n_steps)
        for batch in batches:
            last = batch.input_fields[:, -1]  # (B, C, *sp)
            preds = rollout(ckpt, batch, n_steps, jitter_seed=seed, jitter_average=draws,
                            spectral_limit=limit)  # fmt: skip
            for step, pred in enumerate(preds, start=1):
                acc.update(step, pred, batch.output_fields[:, step - 1], last)
        m = acc.to_dict()["model"]
        out[key] = {k: m[k]["windows"] for k in MEASURES}
    return {"checkpoint": path, "trajectories": sum(b.input_fields.shape[0] for b in batches), "steps": n_steps,
            "jitter_average": draws, "by_candidate": out}  # fmt: skip


def verdict(scores: Mapping[str, Any]) -> dict[str, Any]:
    """The per-field physics criteria of one candidate's scores, and the worst field of each."""
    high = {f: w.get("1") for f, w in scores["power_ratio_high"].items()}
    late = [w for w in next(iter(scores["vrmse"].values())) if w not in ("1", "2-10")]
    band = [
        (v, f"{f} {b}")
        for b in ("low", "mid")
        for f, ws in scores[f"power_ratio_{b}"].items()
        for w in late
        if (v := ws.get(w)) is not None
    ]
    off = [(v, f) for f, v in high.items() if v is not None]
    return {
        "high_step1": high,
        "high_step1_worst": max(off, key=lambda t: max(t[0], 1 / t[0])) if off else None,
        "band_worst": max(band, key=lambda t: max(t[0], 1 / t[0])) if band else None,
        "pass_high_step1": all(HIGH[0] <= v <= HIGH[1] for v, _ in off),
        "pass_low_mid": all(BAND[0] <= v <= BAND[1] for v, _ in band),
    }


def aggregate(checkpoints: Mapping[str, Any], key: str) -> dict[str, Any]:
    """One candidate over the checkpoints that ran it: per window the VRMSE (mean over fields
    and checkpoints) and the worst field's VRMSE, the worst field and checkpoint at step 1 in
    the high band and from step 11 in the low and mid bands."""
    runs = {n: r["by_candidate"][key] for n, r in checkpoints.items() if key in r["by_candidate"]}
    vrmse: dict[str, list[float]] = {}
    worst: dict[str, tuple[float, str]] = {}
    for sc in runs.values():
        for f, ws in sc["vrmse"].items():
            for w, x in ws.items():
                if x is not None:
                    vrmse.setdefault(w, []).append(x)
                    worst[w] = max(worst.get(w, (x, f)), (x, f))
    verdicts = {n: verdict(sc) for n, sc in runs.items()}
    highs = [(v["high_step1_worst"], n) for n, v in verdicts.items() if v["high_step1_worst"]]
    bands = [(v["band_worst"], n) for n, v in verdicts.items() if v["band_worst"]]
    off = lambda t: max(t[0][0], 1 / t[0][0])  # noqa: E731
    return {
        "checkpoints": len(runs),
        "vrmse": {w: sum(xs) / len(xs) for w, xs in vrmse.items()},
        "vrmse_worst_field": worst,
        "high_step1_worst": max(highs, key=off) if highs else None,
        "band_worst": max(bands, key=off) if bands else None,
        "pass_high_step1": all(v["pass_high_step1"] for v in verdicts.values()),
    }


def markdown(result: Mapping[str, Any]) -> str:
    """One row per dataset and candidate, over its checkpoints (training seeds): VRMSE per
    window (mean over fields and checkpoints; the worst field in brackets), the high band at
    step 1 furthest from the truth's and the low/mid band power furthest from it from step 11
    (field, checkpoint)."""
    lines = []
    for dataset, entry in result["datasets"].items():
        ckpts = entry["checkpoints"]
        keys = list(dict.fromkeys(k for r in ckpts.values() for k in r["by_candidate"]))
        rows = {k: aggregate(ckpts, k) for k in keys}
        windows = list(rows[keys[0]]["vrmse"])
        if not lines:
            head = ["data", "candidate", "seeds", *[f"VRMSE {w}" for w in windows],
                    "high k at step 1 (worst)", "low/mid power from step 11 (worst)"]  # fmt: skip
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for i, (key, row) in enumerate(rows.items()):
            cells = [dataset if i == 0 else "", key, str(row["checkpoints"])]
            for w in windows:
                x, f = row["vrmse_worst_field"][w]
                cells.append(f"{row['vrmse'][w]:.3g} ({x:.3g} {f})")
            for t in (row["high_step1_worst"], row["band_worst"]):
                cells.append("n/a" if t is None else f"{t[0][0]:.3g} ({t[0][1]}, {t[1]})")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="*", help="NAME=CHECKPOINT pairs")
    p.add_argument("--data-dir")
    p.add_argument("--dataset", default="navier_stokes_2d")
    p.add_argument("--candidates", type=parse_candidate, nargs="+",
                   default=[parse_candidate(c) for c in ("none", "limit=1")],
                   help="none, filter=CUTOFF[:ORDER] or limit=R")  # fmt: skip
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="jitter seed of the rollouts")
    p.add_argument("--train", default=None,
                   help="the command that trained the checkpoints (kept in the JSON)")  # fmt: skip
    p.add_argument("--name", default="seam_fixes")
    p.add_argument("--write", action="store_true", help="only render the JSON onto the docs")
    args = p.parse_args(argv)
    path = RESULTS_DIR / f"{args.name}.json"
    if args.write:
        saved = json.loads(path.read_text())
        print(f"wrote {write_between(STUDIES_PAGE, 'seam-fixes', markdown(saved))}")
        return saved
    if not args.checkpoints or not args.data_dir:
        p.error("give --data-dir and NAME=CHECKPOINT pairs (or --write)")
    record = run_record(sys.argv if argv is None else ["seam_fixes", *argv])
    out = json.loads(path.read_text()) if path.is_file() else {"split": "valid", "datasets": {}}
    entry = out["datasets"].setdefault(args.dataset, {"checkpoints": {}, "records": []})
    for item in args.checkpoints:
        name, _, ckpt = item.partition("=")
        res = score(ckpt, args.data_dir, args.dataset, args.candidates, seed=args.seed,
                    steps=args.steps)  # fmt: skip
        res["train"] = args.train
        for key, sc in res["by_candidate"].items():
            v = verdict(sc)
            vr = {f: {w: round(x, 4) for w, x in ws.items()} for f, ws in sc["vrmse"].items()}
            print(name, key, "vrmse", vr)
            print("   high@1", {f: round(x, 2) for f, x in v["high_step1"].items() if x},
                  "band worst", v["band_worst"], flush=True)  # fmt: skip
        entry["checkpoints"][name] = res
    entry["records"].append(finish_record(record))
    save_result(args.name, out)
    print(markdown(out))
    return out


if __name__ == "__main__":
    main()
