"""One-off probe: score a ``benchmarks.transfer`` run's pretrained checkpoints on the held-out
test split with no fine-tuning, beside that run's fine-tuned and scratch rows.

    python -m benchmarks.studies.zero_shot_probe --transfer-json benchmarks/results/transfer.json \\
        --work-dir WORK --dataset data/gray_scott_pypde --out benchmarks/results/X.json

``WORK`` is the transfer run's ``--work-dir`` (its ``<held>/seed_<N>/pretrain`` checkpoints).
"""

from __future__ import annotations

import json

from benchmarks import transfer_runs
from benchmarks.studies.finetune_probe import probe_parser, save_probe, start_probe


def main() -> None:
    record = start_probe()
    args = probe_parser("python -m benchmarks.studies.zero_shot_probe").parse_args()
    done = json.loads(args.transfer_json.read_text())
    held = transfer_runs.external_set(args.dataset)
    rows = []
    for run in done["runs"]:
        seed = run["seed"]
        out = args.work_dir / held.name / f"seed_{seed}"
        ckpt = out / "pretrain" / "checkpoints" / "last.ckpt"
        zero = transfer_runs.score_zero_shot(ckpt, held, out / "eval" / "zero_shot_probe")
        if "skipped" in zero:
            rows.append({"seed": seed, **zero})
            continue
        row = {"seed": seed, "zero_shot": zero["test"]["model"]}
        for label in ("finetune 300", "scratch 300"):
            row[label] = run["models"][label]["test"]["model"]
        row["persistence"] = zero["test"]["persistence"]
        rows.append(row)
        zs, sc = row["zero_shot"]["vrmse"], row["scratch 300"]["vrmse"]
        print(seed, {w: round(zs[w] / sc[w], 3) for w in zs if zs[w] and sc.get(w)}, flush=True)
    save_probe(args, rows, record)


if __name__ == "__main__":
    main()
