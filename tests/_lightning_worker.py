"""Worker scripts for the strategy tests: ``python _lightning_worker.py <scenario> <outdir> [args]``.

Every scenario runs on every rank (Lightning's launcher re-runs this script for rank 1, or torchrun /
the test starts the processes) and saves ``<outdir>/<name>_rank<r>.pt`` for the tests to compare with
the bare-engine references of ``_lightning_common``. One launch runs many Trainer/Fabric runs: starting
processes dominates the cost.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
import traceback
from typing import Any

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _lightning_common import BATCH, LR, SCAPE, dataset, flat, lr_lambda, make_net, param_groups  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_scape  # noqa: E402
from lightning_scape import CommunicationMonitor, MaskMonitor  # noqa: E402

# Every all_reduce any code issues, by size: a dense gradient all-reduce would show here.
ALL_REDUCE_NUMELS: list[int] = []
_all_reduce = dist.all_reduce


def _counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    ALL_REDUCE_NUMELS.append(tensor.numel())
    return _all_reduce(tensor, *args, **kwargs)


dist.all_reduce = _counting_all_reduce  # type: ignore[assignment]


def save(outdir: str, name: str, rank: int, obj: Any) -> None:
    torch.save(obj, os.path.join(outdir, f"{name}_rank{rank}.pt"))


def engine_snapshot(engine: Any) -> dict[str, Any]:
    """What the tests compare bitwise: momentum, residual, masks, step, counters (totals)."""
    state = engine.state_dict()
    return {
        "momentum": torch.cat([b["momentum"] for b in state["buckets"]]),
        "residual": torch.cat([b["residual"] for b in state["buckets"]]),
        "last_sent": torch.cat([b["last_sent"] for b in state["buckets"]]),
        "masks": [list(b["masks"]) for b in state["buckets"]],
        "step_count": state["step_count"],
        "refresh_count": state["refresh_count"],
        "total_sent": state["counters"]["total_sent"],
    }


# =========================================================================================== Trainer


class LitModel(pl.LightningModule):
    def __init__(self, inject_inf_at: int | None = None) -> None:
        super().__init__()
        self.net = make_net()
        self.inject_inf_at = inject_inf_at
        self.val_batches = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.inject_inf_at == self.global_step and self.global_rank == 1:
            loss = loss * float("inf")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_batches += 1
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(param_groups(self.net), lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(pl.Callback):
    """Per optimizer step, the engine's own numbers (the monitors' logs must equal them)."""

    def __init__(self, snapshots: bool = False) -> None:
        self.steps: list[dict[str, Any]] = []
        self.snapshots = snapshots
        self._seen = -1
        self.sanity_checked = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen = trainer.global_step

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.sanity_checked = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._seen:
            return
        self._seen = trainer.global_step
        engine = trainer.strategy.engine
        c = engine.counters
        rec = {
            "global_step": trainer.global_step,
            "sent": dict(c.step_sent),
            "dense_equivalent": c.step_dense_equivalent,
            "wait_s": c.step_wait_s,
            "total_sent": c.total_sent_bytes,
            "total_dense_equivalent": c.total_dense_equivalent,
            "total_wait_s": c.total_wait_s,
            "skipped": engine.last_step_skipped,
            "step_count": engine.step_count,
            "masks": None if engine.last_used_masks is None else [m.clone() for m in engine.last_used_masks],
            "residual_norm": engine.residual_norm(),
            "oldest": engine.oldest_unsent_age(),
            "lr": [g["lr"] for g in trainer.optimizers[0].param_groups],
        }
        if self.snapshots:
            rec["params"] = flat(pl_module.parameters())
            rec["engine"] = engine_snapshot(engine)
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            rec["scale"] = None if scaler is None else scaler.get_scale()
        self.steps.append(rec)


def loaders(val: bool = False) -> tuple[DataLoader, DataLoader | None]:
    train = DataLoader(dataset(), batch_size=BATCH)
    return train, (DataLoader(dataset(), batch_size=8) if val else None)


def trainer_kwargs(**extra: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        accelerator="cpu",
        devices=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        max_epochs=2,
        num_sanity_val_steps=0,
    )
    kw.update(extra)
    return kw


def fit_and_record(name: str, outdir: str, strategy: Any, model: Any = None, val: bool = False,
                   ckpt_path: str | None = None, recorder: Recorder | None = None, **kw: Any) -> pl.Trainer:
    model = model if model is not None else LitModel()
    recorder = recorder or Recorder()
    callbacks = [recorder, *kw.pop("callbacks", [])]
    trainer = pl.Trainer(strategy=strategy, callbacks=callbacks, **trainer_kwargs(**kw))
    train, val_loader = loaders(val)
    t0 = time.perf_counter()
    trainer.fit(model, train, val_loader, ckpt_path=ckpt_path)
    lm = trainer.lightning_module
    out = {
        "params": flat(lm.parameters()),
        "steps": recorder.steps,
        "seconds": time.perf_counter() - t0,
        "ddp_wrapped": isinstance(trainer.strategy.model, torch.nn.parallel.DistributedDataParallel),
        "sampler": type(trainer.train_dataloader.sampler).__name__,
        "config": trainer.strategy.scape_config,
        "global_step": trainer.global_step,
        "sanity_checked": recorder.sanity_checked,
        "val_batches": getattr(lm, "val_batches", 0),
        "val_loss": float(trainer.callback_metrics.get("val_loss", torch.tensor(float("nan")))),
        "progress_bar": dict(trainer.progress_bar_metrics),
        "optimizer_type": type(trainer.strategy.optimizers[0]).__name__,
        "engine": engine_snapshot(trainer.strategy.scape_optimizers[0].engine),
    }
    save(outdir, name, trainer.global_rank, out)
    return trainer


def expect_failure(name: str, outdir: str, fn: Any) -> None:
    """Run ``fn``; save the error message (both ranks must fail, neither may hang)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        fn()
        result = {"error": None}
    except Exception as exc:  # the test inspects the message
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    save(outdir, name, rank, result)


def trainer_suite(outdir: str) -> None:
    ScapeStrategy = lightning_scape.pytorch.ScapeStrategy
    sharp = dict(SCAPE)
    # 1. The registered name with the default configuration.
    fit_and_record("default", outdir, "scape", max_epochs=None, max_steps=2)
    ALL_REDUCE_NUMELS.clear()
    # 2. Accumulation + norm clipping + LR schedule + validation and sanity check + the monitors.
    logdir = os.path.join(outdir, "logs")
    fit_and_record(
        "main",
        outdir,
        ScapeStrategy(**sharp),
        val=True,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        num_sanity_val_steps=1,
        limit_val_batches=2,
        logger=CSVLogger(logdir, name="csv", version=0),
        log_every_n_steps=1,
        callbacks=[CommunicationMonitor(), MaskMonitor(topk_every_n_steps=2)],
    )
    save(outdir, "all_reduce_main", dist.get_rank(), list(ALL_REDUCE_NUMELS))
    # 3. Clipping by value (and no monitor: the only all-reduces left are scalars).
    ALL_REDUCE_NUMELS.clear()
    fit_and_record("value", outdir, ScapeStrategy(**sharp), gradient_clip_val=0.02, gradient_clip_algorithm="value")
    save(outdir, "all_reduce_value", dist.get_rank(), list(ALL_REDUCE_NUMELS))
    # 4. bf16 autocast.
    fit_and_record("bf16", outdir, ScapeStrategy(**sharp), precision="bf16-mixed")
    # 5. fp16 with a GradScaler and an inf on rank 1 at step 3 (a sparse step).
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    fit_and_record(
        "fp16",
        outdir,
        ScapeStrategy(**sharp),
        model=LitModel(inject_inf_at=3),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        recorder=Recorder(snapshots=True),
    )
    # 6. torch.compile (AOT autograd: the post-accumulate-grad hooks must still fire).
    compiled = torch.compile(LitModel(), backend="aot_eager")
    fit_and_record("compiled", outdir, ScapeStrategy(**sharp), model=compiled, max_epochs=1)
    # 7. Resume: uninterrupted 4 epochs vs 2 epochs + checkpoint + 2 more.
    fit_and_record("uninterrupted", outdir, ScapeStrategy(**sharp), max_epochs=4)
    ckdir = os.path.join(outdir, "ckpt")
    ckpt = ModelCheckpoint(dirpath=ckdir, filename="e{epoch}", save_top_k=1, monitor="step", mode="max",
                           save_last=True)
    fit_and_record("first_half", outdir, ScapeStrategy(**sharp), max_epochs=2, enable_checkpointing=True,
                   callbacks=[ckpt])
    last = os.path.join(ckdir, "last.ckpt")
    fit_and_record("resumed", outdir, ScapeStrategy(**sharp), max_epochs=4, ckpt_path=last)
    rank = dist.get_rank()
    save(outdir, "ckpt_files", rank, sorted(os.listdir(ckdir)) + sorted(os.listdir(last + ".scape")))
    # 8. Refusals, before anything is loaded: another configuration, a truncated rank file (rank 1 only).
    expect_failure("other_config", outdir, lambda: pl.Trainer(
        strategy=ScapeStrategy(**{**sharp, "density": 0.2}), **trainer_kwargs(max_epochs=3)
    ).fit(LitModel(), loaders()[0], ckpt_path=last))
    bad = os.path.join(outdir, "bad.ckpt")
    if rank == 0:
        shutil.copy(last, bad)
        shutil.copytree(last + ".scape", bad + ".scape")
        with open(bad + ".scape/rank-00001.pt", "r+b") as f:
            f.truncate(os.path.getsize(bad + ".scape/rank-00001.pt") // 2)
    dist.barrier()
    probe = LitModel()
    before = flat(probe.parameters())

    def resume_truncated() -> None:
        pl.Trainer(strategy=ScapeStrategy(**sharp), **trainer_kwargs(max_epochs=3)).fit(probe, loaders()[0],
                                                                                       ckpt_path=bad)

    expect_failure("truncated", outdir, resume_truncated)
    save(outdir, "truncated_params", rank, {"before": before, "after": flat(probe.parameters())})


def trainer_resume_other_world(outdir: str, ckpt: str) -> None:
    """One process resuming a checkpoint written by two: refused with an error that says so."""
    ScapeStrategy = lightning_scape.pytorch.ScapeStrategy
    model = LitModel()
    before = flat(model.parameters())
    expect_failure("one_rank", outdir, lambda: pl.Trainer(
        strategy=ScapeStrategy(**SCAPE), **trainer_kwargs(devices=1, max_epochs=3)
    ).fit(model, loaders()[0], ckpt_path=ckpt))
    save(outdir, "one_rank_params", 0, {"before": before, "after": flat(model.parameters())})


# ============================================================================================ Fabric


def fabric_loop(fabric: Fabric, model: Any, opt: Any, sched: Any, start: int, stop: int,
                accumulate: int = 1, max_norm: float | None = None, inject_inf_at: int | None = None) -> list[float]:
    """Optimizer steps ``start``..``stop-1`` over this rank's batches (the data order of the reference)."""
    from _lightning_common import rank_batches

    batches = rank_batches(fabric.global_rank, fabric.world_size, epochs=8)
    norms = []
    for step in range(start, stop):
        for micro in range(accumulate):
            x, y = batches[step * accumulate + micro]
            last = micro == accumulate - 1
            with fabric.no_backward_sync(model, enabled=not last):
                loss = torch.nn.functional.mse_loss(model(x), y)
                if inject_inf_at == step and fabric.global_rank == 1 and last:
                    loss = loss * float("inf")
                fabric.backward(loss / accumulate)
        if max_norm is not None:
            norms.append(float(fabric.clip_gradients(model, opt, max_norm=max_norm, error_if_nonfinite=False)))
        opt.step()
        sched.step()
        opt.zero_grad()
    return norms


def fabric_setup(fabric: Fabric, separately: bool = True) -> tuple[Any, Any, Any]:
    net = make_net()
    if separately:  # litgpt's order: model first, then an optimizer over its parameters
        model = fabric.setup_module(net)
        opt = torch.optim.AdamW(param_groups(net), lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        opt = fabric.setup_optimizers(opt)
    else:
        opt = torch.optim.AdamW(param_groups(net), lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        model, opt = fabric.setup(net, opt)
    return model, opt, sched


def fabric_suite(outdir: str) -> None:
    from lightning.fabric.plugins.precision.amp import MixedPrecision

    ScapeStrategy = lightning_scape.ScapeStrategy
    rank = int(os.environ["RANK"])
    # 1. The registered name, default configuration, joint set-up.
    fabric = Fabric(accelerator="cpu", devices=2, strategy="scape")
    fabric.launch()
    model, opt, sched = fabric_setup(fabric, separately=False)
    fabric_loop(fabric, model, opt, sched, 0, 2)
    save(outdir, "f_default", rank, {
        "config": fabric.strategy.scape_config,
        "wrapped": type(model._forward_module).__name__,
        "sent": dict(fabric.strategy.engine.counters.total_sent),
        "strategy": type(fabric.strategy).__name__,
    })
    # 2. Accumulation (no_backward_sync) + clip_gradients returning the global norm + monitors; set up
    #    separately (litgpt); steps 0..7.
    comm, masks = CommunicationMonitor(), MaskMonitor(topk_every_n_steps=2)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ScapeStrategy(**SCAPE), callbacks=[comm, masks])
    fabric.launch()
    model, opt, sched = fabric_setup(fabric)
    engine = fabric.strategy.engine
    logged, recorded = [], []
    norms = []
    for step in range(8):
        norms += fabric_loop(fabric, model, opt, sched, step, step + 1, accumulate=2, max_norm=0.5)
        c = engine.counters
        recorded.append({"sent": c.step_sent_bytes, "dense_equivalent": c.step_dense_equivalent,
                         "values": c.step_sent["values"], "wait_s": c.step_wait_s})
        logged.append({**comm.compute(), **masks.compute()})
    save(outdir, "f_main", rank, {"params": flat(model.parameters()), "norms": norms, "logged": logged,
                                  "recorded": recorded, "engine": engine_snapshot(engine)})
    # 3. Resume at step 3 (mid-epoch, sparse phase): uninterrupted 0..7 vs 0..2 + save + load + 3..7.
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ScapeStrategy(**SCAPE))
    fabric.launch()
    model, opt, sched = fabric_setup(fabric)
    fabric_loop(fabric, model, opt, sched, 0, 8, max_norm=1.0)
    save(outdir, "f_uninterrupted", rank, {"params": flat(model.parameters()),
                                           "engine": engine_snapshot(fabric.strategy.engine)})
    path = os.path.join(outdir, "fabric.ckpt")
    model, opt, sched = fabric_setup(fabric)
    fabric_loop(fabric, model, opt, sched, 0, 3, max_norm=1.0)
    fabric.save(path, {"model": model, "optimizer": opt, "scheduler": sched, "step": 3})
    model, opt, sched = fabric_setup(fabric)
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    remainder = fabric.load(path, state)
    fabric_loop(fabric, model, opt, sched, remainder["step"], 8, max_norm=1.0)
    save(outdir, "f_resumed", rank, {"params": flat(model.parameters()),
                                     "engine": engine_snapshot(fabric.strategy.engine)})
    # 4. Refusals: a checkpoint from another configuration; a truncated main file.
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ScapeStrategy(**{**SCAPE, "chunk_size": 128}))
    fabric.launch()
    model, opt, sched = fabric_setup(fabric)
    before = flat(model.parameters())
    expect_failure("f_other_config", outdir, lambda: fabric.load(path, {"model": model, "optimizer": opt}))
    save(outdir, "f_other_config_params", rank, {"before": before, "after": flat(model.parameters())})
    # 5. fp16 with a GradScaler and an inf on rank 1 at step 3.
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ScapeStrategy(**SCAPE),
                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    fabric.launch()
    model, opt, sched = fabric_setup(fabric)
    snaps = []
    for step in range(6):
        fabric_loop(fabric, model, opt, sched, step, step + 1, inject_inf_at=3)
        snaps.append({"params": flat(model.parameters()), "engine": engine_snapshot(fabric.strategy.engine),
                      "skipped": fabric.strategy.engine.last_step_skipped, "scale": scaler.get_scale()})
    save(outdir, "f_fp16", rank, snaps)
    # 6. torch.compile'd model through fabric.setup.
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ScapeStrategy(**SCAPE))
    fabric.launch()
    net = torch.compile(make_net(), backend="eager")  # the Trainer run covers AOT autograd
    opt = torch.optim.AdamW(param_groups(net), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    model, opt = fabric.setup(net, opt)
    fabric_loop(fabric, model, opt, sched, 0, 4)
    save(outdir, "f_compiled", rank, {"params": flat(model.parameters())})


def fabric_fault(outdir: str, victim: str) -> None:
    """Two "nodes" (NODE_RANK, MASTER_ADDR): rank 1 kills itself in a sparse step; rank 0 must stop."""
    ScapeStrategy = lightning_scape.ScapeStrategy
    fabric = Fabric(accelerator="cpu", devices=1, num_nodes=2,
                    strategy=ScapeStrategy(**SCAPE, collective_timeout_s=float(os.environ["SCAPE_TIMEOUT"])))
    fabric.launch()
    model, opt, sched = fabric_setup(fabric)
    fabric_loop(fabric, model, opt, sched, 0, 3)
    if fabric.global_rank == 1:
        if victim == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # "hang": never issue the next collective
    print(f"READY {time.time()}", flush=True)
    fabric_loop(fabric, model, opt, sched, 3, 6)


# ============================================================================================== main


def main() -> None:
    scenario, outdir, *rest = sys.argv[1:]
    if scenario == "trainer":
        trainer_suite(outdir)
    elif scenario == "trainer_other_world":
        trainer_resume_other_world(outdir, rest[0])
    elif scenario == "fabric":
        fabric_suite(outdir)
    elif scenario == "fault":
        fabric_fault(outdir, rest[0])
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
