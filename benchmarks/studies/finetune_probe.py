"""One-off probe: fine-tune the pretrained checkpoints of a ``benchmarks.transfer`` run with
other recipes, with the benchmark's own ``fit`` and ``evaluate``, and compare with its rows.

    python -m benchmarks.studies.finetune_probe --transfer-json benchmarks/results/transfer.json \\
        --work-dir WORK --dataset data/gray_scott_pypde \\
        --candidates "lr3e-3=optimizer.lr=3e-3;slow_blocks=optimizer.lr=3e-3 module.lr_scales={blocks:0.1}" \\
        --out benchmarks/results/X.json

``WORK`` is the transfer run's ``--work-dir`` (its ``<held>/seed_<N>/pretrain`` checkpoints);
``--dataset`` names the held-out set (for a built-in one, its folder under the run's data root).
Each candidate's overrides follow ``experiment=finetune init_from=...``; ``--lrs 1e-3 3e-3``
adds one candidate per rate; ``--scratch-candidates`` train from scratch
(``finetune.enabled=false``) instead. Per seed, every run is scored on validation (its final
``val/rollout_vrmse``) and on the test split. On each side (fine-tune, scratch) ``chosen`` marks
the run with the best validation score, the transfer run's own row (``transfer``) included, and
a row of kind ``chosen`` gives the chosen fine-tuned over the chosen scratch test VRMSE.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import transfer, transfer_runs
from benchmarks.quality import parse_candidates
from benchmarks.record import finish_record, portable, portable_path, run_record
from walrus.atomic import write_text_atomic


def probe_parser(prog: str) -> argparse.ArgumentParser:
    """The arguments every probe of a finished transfer run takes (see the module docstring)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--transfer-json", type=Path, required=True)
    p.add_argument("--work-dir", type=Path, required=True)
    p.add_argument("--dataset", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    return p


def start_probe() -> dict[str, Any]:
    """The probe's run record (commit, dirty flag, start time, CPU model), read as it starts."""
    return run_record(sys.argv)


def save_probe(args: argparse.Namespace, rows: list[dict], record: dict[str, Any]) -> None:
    """Write ``rows`` to ``args.out`` with ``record`` (from :func:`start_probe`) completed and
    the arguments, every path made portable."""
    argv = {k: portable_path(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    out = {"record": {**finish_record(record), "args": argv}, "rows": rows}
    write_text_atomic(args.out, json.dumps(portable(out), indent=1))


def main() -> None:
    record = start_probe()
    p = probe_parser("python -m benchmarks.studies.finetune_probe")
    p.add_argument("--candidates", type=parse_candidates, default={})
    p.add_argument("--lrs", type=float, nargs="*", default=[])
    p.add_argument("--scratch-candidates", type=parse_candidates, default={})
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    candidates = {**{f"lr{lr:g}": [f"optimizer.lr={lr}"] for lr in args.lrs}, **args.candidates}
    if not candidates and not args.scratch_candidates:
        p.error("give --candidates, --lrs or --scratch-candidates")
    todo = {("finetune", n): o for n, o in candidates.items()}
    todo.update({("scratch", n): o for n, o in args.scratch_candidates.items()})
    done = json.loads(args.transfer_json.read_text())
    held = transfer_runs.external_set(args.dataset)
    rows = []
    for run in (r for r in done["runs"] if r["held_out"] == held.name):
        seed = run["seed"]
        ckpt = args.work_dir / held.name / f"seed_{seed}" / "pretrain" / "checkpoints" / "last.ckpt"
        base = [*transfer_runs.held_overrides(held, seed), f"trainer.max_steps={args.steps}"]
        start = {
            "finetune": [*base, f"init_from={ckpt}"],
            "scratch": [*base, "finetune.enabled=false"],
        }
        for kind in ("finetune", "scratch"):
            own = run["models"][f"{kind} {args.steps}"]
            row = {"seed": seed, "kind": kind, "candidate": "transfer", "lr": own["lr"]}
            rows.append({**row, "val": own["val"], "test": own["test"]["model"]})
        for (kind, name), overrides in todo.items():
            out = args.work_dir / "probe" / held.name / f"seed_{seed}_{kind}_{name}"
            fitted = transfer_runs.fit([*start[kind], *overrides], out)
            test = transfer_runs.evaluate(fitted["checkpoint"], held, out / "eval")["model"]
            row = {"seed": seed, "kind": kind, "candidate": name, "overrides": overrides}
            rows.append({**row, "steps": fitted["steps"], "val": fitted["val"], "test": test})
            save_probe(args, rows, record)  # what is done survives a stop
        chosen = {}
        for kind in ("finetune", "scratch"):
            side = [r for r in rows if r["seed"] == seed and r.get("kind") == kind]
            chosen[kind] = min(side, key=transfer._val_score)
            for r in side:
                r["chosen"] = r is chosen[kind]
        ft, sc = chosen["finetune"]["test"]["vrmse"], chosen["scratch"]["test"]["vrmse"]
        ratio = {w: v / sc[w] for w, v in ft.items()}
        names = {k: chosen[k]["candidate"] for k in chosen}
        rows.append({"seed": seed, "kind": "chosen", **names, "finetune_over_scratch": ratio})
        print(seed, names, {w: round(v, 3) for w, v in ratio.items()}, flush=True)
    save_probe(args, rows, record)


if __name__ == "__main__":
    main()
