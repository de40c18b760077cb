"""Roll out or score a checkpoint: `python infer.py rollout|evaluate ckpt_path=...` (see configs/infer.yaml)."""

import sys

import hydra
from omegaconf import DictConfig

from walrus.cli import run_cli, run_hydra_main


@hydra.main(version_base="1.3", config_path="configs", config_name="infer")
def main(cfg: DictConfig) -> None:
    from walrus.inference import run

    run_cli(lambda: run(cfg))


if __name__ == "__main__":
    from walrus.inference import command_override

    sys.argv = run_cli(lambda: command_override(sys.argv))
    run_hydra_main(main)
