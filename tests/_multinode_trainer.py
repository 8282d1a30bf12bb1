"""One node's process of the two-node Trainer launch in ``test_multinode.py`` (run by torchrun on each "node").

``python tests/_multinode_trainer.py OUTDIR``: a tiny regression model, ``Trainer(strategy="scape", num_nodes=2,
devices=1)``, 40 steps with a short warm-up so most steps are sparse; each rank saves what the test checks.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_scape


class Regression(L.LightningModule):
    """A two-layer regression on fixed random data."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main(outdir: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(640, 32)
    y = x[:, :4].sum(dim=1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    strategy = lightning_scape.pytorch.ScapeStrategy(density=0.05, dense_warmup_steps=4, density_ramp_steps=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy=strategy,
        max_steps=40,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression()
    trainer.fit(model, loader)
    engine = strategy.engine
    torch.save(
        {
            "rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "steps": engine.step_count,
            "sparse_steps": engine.step_count - engine.config.dense_steps,
            "sent": engine.counters.total_sent_bytes,
            "dense_equivalent": engine.counters.total_dense_equivalent,
            "loss": float(trainer.callback_metrics["loss"]),
        },
        os.path.join(outdir, f"rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1])
