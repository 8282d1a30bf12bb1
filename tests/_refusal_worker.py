"""Runs one of test_setup_refusals' cases: ``python _refusal_worker.py <case> <outdir>``.

``precision`` and ``ddp_resume`` run in one process and save what they saw as ``<outdir>/<case>.pt``; the
``sgd``, ``fsdp_sgd`` and ``missing_scape`` cases launch two processes (Lightning's ``popen`` launcher re-runs
this command for rank 1) and fail: the test reads what they printed.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from helpers import make_net
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

from lightning_scape import DenseWarmupWarning, OneProcessWarning
from lightning_scape.fabric import ScapeStrategy as FabricScapeStrategy
from lightning_scape.pytorch import ScapeFSDPStrategy, ScapeStrategy

torch.set_num_threads(1)
SCAPE: dict[str, Any] = {"density": 0.1, "chunk_size": 64, "dense_warmup_steps": 1, "density_ramp_steps": 0}


class Net(pl.LightningModule):
    """The tiny net under MSE, with AdamW (or ``optimizer``)."""

    def __init__(self, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW) -> None:
        super().__init__()
        self.net = make_net()
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer(self.parameters(), lr=0.01)


class TwoOptimizers(Net):
    """Two optimizers (manual optimization, as Lightning requires for several)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:  # type: ignore[override]
        first, *rest = self.parameters()
        return [torch.optim.AdamW([first]), torch.optim.Adam(rest)]


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 24, generator=g), torch.randn(16, 8, generator=g)), batch_size=4)


def trainer(strategy: Any, devices: int = 1, **extra: Any) -> pl.Trainer:
    kw: dict[str, Any] = dict(accelerator="cpu", devices=devices, max_steps=2, enable_progress_bar=False)
    kw.update(enable_model_summary=False, logger=False, enable_checkpointing=False, num_sanity_val_steps=0)
    return pl.Trainer(strategy=strategy, **{**kw, **extra})


def error_of(fn: Any) -> str | None:
    try:
        fn()
    except Exception as exc:  # the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return None


def precision(outdir: str) -> None:
    """bf16-true and 16-true under both strategies, two optimizers under both, and the one-process warning of a run
    that trains."""
    out: dict[str, Any] = {}
    for p in ("bf16-true", "16-true"):
        out[f"trainer {p}"] = error_of(lambda p=p: trainer(ScapeStrategy(**SCAPE), precision=p).fit(Net(), loader()))

        def fabric_setup(p: str = p) -> None:
            fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricScapeStrategy(**SCAPE), precision=p)
            fabric.launch()
            model = make_net()
            fabric.setup(model, torch.optim.AdamW(model.parameters()))

        out[f"fabric {p}"] = error_of(fabric_setup)
    out["trainer two optimizers"] = error_of(lambda: trainer(ScapeStrategy(**SCAPE)).fit(TwoOptimizers(), loader()))

    def fabric_two() -> None:
        fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricScapeStrategy(**SCAPE))
        fabric.launch()
        model = make_net()
        first, *rest = model.parameters()
        fabric.setup(model, torch.optim.AdamW([first]), torch.optim.Adam(rest))

    out["fabric two optimizers"] = error_of(fabric_two)
    # Runs whose 2 steps are all inside a 5-step warm-up: with one process nothing is sent, dense or not, so only
    # the OneProcessWarning speaks (the Trainer's notice before the fit, Fabric's before the run and at its end).
    all_dense = {**SCAPE, "dense_warmup_steps": 5}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(ScapeStrategy(**all_dense)).fit(Net(), loader())
        fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricScapeStrategy(**all_dense))
        fabric.launch()
        fabric.strategy.warn_if_all_dense(2)  # what lightning-scape pretrain --devices 1 calls (syntax="cli")
        model = make_net()
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters()))
        x, y = loader().dataset.tensors
        for _ in range(2):
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        fabric.strategy.scape_runtime.end_of_run()  # what teardown and the exit hook call
    out["one_process"] = [str(w.message) for w in caught if issubclass(w.category, OneProcessWarning)]
    out["no_scheduler"] = [str(w.message) for w in caught if "no learning-rate scheduler" in str(w.message)]
    out["dense_warmup"] = [str(w.message) for w in caught if issubclass(w.category, DenseWarmupWarning)]
    torch.save(out, os.path.join(outdir, "precision.pt"))


def ddp_resume(outdir: str) -> None:
    """A SCAPE checkpoint resumed by strategy="ddp" (Trainer) and loaded by Fabric's DDP strategy."""
    out: dict[str, Any] = {}
    ckpt = os.path.join(outdir, "scape.ckpt")
    t = trainer(ScapeStrategy(**SCAPE))
    t.fit(Net(), loader())
    t.save_checkpoint(ckpt)
    for opt in (torch.optim.AdamW, torch.optim.Adam):
        resume = trainer("ddp", max_steps=4)
        out[f"trainer {opt.__name__}"] = error_of(lambda t=resume, o=opt: t.fit(Net(o), loader(), ckpt_path=ckpt))
    path = os.path.join(outdir, "fabric.ckpt")
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricScapeStrategy(**SCAPE))
    fabric.launch()
    model = make_net()
    _, opt = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    fabric.save(path, {"model": model, "optimizer": opt})
    plain = Fabric(accelerator="cpu", devices=1, strategy="ddp")
    plain.launch()
    model = make_net()
    _, opt = plain.setup(model, torch.optim.AdamW(model.parameters()))
    out["fabric ddp"] = error_of(lambda: plain.load(path, {"model": model, "optimizer": opt}))
    torch.save(out, os.path.join(outdir, "ddp_resume.pt"))


def sgd(outdir: str) -> None:
    """Two processes whose optimizer SCAPE does not support: fails at set-up on both ranks."""
    trainer(ScapeStrategy(**SCAPE), devices=2).fit(Net(torch.optim.SGD), loader())


def fsdp_sgd(outdir: str) -> None:
    """As ``sgd``, in the FSDP form (two groups of one process): fails at set-up on both ranks."""
    strategy = ScapeFSDPStrategy(shard_size=1, **SCAPE)
    trainer(strategy, devices=2).fit(Net(torch.optim.SGD), loader())


def missing_scape(outdir: str) -> None:
    """Two processes resuming a checkpoint whose ``.scape`` folder was deleted: fails on both ranks."""
    ckpt = os.path.join(outdir, "two.ckpt")
    t = trainer(ScapeStrategy(**SCAPE), devices=2)
    t.fit(Net(), loader())
    t.save_checkpoint(ckpt)
    if dist.get_rank() == 0:
        shutil.rmtree(ckpt + ".scape")
    dist.barrier()
    trainer(ScapeStrategy(**SCAPE), devices=2, max_steps=4).fit(Net(), loader(), ckpt_path=ckpt)


if __name__ == "__main__":
    case, outdir = sys.argv[1:3]
    cases = {"precision": precision, "ddp_resume": ddp_resume, "sgd": sgd, "fsdp_sgd": fsdp_sgd}
    {**cases, "missing_scape": missing_scape}[case](outdir)
