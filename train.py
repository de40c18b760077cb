"""Train a model: `python train.py experiment=quickstart` (see configs/)."""

import hydra
from omegaconf import DictConfig

from walrus.cli import run_cli, run_hydra_main


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from walrus.training.train import train

    run_cli(lambda: train(cfg))


if __name__ == "__main__":
    run_hydra_main(main)
