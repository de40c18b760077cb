"""The ``${walrus_run_dir:CKPT,DEFAULT}`` resolver behind ``hydra.run.dir``: a resume
(``ckpt_path=RUN/checkpoints/last.ckpt``) continues in ``RUN``; any other run uses ``DEFAULT``.

Kept free of heavy imports: ``train.py`` registers it before Hydra composes the config.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from walrus.safe_paths import inside, refuse_symlinks

RESOLVER = "walrus_run_dir"
# What every train run writes at the top of its folder once its checks pass (config.yaml
# always; .hydra/ and train.log under Hydra); any of them means the folder holds a run.
RUN_MARKERS = ("config.yaml", ".hydra", "train.log", "metrics.json", "checkpoints/last.ckpt")
# The run's own entries, none of which may be a symlink the run did not create.
RUN_ENTRIES = ("config.yaml", ".hydra", "train.log", "metrics.json", "checkpoints", "logs")


def run_dir_for(ckpt_path: str | None, default: str) -> str:
    """``RUN`` for ``ckpt_path=RUN/checkpoints/<name>.ckpt``, else ``default``."""
    if not ckpt_path:
        return default
    path = Path(str(ckpt_path))
    if path.parent.name == "checkpoints":
        return str(path.parent.parent)
    return default


def register_run_dir_resolver() -> None:
    """Register ``walrus_run_dir`` with OmegaConf (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, run_dir_for)


def claim_run_dir(out_dir: Path, ckpt_path: str | None) -> None:
    """Refuse a run folder that holds another run, unless ``ckpt_path`` resumes that run (lies
    inside the folder), and any of the run's entries planted there as a symlink.

    Call before anything is written; it writes nothing itself.

    Raises:
        ValueError: one line naming the folder and what to pass instead.
    """
    refuse_symlinks(out_dir, RUN_ENTRIES, what=f"run folder {out_dir}")
    if not out_dir.is_dir():
        return
    found = [m for m in RUN_MARKERS if (out_dir / m).exists()]
    if not found or (ckpt_path and inside(out_dir, Path(str(ckpt_path)))):
        return
    resume = f"ckpt_path={out_dir / 'checkpoints' / 'last.ckpt'}"
    raise ValueError(
        f"run folder {out_dir} already holds a run ({', '.join(found[:3])}); pass a new "
        f"hydra.run.dir (or paths.output_dir), or resume that run with {resume}"
        + (f" (ckpt_path={ckpt_path} is not in it)" if ckpt_path else "")
    )
