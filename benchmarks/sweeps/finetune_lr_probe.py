"""One-off probe: fine-tune the pretrained checkpoints of a ``benchmarks.transfer`` run at other
learning rates, with the benchmark's own ``fit`` and ``evaluate``, and compare with its scratch row.

    python -m benchmarks.sweeps.finetune_lr_probe --transfer-json benchmarks/results/transfer.json \\
        --work-dir WORK --dataset data/gray_scott_pypde --lrs 1e-3 3e-3 --out benchmarks/results/X.json

``WORK`` is the transfer run's ``--work-dir`` (its ``<held>/seed_<N>/pretrain`` checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks import transfer
from walrus.atomic import write_text_atomic


def probe_parser(prog: str) -> argparse.ArgumentParser:
    """The arguments every probe of a finished transfer run takes (see the module docstring)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--transfer-json", type=Path, required=True)
    p.add_argument("--work-dir", type=Path, required=True)
    p.add_argument("--dataset", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    return p


def save_probe(args: argparse.Namespace, rows: list[dict]) -> None:
    """Write ``rows`` to ``args.out`` with the commit, dirty flag and relative arguments."""
    argv = {k: os.path.relpath(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    record = {**transfer.git_state(), "args": argv}
    write_text_atomic(args.out, json.dumps({"record": record, "rows": rows}, indent=1))


def main() -> None:
    p = probe_parser("python -m benchmarks.sweeps.finetune_lr_probe")
    p.add_argument("--lrs", type=float, nargs="+", required=True)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    done = json.loads(args.transfer_json.read_text())
    held = transfer.external_set(args.dataset)
    rows = []
    for run in done["runs"]:
        seed = run["seed"]
        ckpt = args.work_dir / held.name / f"seed_{seed}" / "pretrain" / "checkpoints" / "last.ckpt"
        base = [
            "experiment=finetune",
            f"paths.data_dir={held.root}",
            f"data.datasets=[{held.name}]",
            f"seed={seed}",
            "data.generate_if_missing=false",
            f"init_from={ckpt}",
            f"trainer.max_steps={args.steps}",
        ]
        scratch = run["models"][f"scratch {args.steps}"]["test"]["model"]["vrmse"]
        for lr in args.lrs:
            out = args.work_dir / "probe" / f"seed_{seed}_lr{lr:g}"
            ft = transfer.fit([*base, f"optimizer.lr={lr}"], out)
            test = transfer.evaluate(ft["checkpoint"], held, out / "eval")["model"]["vrmse"]
            ratio = {w: test[w] / scratch[w] for w in test if test[w] and scratch.get(w)}
            rows.append(
                {
                    "seed": seed,
                    "lr": lr,
                    "val": ft["val"],
                    "test_vrmse": test,
                    "over_scratch": ratio,
                }
            )
            print(seed, lr, {w: round(r, 3) for w, r in ratio.items()}, flush=True)
    save_probe(args, rows)


if __name__ == "__main__":
    main()
