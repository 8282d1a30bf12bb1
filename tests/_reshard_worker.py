"""Worker for the re-sharding tests: ``python _reshard_worker.py <phase> <outdir>`` on every rank.

``write`` runs on 2 ranks (under torchrun): an uninterrupted Fabric run that saves a checkpoint at step
:data:`SAVE_AT` on its way, and an uninterrupted Trainer run that checkpoints every epoch. ``resume`` runs on
1 rank (plain python) or 4 (torchrun): both resume from those checkpoints with the same global batch, and it
checks refusals. Every rank saves ``<outdir>/<name>_w<W>_rank<r>.pt`` for ``test_reshard_dist.py``.
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from typing import Any

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from helpers import flat, rank_file  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_scape  # noqa: E402

# A small regression onto a fixed teacher network: smooth enough that 10 steps of SCAPE on 1, 2 or 4 ranks stay
# within about 2% of each other for any seed (measured with the thread simulation), so the comparison is about
# the resume, not about chance. About 6k parameters in 3 buckets; chunks of 64 with 6 slots, 4 dense steps.
SCAPE = {"density": 0.1, "chunk_size": 64, "dense_warmup_steps": 4, "density_ramp_steps": 0, "bucket_cap_mb": 0.01}
IN, HID, OUT, SAMPLES = 24, 64, 8, 128
LR = 0.002
GLOBAL_BATCH = 32  # samples per optimizer step over all ranks: 4 steps per epoch
SAVE_AT = 12  # the checkpoint after step 12 (4 dense steps, then 8 sparse ones); the Trainer's after epoch 2
STEPS = SAVE_AT + 10  # the continuation compared: the 10 steps after the checkpoint
EPOCHS = 6  # Trainer: 24 steps


def make_net(seed: int = 0, hidden: int = HID) -> nn.Sequential:
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, OUT))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return net


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(SAMPLES, IN, generator=g)
    with torch.no_grad():
        y = make_net(seed=1000, hidden=32)(x) + 0.1 * torch.randn(SAMPLES, OUT, generator=g)
    return TensorDataset(x, y)


def optimizer(net: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW as LLM recipes set it (converted to AdamS), decay on matrices only, a mild per-step schedule."""
    named = list(net.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
         {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.95),
    )  # fmt: skip
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.02 * step))


def save(outdir: str, name: str, world_size: int, rank: int, obj: Any) -> None:
    torch.save(obj, os.path.join(outdir, f"{name}_w{world_size}_rank{rank}.pt"))


def expect_failure(fn: Any) -> dict[str, Any]:
    try:
        fn()
        return {"error": None}
    except Exception as exc:  # the test inspects the message
        return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}


def engine_snapshot(engine: Any) -> dict[str, Any]:
    """What the tests compare exactly with the checkpoint's rank files, right after loading."""
    return {
        "momentum": [bs.momentum.clone() for bs in engine.buckets],
        "last_sent": [bs.last_sent.clone() for bs in engine.buckets],
        "residual": [bs.residual.clone() for bs in engine.buckets],
        "region": [(bs.region.start, bs.region.stop) for bs in engine.buckets],
        "shard": [(bs.shard.start, bs.shard.stop) for bs in engine.buckets],
        "padded": [bs.layout.padded_numel for bs in engine.buckets],
        "masks": None if engine.in_warmup else [m.clone() for m in engine.current_masks()],
        "step_count": engine.step_count,
        "refresh_count": engine.refresh_count,
        "total_sent": dict(engine.counters.total_sent),
    }


# ============================================================================================ Fabric


def global_batch(step: int, world_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of the step's global batch: the same samples over all ranks for any world size."""
    x, y = dataset().tensors
    per_epoch = len(x) // GLOBAL_BATCH
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
    part = GLOBAL_BATCH // world_size
    idx = perm[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH][rank * part : (rank + 1) * part]
    return x[idx], y[idx]


def fabric_setup(fabric: Fabric) -> tuple[Any, Any, Any]:
    net = make_net()
    model = fabric.setup_module(net)
    opt, sched = optimizer(net)
    return model, fabric.setup_optimizers(opt), sched


def fabric_steps(fabric: Fabric, model: Any, opt: Any, sched: Any, start: int, stop: int) -> list[float]:
    """Steps ``start``..``stop-1``; this rank's loss of each (their mean over ranks is the global loss)."""
    losses = []
    for step in range(start, stop):
        x, y = global_batch(step, fabric.world_size, fabric.global_rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def fabric_write(outdir: str) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=lightning_scape.ScapeStrategy(**SCAPE))
    fabric.launch()
    model, opt, sched = fabric_setup(fabric)
    losses = fabric_steps(fabric, model, opt, sched, 0, SAVE_AT)
    fabric.save(
        os.path.join(outdir, "fabric.ckpt"), {"model": model, "optimizer": opt, "scheduler": sched, "step": SAVE_AT}
    )
    losses += fabric_steps(fabric, model, opt, sched, SAVE_AT, STEPS)
    save(outdir, "fabric", 2, fabric.global_rank, {"losses": losses, "params": flat(model.parameters())})


def fabric_resume(outdir: str, world_size: int) -> None:
    ScapeStrategy = lightning_scape.ScapeStrategy
    ckpt = os.path.join(outdir, "fabric.ckpt")
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ScapeStrategy(**SCAPE))
    fabric.launch()
    rank = fabric.global_rank
    # Refusals first, each before anything is loaded.
    if world_size == 1:  # another configuration
        other = Fabric(accelerator="cpu", devices=1, strategy=ScapeStrategy(**{**SCAPE, "density": 0.2}))
        other.launch()
        model, opt, _ = fabric_setup(other)
        before = flat(model.parameters())
        result = expect_failure(lambda: other.load(ckpt, {"model": model, "optimizer": opt}))
        save(
            outdir,
            "fabric_other_config",
            world_size,
            rank,
            {
                **result,
                "changed": not torch.equal(before, flat(model.parameters())),
                "step_count": other.strategy.engine.step_count,
            },
        )
    else:  # a truncated rank file of the old run: every new rank reads it, every one stops
        bad = os.path.join(outdir, f"bad_w{world_size}.ckpt")
        if rank == 0:
            shutil.copy(ckpt, bad)
            shutil.copytree(ckpt + ".scape", bad + ".scape")
            with open(rank_file(bad, 1), "r+b") as f:
                f.truncate(os.path.getsize(rank_file(bad, 1)) // 2)
        fabric.barrier()
        model, opt, _ = fabric_setup(fabric)
        before = flat(model.parameters())
        result = expect_failure(lambda: fabric.load(bad, {"model": model, "optimizer": opt}))
        save(
            outdir,
            "fabric_truncated",
            world_size,
            rank,
            {
                **result,
                "changed": not torch.equal(before, flat(model.parameters())),
                "step_count": fabric.strategy.engine.step_count,
            },
        )
    model, opt, sched = fabric_setup(fabric)
    remainder = fabric.load(ckpt, {"model": model, "optimizer": opt, "scheduler": sched})
    snapshot = engine_snapshot(fabric.strategy.engine)
    losses = fabric_steps(fabric, model, opt, sched, remainder["step"], STEPS)
    save(outdir, "fabric", world_size, rank, {
        "losses": losses, "params": flat(model.parameters()), "loaded": snapshot,
        "checkpoint_world_size": fabric.strategy.checkpoint_world_size,
        "lr": [g["lr"] for g in opt.param_groups],
    })  # fmt: skip


# =========================================================================================== Trainer


class LitModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt, sched = optimizer(self.net)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LossRecorder(pl.Callback):
    """Per optimizer step: the global step and this rank's loss; the engine right after the restore."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float]] = []
        self.loaded: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.loaded = {"step_count": trainer.strategy.engine.step_count, "global_step": trainer.global_step}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps.append((trainer.global_step, float(outputs["loss"])))


def trainer_fit(outdir: str, world_size: int, ckpt_path: str | None) -> None:
    recorder = LossRecorder()
    callbacks: list[pl.Callback] = [recorder]
    if ckpt_path is None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=os.path.join(outdir, "trainer_ckpt"), filename="{epoch}", every_n_epochs=1, save_top_k=-1
            )
        )
    trainer = pl.Trainer(
        strategy=lightning_scape.pytorch.ScapeStrategy(**SCAPE), accelerator="cpu", devices=world_size,
        max_epochs=EPOCHS, callbacks=callbacks, logger=False, enable_progress_bar=False, gradient_clip_val=1.0,
        enable_model_summary=False, enable_checkpointing=ckpt_path is None, num_sanity_val_steps=0,
    )  # fmt: skip
    # The Trainer puts a DistributedSampler(shuffle=True, seed=0) in: for any world size, the ranks' batches of
    # step i together are the same samples when the per-rank batch is GLOBAL_BATCH / world_size.
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH // world_size, shuffle=True)
    trainer.fit(LitModel(), loader, ckpt_path=ckpt_path)
    save(outdir, "trainer", world_size, trainer.global_rank, {
        "steps": recorder.steps, "loaded": recorder.loaded, "global_step": trainer.global_step,
        "step_count": trainer.strategy.engine.step_count, "params": flat(trainer.lightning_module.parameters()),
    })  # fmt: skip


def main() -> None:
    phase, outdir = sys.argv[1:3]
    if phase == "write":
        fabric_write(outdir)
        trainer_fit(outdir, 2, None)
    elif phase == "resume":
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        fabric_resume(outdir, world_size)
        trainer_fit(outdir, world_size, os.path.join(outdir, "trainer_ckpt", f"epoch={SAVE_AT // 4 - 1}.ckpt"))
    else:
        raise SystemExit(f"unknown phase {phase!r}")


if __name__ == "__main__":
    main()
