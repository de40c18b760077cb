"""Train a model: `python train.py experiment=quickstart` (see configs/)."""

import hydra
from omegaconf import DictConfig

from walrus.cli import run_cli, run_hydra_main
from walrus.training.run_dir import register_run_dir_resolver

register_run_dir_resolver()  # hydra.run.dir of a resume is the checkpoint's run folder


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from walrus.training.train import train_from_command_line

    run_cli(lambda: train_from_command_line(cfg))


if __name__ == "__main__":
    run_hydra_main(main)
