"""Ensemble candidates on the VALIDATION split: calibration, sharpness and seams per checkpoint.

For each checkpoint (a training candidate: CRPS training with latent noise, decoder smoothing,
the deterministic recipe, ...) and each inference seed, rolls the first ``--trajectories``
validation trajectories out three ways with the Python API (:mod:`walrus.rollout`):

- ``ensemble``: ``--members`` members (each averaging ``--member-jitter-average`` jitter draws
  per step, default 1; a noisy model's draws share the member's latent noise), scored as ``infer.py rollout ensemble=K`` scores it
  (spread-skill ratio corrected for K, fair CRPS over the truth's spread, rank histograms) plus
  the VRMSE of the ensemble mean;
- ``member``: member 0 alone, for its sharpness: power ratio per wavenumber band and field
  (1 is the truth's power), amplitude ratio, change correlation;
- ``deterministic``: the checkpoint's default rollout (its ``jitter_average`` draws per step),
  with its mean absolute error over the truth's spread (the CRPS of a point forecast), so the
  ensemble's CRPS can be compared with it.

Per window (The Well's windows of the rollout steps) it keeps, per field and mean over fields,
what the acceptance criteria read: spread/skill in [0.7, 1.3] from step 2, largest rank bin at
most 2x flat, ensemble-mean VRMSE no worse than the deterministic model's, CRPS at most 0.8x the
deterministic MAE after step 10, member power ratios in [0.7, 1.4] in the low and mid bands from
step 11, high band at step 1 within 2x::

    python -m benchmarks.studies.ensemble_candidates --data-dir data --dataset navier_stokes_2d \\
        --name ensemble_candidates_ns base=outputs/a/checkpoints/last.ckpt crps=outputs/b/... \\
        perturbed=outputs/a/checkpoints/last.ckpt@0.15:8:0.8

``NAME=CHECKPOINT@A:L:M`` perturbs the members' steps (:mod:`walrus.perturbation`: amplitude
``A``, correlation length ``L`` cells, memory ``M``); without ``@`` the members are not
perturbed (they differ by their jitter, and a noisy model's latent noise).

writes ``benchmarks/results/<--name>.json``; ``--write`` only renders that JSON's table onto
``docs/studies.md`` between ``<!-- ensemble-candidates:start -->`` and ``<!-- ...:end -->``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR
from benchmarks.pages import RESULTS_PAGE, STUDIES_PAGE, write_between
from benchmarks.record import finish_record, run_record, save_result
from walrus.data.batch import Batch, collate
from walrus.data.well_dataset import WellDataset
from walrus.inference.loading import InferenceCheckpoint, load_inference_checkpoint
from walrus.metrics import ENSEMBLE, RolloutMetrics
from walrus.perturbation import Perturbation
from walrus.rollout import ensemble_rollout, rollout

FIDELITY = ("power_ratio_low", "power_ratio_mid", "power_ratio_high", "amplitude_ratio",
            "change_correlation")  # fmt: skip


def _windows(block: Mapping[str, Any]) -> dict[str, Any]:
    """``{"fields": {field: {window: v}}, "mean": {window: v}}`` of one metric block."""
    return {"fields": block["windows"], "mean": block["mean_over_fields"]["windows"]}


def validation_batches(
    ckpt: InferenceCheckpoint, data_dir: str, dataset: str, *, trajectories: int | None,
    steps: int | None, batch_size: int = 4,
) -> tuple[list[Batch], int, list[str]]:  # fmt: skip
    """The first ``trajectories`` (all for ``None``) validation trajectories as batches of
    context and truth, the rollout steps they all allow (at most ``steps``), and the fields."""
    n_in = ckpt.n_steps_input or 4
    ds = WellDataset(data_dir, dataset, "valid", n_steps_input=n_in, n_steps_output=0,
                     vocab=ckpt.vocab)  # fmt: skip
    n_traj = ds.n_trajectories if trajectories is None else min(trajectories, ds.n_trajectories)
    avail = min(ds.frames_available(i, 1) for i in range(n_traj)) - n_in
    n_steps = avail if steps is None else min(steps, avail)
    batches = [
        collate(
            [ds.trajectory(i, 1, n_in + n_steps) for i in range(s, min(s + batch_size, n_traj))]
        )
        for s in range(0, n_traj, batch_size)
    ]
    return batches, n_steps, list(ds.field_names)


def score_checkpoint(
    path: str, data_dir: str, dataset: str, *, members: int, seeds: Sequence[int],
    trajectories: int, steps: int | None, batch_size: int = 4, member_average: int = 1,
    perturbation: Perturbation | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Ensemble, member-0 and deterministic scores of one checkpoint, per inference seed."""
    ckpt = load_inference_checkpoint(path)
    batches, n_steps, names = validation_batches(
        ckpt, data_dir, dataset, trajectories=trajectories, steps=steps, batch_size=batch_size
    )
    default_avg = ckpt.default_jitter_average(0)
    per_seed = {}
    for seed in seeds:
        ens = RolloutMetrics(names, n_steps, members=members)
        one = RolloutMetrics(names, n_steps)
        det = RolloutMetrics(names, n_steps, members=2)
        for batch in batches:
            last = batch.input_fields[:, -1]  # (B, C, *sp)
            runs = zip(
                ensemble_rollout(
                    ckpt,
                    batch,
                    n_steps,
                    members=members,
                    jitter_seed=seed,
                    keep_members=True,
                    jitter_average=member_average,
                    perturbation=perturbation,
                ),  # fmt: skip
                rollout(ckpt, batch, n_steps, jitter_seed=seed, jitter_average=default_avg),
            )
            for step, ((mean, spread, mem), pred) in enumerate(runs, start=1):
                truth = batch.output_fields[:, step - 1]  # (B, C, *sp)
                ens.update(step, mean, truth, last, spread, members=mem)
                one.update(step, mem[0], truth, last)
                det.update(step, pred, truth, last, members=torch.stack([pred, pred]))
        e, o, d = ens.to_dict(), one.to_dict(), det.to_dict()
        per_seed[str(seed)] = {
            "spread_skill": _windows(e[ENSEMBLE]["spread_skill"]),
            "crps": _windows(e[ENSEMBLE]["crps"]),
            "rank_max_over_flat": _windows(e[ENSEMBLE]["rank_max_over_flat"]),
            "vrmse_ensemble_mean": _windows(e["model"]["vrmse"]),
            "member": {k: _windows(o["model"][k]) for k in ("vrmse", *FIDELITY)},
            "vrmse_deterministic": _windows(d["model"]["vrmse"]),
            "mae_deterministic": _windows(d[ENSEMBLE]["crps"]),
            "vrmse_persistence": _windows(e["persistence"]["vrmse"]),
            "deterministic": {k: _windows(d["model"][k]) for k in FIDELITY},
        }
    return {
        "checkpoint": path,
        "trajectories": sum(b.input_fields.shape[0] for b in batches),
        "steps": n_steps,
        "members": members,
        "member_jitter_average": member_average,
        "perturbation": None if perturbation is None else asdict(perturbation),
        "deterministic_jitter_average": default_avg,
        "per_seed": per_seed,
    }


def parse_perturbation(text: str) -> Perturbation | None:
    """``"A:L:M"`` (length and memory optional) as a :class:`Perturbation`; ``""``: none."""
    if not text:
        return None
    parts = text.split(":")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise SystemExit(f"perturbation {text!r} is not A[:L[:M]]") from None
    return Perturbation(*values)


def verdicts(
    result: Mapping[str, Any], reference: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The acceptance criteria read off one checkpoint's scores, mean over inference seeds.

    ``reference``: the scores of a deterministic model trained with the same recipe and
    budget; its deterministic rollout is then the bar for the ensemble mean's VRMSE and the
    CRPS (else the checkpoint's own deterministic rollout is).
    """
    seeds = list(result["per_seed"].values())
    bar = list((reference or result)["per_seed"].values())

    def mean(get, runs: list = seeds) -> dict[str, float | None]:
        out = {}
        for w in seeds[0]["spread_skill"]["mean"]:
            vals = [get(s).get(w) for s in runs]
            out[w] = None if any(v is None for v in vals) else sum(vals) / len(vals)
        return out

    ss = mean(lambda s: s["spread_skill"]["mean"])
    rank = mean(lambda s: s["rank_max_over_flat"]["mean"])
    crps = mean(lambda s: s["crps"]["mean"])
    v_ens = mean(lambda s: s["vrmse_ensemble_mean"]["mean"])
    mae = mean(lambda s: s["mae_deterministic"]["mean"], bar)
    v_det = mean(lambda s: s["vrmse_deterministic"]["mean"], bar)
    later = [w for w in ss if w != "1"]
    after10 = [w for w in ss if w not in ("1", "2-10")]
    fields = list(seeds[0]["member"]["power_ratio_low"]["fields"])
    member_band = {
        f: {
            b: mean(lambda s, f=f, b=b: s["member"][f"power_ratio_{b}"]["fields"][f])
            for b in ("low", "mid")
        }  # fmt: skip
        for f in fields
    }
    high1 = {
        f: mean(lambda s, f=f: s["member"]["power_ratio_high"]["fields"][f])["1"] for f in fields
    }
    band_vals = [member_band[f][b][w] for f in fields for b in ("low", "mid") for w in after10]
    return {
        "spread_skill": ss,
        "rank_max_over_flat": rank,
        "crps_over_deterministic_mae": {w: crps[w] / mae[w] for w in ss if mae[w]},
        "ensemble_mean_over_deterministic_vrmse": {w: v_ens[w] / v_det[w] for w in ss if v_det[w]},
        "member_power_low_mid": member_band,
        "member_power_high_step1": high1,
        "pass": {
            "spread_skill_0.7_1.3": all(0.7 <= ss[w] <= 1.3 for w in later if ss[w] is not None),
            "rank_max_2x": all(rank[w] <= 2 for w in later if rank[w] is not None),
            "mean_no_worse": all(v_ens[w] <= v_det[w] for w in ss if v_det[w] is not None),
            "crps_0.8_mae": all(crps[w] <= 0.8 * mae[w] for w in after10 if mae[w]),
            "member_power_0.7_1.4": all(0.7 <= v <= 1.4 for v in band_vals if v is not None),
            "high_step1_2x": all(0.5 <= v <= 2 for v in high1.values() if v is not None),
        },
    }


def _cell(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def markdown(result: Mapping[str, Any]) -> str:
    """One row per candidate and window: the criteria's measures (means over inference seeds;
    member power: the band and field furthest from 1 in the window)."""
    lines = [
        "| candidate | steps | spread/skill | rank max/flat | CRPS / det. MAE | "
        "mean / det. VRMSE | member power low-mid (worst) | high k at step 1 (worst field) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, res in result["candidates"].items():
        v = res["verdicts"]
        high = {f: x for f, x in v["member_power_high_step1"].items() if x}
        worst_high = max(high, key=lambda f: max(high[f], 1 / high[f])) if high else None
        for i, w in enumerate(v["spread_skill"]):
            band = [(x, f"{f} {b}") for f, bs in v["member_power_low_mid"].items()
                    for b, ws in bs.items() if (x := ws.get(w))]  # fmt: skip
            worst = max(band, key=lambda t: max(t[0], 1 / t[0])) if band else None
            cells = [
                name if i == 0 else "",
                w,
                _cell(v["spread_skill"][w]),
                _cell(v["rank_max_over_flat"][w]),
                _cell(v["crps_over_deterministic_mae"].get(w)),
                _cell(v["ensemble_mean_over_deterministic_vrmse"].get(w)),
                f"{worst[0]:.3g} ({worst[1]})" if worst else "n/a",
                f"{high[worst_high]:.3g} ({worst_high})" if i == 0 and worst_high else "",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("candidates", nargs="*", help="NAME=CHECKPOINT pairs")
    p.add_argument("--data-dir")
    p.add_argument("--write", action="store_true", help="only render the JSON onto the docs")
    p.add_argument("--also", nargs="*", default=[],
                   help="with --write: more result names whose candidates join the table "
                   "(each row then names its dataset)")  # fmt: skip
    p.add_argument("--marker", default="ensemble-candidates",
                   help="with --write: the block to fill")  # fmt: skip
    p.add_argument("--page", choices=("studies", "results"), default="studies",
                   help="with --write: docs/studies.md or docs/results.md")  # fmt: skip
    p.add_argument("--match", default="",
                   help="with --write and --also: only candidates whose name holds this")  # fmt: skip
    p.add_argument("--reference", default=None,
                   help="candidate whose deterministic rollout is the bar for the others' "
                   "ensemble-mean VRMSE and CRPS (default: each candidate's own)")  # fmt: skip
    p.add_argument("--dataset", default="navier_stokes_2d")
    p.add_argument("--members", type=int, default=8)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--name", default="ensemble_candidates")
    p.add_argument("--member-jitter-average", type=int, default=1,
                   help="jitter draws averaged per member and step (a noisy model's draws share "
                   "the member's noise; default 1)")  # fmt: skip
    args = p.parse_args(argv)
    if args.write:
        saved = json.loads((RESULTS_DIR / f"{args.name}.json").read_text())
        ref = saved["candidates"].get(args.reference) if args.reference else None
        saved["reference"] = args.reference if ref is not None else None
        for res in saved["candidates"].values():
            res["verdicts"] = verdicts(res, ref)
        save_result(args.name, saved)
        if args.also:
            table: dict[str, Any] = {"candidates": {}}
            for name in [args.name, *args.also]:
                part = json.loads((RESULTS_DIR / f"{name}.json").read_text())
                for cand, res in part["candidates"].items():
                    if args.match not in cand:
                        continue
                    res.setdefault("verdicts", verdicts(res))
                    table["candidates"][f"{part['dataset']} {cand}"] = res
            saved = table
        page = STUDIES_PAGE if args.page == "studies" else RESULTS_PAGE
        print(f"wrote {write_between(page, args.marker, markdown(saved))}")
        return saved
    if not args.candidates or not args.data_dir:
        p.error("give --data-dir and NAME=CHECKPOINT candidates (or --write)")
    record = run_record(sys.argv if argv is None else ["ensemble_candidates", *argv])
    out: dict[str, Any] = {"dataset": args.dataset, "split": "valid", "candidates": {}}
    for item in args.candidates:
        name, _, spec = item.partition("=")
        path, _, pert = spec.partition("@")
        res = score_checkpoint(path, args.data_dir, args.dataset, members=args.members,
                               seeds=args.seeds, trajectories=args.trajectories, steps=args.steps,
                               member_average=args.member_jitter_average,
                               perturbation=parse_perturbation(pert))  # fmt: skip
        out["candidates"][name] = res
    ref = out["candidates"].get(args.reference) if args.reference else None
    out["reference"] = args.reference if ref is not None else None
    for name, res in out["candidates"].items():
        res["verdicts"] = verdicts(res, ref)
        v = res["verdicts"]
        print(name, "spread/skill", {w: round(x, 3) for w, x in v["spread_skill"].items()})
        print("   crps/mae", {w: round(x, 3) for w, x in v["crps_over_deterministic_mae"].items()})
        print(
            "   mean/det vrmse",
            {w: round(x, 3) for w, x in v["ensemble_mean_over_deterministic_vrmse"].items()},
        )
        print("   high@1", {f: round(x, 2) for f, x in v["member_power_high_step1"].items() if x})
        for f, bands in v["member_power_low_mid"].items():
            print(f"   member power {f}", {b: {w: round(x, 2) for w, x in ws.items() if x}
                                           for b, ws in bands.items()})  # fmt: skip
        print("   pass", v["pass"], flush=True)
    out["record"] = finish_record(record)
    save_result(args.name, out)
    return out


if __name__ == "__main__":
    main()
