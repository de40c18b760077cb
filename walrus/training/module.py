"""The LightningModule: normalise, predict deltas, compute the loss, validate with rollouts."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn

from walrus import metrics
from walrus.data.batch import Batch
from walrus.data.normalization import RMSNormalizer
from walrus.forecast import rollout
from walrus.training.losses import LOSSES, normalized_loss
from walrus.training.optim import OptimizerFactory, SchedulerFactory, param_groups


class NonFiniteLossError(RuntimeError):
    """Raised when the training loss is NaN or Inf; the message names the step and batch."""


class WalrusModule(pl.LightningModule):
    """Trains a space-time model to predict the next frame of a PDE simulation.

    Args:
        model: a module called as ``model(x, fields, bcs)`` returning ``(B, T', C, *spatial)``.
        optimizer: ``partial(torch.optim.AdamW, lr=...)``; it receives parameter groups.
        lr_scheduler: ``partial(WarmupCosine, ...)``; ``total_steps`` defaults to the trainer's
            estimate. ``None`` keeps the learning rate fixed.
        weight_decay: applied to matrices only (not norms, biases, embeddings).
        loss: ``"mae"`` or ``"mse"``, in normalised space.
        loss_multiplier: scales the loss (the Walrus recipe uses one).
        predict_delta: predict the normalised frame delta (default) or the normalised next state.
        normalizer: fits per-sample ``NormStats`` (default ``RMSNormalizer()``).
        val_rollout_steps: length of the short validation rollout (capped by the targets present).
        input_noise: std of Gaussian noise added to training inputs, in input RMS units
            (0 disables it); it makes long rollouts more stable.
        compile: ``torch.compile`` each processor block in place (where the compute is; the
            state dict keeps its keys). Compiling the whole model is not supported: inductor
            mis-handles the encoder/jitter views and the inference workspace's ``out=`` writes.
        model_config: the model's resolved config, stored in checkpoints.
        vocab: the field vocabulary as a dict, stored in checkpoints.
        data_config: the resolved data config, stored so inference can default to it.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory,
        lr_scheduler: SchedulerFactory | None = None,
        *,
        weight_decay: float = 0.05,
        loss: str = "mae",
        loss_multiplier: float = 1.0,
        predict_delta: bool = True,
        normalizer: Any = None,
        val_rollout_steps: int = 4,
        input_noise: float = 0.0,
        compile: bool = False,
        model_config: dict[str, Any] | None = None,
        vocab: dict[str, Any] | None = None,
        data_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"module.loss must be one of {LOSSES}, got {loss!r}")
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.weight_decay = weight_decay
        self.loss_kind = loss
        self.loss_multiplier = loss_multiplier
        self.predict_delta = predict_delta
        self.normalizer = normalizer if normalizer is not None else RMSNormalizer()
        self.val_rollout_steps = val_rollout_steps
        self.input_noise = input_noise
        self.model_config = model_config or {}
        self.vocab = vocab or {}
        self.data_config = data_config or {}
        if compile:
            for block in model.blocks:
                block.compile()
        self._step_start = time.perf_counter()

    def forward(self, x: Tensor, fields: Tensor, bcs: Tensor) -> Tensor:
        return self.model(x, fields, bcs)

    def _targets(self, batch: Batch, noise_std: float = 0.0) -> tuple[Tensor, Tensor, Any]:
        """Normalised model input and normalised targets for every output frame.

        With ``noise_std > 0`` the inputs get Gaussian noise of that many input RMS units, and
        delta targets lead from the noisy frame to the clean next one, so the model learns to
        correct the small errors a rollout feeds back to it.
        """
        x, y = batch.input_fields, batch.output_fields  # (B, Ti, C, *S), (B, To, C, *S)
        if y.shape[1] < 1:
            raise ValueError("training needs at least one target frame (n_steps_output >= 1)")
        names = batch.metadata.get("field_names")
        stats = self.normalizer.fit(x, names)
        t_in = x.shape[1]
        if noise_std > 0:
            x = x + noise_std * stats.scale * torch.randn_like(x)  # (B, Ti, C, *S)
        full = torch.cat([x, y], dim=1)  # (B, Ti + To, C, *S)
        causal = getattr(self.model, "causal", True)
        if causal:
            nxt = torch.cat([batch.input_fields[:, 1:], y[:, :1]], dim=1)  # (B, Ti, C, *S) clean
            prev = full[:, :t_in]  # (B, Ti, C, *S)
        else:
            nxt, prev = full[:, t_in : t_in + 1], full[:, t_in - 1 : t_in]  # (B, 1, C, *S)
        target = stats.normalize_delta(nxt - prev) if self.predict_delta else stats.normalize(nxt)
        return stats.normalize(x), target, stats

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x_n, target, _ = self._targets(batch, self.input_noise)
        pred = self(x_n, batch.field_ids, batch.bcs)  # (B, T', C, *S)
        loss = normalized_loss(pred, target, self.loss_kind) * self.loss_multiplier
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"training loss became {loss.item()} at global step {self.global_step} "
                f"(batch {batch_idx}, dataset {batch.metadata.get('dataset')!r}, trajectories "
                f"{_as_list(batch.metadata.get('trajectory'))}, starts "
                f"{_as_list(batch.metadata.get('start'))}); the last good checkpoint is kept"
            )
        now = time.perf_counter()
        rate = batch.batch_size / max(now - self._step_start, 1e-9)
        self._step_start = now
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.batch_size)
        self.log("train/samples_per_s", rate, prog_bar=True, batch_size=batch.batch_size)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norms = grad_norm(self.model, norm_type=2)
        if "grad_2.0_norm_total" in norms:
            self.log("train/grad_norm", norms["grad_2.0_norm_total"])
        self.log("train/lr", optimizer.param_groups[0]["lr"])

    def validation_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        x_n, target, stats = self._targets(batch)
        pred = self(x_n, batch.field_ids, batch.bcs)
        b = batch.batch_size
        self.log("val/loss", normalized_loss(pred, target, self.loss_kind), batch_size=b)

        n_sp = batch.n_spatial
        last = batch.input_fields[:, -1:].float()  # (B, 1, C, *S)
        truth = batch.output_fields[:, 0].float()  # (B, C, *S)
        step = pred[:, -1:].float()  # (B, 1, C, *S)
        nxt = (
            last + stats.denormalize_delta(step) if self.predict_delta else stats.denormalize(step)
        )
        nxt, last = nxt[:, 0], last[:, 0]  # (B, C, *S)
        model_err = metrics.vrmse(nxt, truth, n_spatial=n_sp)  # (B, C)
        persist_err = metrics.vrmse(last, truth, n_spatial=n_sp)  # (B, C)
        self.log(
            "val/vrmse", model_err.mean(), prog_bar=True, batch_size=b, add_dataloader_idx=False
        )
        self.log(
            "val/vrmse_persistence", persist_err.mean(), batch_size=b, add_dataloader_idx=False
        )
        names = _field_names(batch)
        dataset = batch.metadata.get("dataset", "data")
        for c, name in enumerate(names):
            self.log(
                f"val/vrmse/{dataset}/{name}",
                model_err[:, c].mean(),
                batch_size=b,
                add_dataloader_idx=False,
            )

        steps = min(self.val_rollout_steps, batch.output_fields.shape[1])
        if steps > 1:
            errs = [
                metrics.vrmse(p.float(), batch.output_fields[:, s].float(), n_spatial=n_sp).mean()
                for s, p in enumerate(
                    rollout(
                        self.model,
                        batch,
                        steps,
                        normalizer=self.normalizer,
                        predict_delta=self.predict_delta,
                        check_finite=False,
                    )
                )
            ]
            self.log(
                "val/rollout_vrmse",
                torch.stack(errs).mean(),
                batch_size=b,
                add_dataloader_idx=False,
            )

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(param_groups(self.model, self.weight_decay))
        if self.scheduler_factory is None:
            return optimizer
        kwargs = {}
        if "total_steps" not in getattr(self.scheduler_factory, "keywords", {}):
            kwargs["total_steps"] = max(int(self.trainer.estimated_stepping_batches), 1)
        scheduler = self.scheduler_factory(optimizer, **kwargs)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from walrus.training.checkpoint import CHECKPOINT_FORMAT

        checkpoint["walrus"] = {
            "format": CHECKPOINT_FORMAT,
            "model_config": self.model_config,
            "vocab": self.vocab,
            "predict_delta": self.predict_delta,
            "data_config": self.data_config,
            "normalizer": self.normalizer.config() if hasattr(self.normalizer, "config") else None,
        }


def _as_list(value: Any) -> Any:
    return value.tolist() if isinstance(value, Tensor) else value


def _field_names(batch: Batch) -> list[str]:
    names = batch.metadata.get("field_names")
    c = batch.input_fields.shape[2]
    if not names:
        return [str(i) for i in batch.field_ids.tolist()]
    return list(names)[:c]
