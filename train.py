"""Train a model: `python train.py experiment=quickstart` (see configs/)."""

import os

# Before torch loads libgomp: idle OpenMP threads spin briefly, then sleep. Passive waiting (what
# `import walrus` sets for inference) made quiet training runs 16-41 % slower on an Intel Xeon;
# on a shared machine the thread tuner (configs/callbacks) drops to one thread. A policy the user
# set wins.
if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
    os.environ["GOMP_SPINCOUNT"] = "10000"

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from walrus.cli import run_cli, run_hydra_main  # noqa: E402
from walrus.training.run_dir import register_run_dir_resolver  # noqa: E402

register_run_dir_resolver()  # hydra.run.dir of a resume is the checkpoint's run folder


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from walrus.training.train import train_from_command_line

    run_cli(lambda: train_from_command_line(cfg))


if __name__ == "__main__":
    run_hydra_main(main)
