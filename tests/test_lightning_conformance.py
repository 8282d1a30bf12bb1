"""Issue 19: SCAPE behaves like a Lightning strategy. Each test runs what a Lightning user writes, with ``"ddp"``
as the reference where DDP can run it.

The multi-process runs are ``@scenario`` functions (``helpers.scenario``), each launch in two gloo processes on
the CPU started once per module by a fixture; the tests below each scenario read what it saved. Tests of an
item are named ``test_item<N>_...`` after the issue's list.
"""

from __future__ import annotations

import functools
import http.server
import itertools
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import (
    BATCH,
    HID,
    IN,
    LR,
    OUT,
    SCAPE,
    child_env,
    dataset,
    engine_snapshot,
    expect_failure,
    flat,
    launcher_args,
    load_outputs,
    lr_lambda,
    make_net,
    param_groups,
    random_batch,
    rank_batches,
    rank_file_names,
    rel_err,
    run_script,
    same,
    save_output,
    scenario,
)
from lightning.fabric import Fabric
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    BaseFinetuning,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader

import lightning_scape
from lightning_scape import AdamS, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator
from lightning_scape.comm.wire import all_reduce_bytes
from lightning_scape.examples.workloads import free_port
from lightning_scape.kernels import mask_positions
from lightning_scape.pytorch import ScapeStrategy
from lightning_scape.runtime import checkpoint_protocol, engine_setup
from lightning_scape.runtime.optimizer import ScapeOptimizer, to_adams

LAUNCH = "items_2_to_9"

# ------------------------------------------------------------------------------ what the scenarios share


def strategies() -> Iterator[tuple[str, Any]]:
    """The reference and SCAPE, by name: every scenario runs the same code under both."""
    yield "ddp", "ddp"
    yield "scape", ScapeStrategy(**SCAPE)


def quiet_trainer(strategy: Any, **extra: Any) -> pl.Trainer:
    """A quiet two-process CPU Trainer, with ``extra`` on top."""
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
    return pl.Trainer(strategy=strategy, **kw)


def loader() -> DataLoader:
    return DataLoader(dataset(), batch_size=BATCH)


class Regression(pl.LightningModule):
    """The tiny net under MSE, AdamW with two param groups, and (``scheduler``) a per-step LambdaLR."""

    def __init__(self, scheduler: str | None = "step") -> None:
        super().__init__()
        self.net = make_net()
        self.scheduler = scheduler

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(param_groups(self.net, LR), lr=LR)
        if self.scheduler is None:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.scheduler}}


class MemoryLogger(Logger):
    """Keeps what is logged: per step, the metrics."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((-1 if step is None else step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def used_lrs(trainer: pl.Trainer) -> list[float]:
    """The learning rates the coming optimizer step uses: the SCAPE engine's param groups, or DDP's optimizer's."""
    if isinstance(trainer.strategy, ScapeStrategy):
        return [g["lr"] for g in trainer.strategy.engine.optimizer.param_groups]
    return [g["lr"] for g in trainer.optimizers[0].param_groups]


class StepLRs(pl.Callback):
    """Per optimizer step, the learning rates the step uses (read just before it)."""

    def __init__(self) -> None:
        self.steps: list[list[float]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.steps.append(used_lrs(trainer))


# ------------------------------------------------------------------ item 2: LearningRateMonitor's keys


@scenario(LAUNCH)
def item2_learning_rate_monitor(outdir: str) -> None:
    """``LearningRateMonitor`` with a per-step scheduler and without one, under DDP and SCAPE."""
    for scheduler in ("step", None):
        for name, strategy in strategies():
            logger, used = MemoryLogger(), StepLRs()
            trainer = quiet_trainer(
                strategy, logger=logger, log_every_n_steps=1, callbacks=[LearningRateMonitor(), used]
            )
            trainer.fit(Regression(scheduler), loader())
            save_output(
                outdir, f"item2_{name}_{scheduler}", trainer.global_rank, {"log": logger.rows, "used": used.steps}
            )


@pytest.mark.dist
@pytest.mark.parametrize("scheduler", ["step", None])
def test_item2_learning_rate_monitor_logs_what_it_logs_under_ddp(items_runs: str, scheduler: str | None) -> None:
    ddp, scape = (load_outputs(items_runs, f"item2_{name}_{scheduler}")[0] for name in ("ddp", "scape"))
    keys = {k for _, row in scape["log"] for k in row}
    assert keys == {k for _, row in ddp["log"] for k in row} == {"lr-AdamW/pg1", "lr-AdamW/pg2"}
    assert scape["log"] == ddp["log"]  # the same rows: before every step, and (without a scheduler) every epoch
    # What it logs before a step is what the engine uses in that step: the scheduler moves the engine's LR.
    logged = list({step: [row["lr-AdamW/pg1"], row["lr-AdamW/pg2"]] for step, row in scape["log"]}.values())
    assert logged == scape["used"] == ddp["used"] and len(logged) == 8  # 16 samples per rank, batches of 4, 2 epochs
    assert len({tuple(lrs) for lrs in logged}) == (8 if scheduler else 1)


# --------------------------------------------------------------------------- item 3: the hook order

CALLBACK_HOOKS = (
    "setup", "on_fit_start", "on_sanity_check_start", "on_sanity_check_end", "on_train_start",
    "on_train_epoch_start", "on_train_batch_start", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end", "on_train_epoch_end",
    "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end",
    "on_validation_epoch_end", "on_validation_end", "on_train_end", "on_fit_end", "teardown",
)  # fmt: skip


class HookRecorder(pl.Callback):
    """Every Callback hook Lightning calls, in order, into ``calls`` (the model adds its own hooks there)."""

    def __init__(self, calls: list[str], caught: list[Any]) -> None:
        self.calls = calls
        self.caught = caught
        self.warned_before_first_batch: bool | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.calls.append("on_train_batch_start")
        if self.warned_before_first_batch is None:
            self.warned_before_first_batch = any("dense_warmup_steps" in str(w.message) for w in self.caught)


def _recording(name: str) -> Any:
    def hook(self: HookRecorder, *args: Any, **kwargs: Any) -> None:
        self.calls.append(name)

    return hook


for _hook in CALLBACK_HOOKS:
    if _hook != "on_train_batch_start":
        setattr(HookRecorder, _hook, _recording(_hook))


class DataInHooks(Regression):
    """Builds its data in its own hooks, as a LightningModule may: each call is recorded."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def prepare_data(self) -> None:
        self.calls.append("module.prepare_data")

    def setup(self, stage: str) -> None:
        self.calls.append("module.setup")

    def configure_model(self) -> None:
        self.calls.append("module.configure_model")

    def on_fit_start(self) -> None:
        self.calls.append("module.on_fit_start")

    def on_train_start(self) -> None:
        self.calls.append("module.on_train_start")

    def configure_optimizers(self) -> Any:
        self.calls.append("module.configure_optimizers")
        return super().configure_optimizers()

    def train_dataloader(self) -> DataLoader:
        self.calls.append("module.train_dataloader")
        return loader()

    def val_dataloader(self) -> DataLoader:
        self.calls.append("module.val_dataloader")
        return DataLoader(dataset(), batch_size=8)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


@scenario(LAUNCH)
def item3_hook_order(outdir: str) -> None:
    """Every hook of a two-step fit with a sanity check and validation, under DDP and SCAPE with a fixed form
    (whose default warm-up, 30 steps, outlasts the fit: the warning must come before the first batch)."""
    fixed = ScapeStrategy(density=0.01)  # with the defaults SCAPE chooses its form, and dense steps are no mistake
    for name, strategy in (("ddp", "ddp"), ("scape", fixed)):
        calls: list[str] = []
        with warnings.catch_warnings(record=True) as caught:  # the children run with PYTHONWARNINGS=ignore
            warnings.simplefilter("always")
            recorder = HookRecorder(calls, caught)
            trainer = quiet_trainer(
                strategy, callbacks=[recorder], max_epochs=1, limit_train_batches=2, num_sanity_val_steps=1,
                limit_val_batches=1, val_check_interval=2,
            )  # fmt: skip
            trainer.fit(DataInHooks(calls))
        save_output(outdir, f"item3_{name}", trainer.global_rank, {
            "calls": calls, "warned_before_first_batch": recorder.warned_before_first_batch,
        })  # fmt: skip


@pytest.mark.dist
def test_item3_hooks_run_in_ddps_order(items_runs: str) -> None:
    for ddp, scape in zip(load_outputs(items_runs, "item3_ddp"), load_outputs(items_runs, "item3_scape"), strict=True):
        assert scape["calls"] == ddp["calls"]
        calls = scape["calls"]
        assert calls.index("on_fit_start") < calls.index("module.train_dataloader") < calls.index("on_train_start")
    # The fit never leaves the dense warm-up: rank 0 was told before its first training batch.
    assert [o["warned_before_first_batch"] for o in load_outputs(items_runs, "item3_scape")] == [True, False]


# ------------------------------------------------------------------- item 4: resuming inside SWA's phase

SWA_EPOCHS = 4


def swa_callbacks(ckdir: str | None) -> list[pl.Callback]:
    swa = StochasticWeightAveraging(swa_lrs=0.005, swa_epoch_start=2, annealing_epochs=2, annealing_strategy="linear")
    epochs = EpochLRs()
    if ckdir is None:
        return [swa, epochs]
    return [swa, epochs, ModelCheckpoint(dirpath=ckdir, filename="{epoch}", save_top_k=-1, every_n_epochs=1)]


class EpochLRs(pl.Callback):
    """Per epoch, the learning rates of its first step (after every epoch-start hook, SWA's included)."""

    def __init__(self) -> None:
        self.epochs: dict[int, list[float]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.epochs.setdefault(trainer.current_epoch, used_lrs(trainer))


@scenario(LAUNCH)
def item4_resume_inside_swa(outdir: str) -> None:
    """StochasticWeightAveraging from epoch 2 with a per-epoch LambdaLR: a 4-epoch fit checkpointing every epoch,
    then a fit resumed from the checkpoint of epoch 2 (inside SWA's phase), under DDP and SCAPE."""
    for name, strategy in strategies():
        ckdir = os.path.join(outdir, f"item4_{name}")
        whole = swa_callbacks(ckdir)
        trainer = quiet_trainer(strategy, callbacks=whole, max_epochs=SWA_EPOCHS, enable_checkpointing=True)
        trainer.fit(Regression("epoch"), loader())
        out: dict[str, Any] = {"whole": flat(trainer.lightning_module.parameters()), "whole_lrs": whole[1].epochs}
        resumed = swa_callbacks(None)
        strategy = ScapeStrategy(**SCAPE) if name == "scape" else "ddp"
        trainer = quiet_trainer(strategy, callbacks=resumed, max_epochs=SWA_EPOCHS)
        trainer.fit(Regression("epoch"), loader(), ckpt_path=os.path.join(ckdir, "epoch=2.ckpt"))
        out.update(resumed=flat(trainer.lightning_module.parameters()), resumed_lrs=resumed[1].epochs)
        save_output(outdir, f"item4_{name}", trainer.global_rank, out)


@pytest.mark.dist
def test_item4_resume_inside_stochastic_weight_averaging_continues_as_under_ddp(items_runs: str) -> None:
    ddp, scape = load_outputs(items_runs, "item4_ddp"), load_outputs(items_runs, "item4_scape")
    for r in range(2):
        # The resumed fit continues as the uninterrupted one did: SWA's average, its SWALR and the engine.
        assert torch.equal(scape[r]["resumed"], scape[r]["whole"])
        assert torch.allclose(ddp[r]["resumed"], ddp[r]["whole"], rtol=1e-6, atol=1e-7)
        # The learning rates of the resumed epoch are the uninterrupted run's, and DDP's.
        assert scape[r]["resumed_lrs"] == {3: scape[r]["whole_lrs"][3]}
        assert scape[r]["whole_lrs"] == ddp[r]["whole_lrs"] and scape[r]["resumed_lrs"] == ddp[r]["resumed_lrs"]
    assert torch.equal(scape[0]["resumed"], scape[1]["resumed"])


# --------------------------------------------------------------- item 5: BackboneFinetuning, frozen models


class Finetuned(pl.LightningModule):
    """The tiny net as a backbone (two layers) and a head; the optimizer holds only what is trainable at set-up,
    as Lightning's fine-tuning docs write it (``freeze_all``: the head's parameters, all frozen at set-up)."""

    def __init__(self, freeze_all: bool = False) -> None:
        super().__init__()
        net = make_net()
        self.backbone, self.head = net[:4], net[4]
        self.freeze_all = freeze_all

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> Any:
        params = self.head.parameters() if self.freeze_all else filter(lambda p: p.requires_grad, self.parameters())
        return torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.95))


class UnfreezeHeadThenBackbone(BaseFinetuning):
    """Everything frozen at set-up; the head trains from epoch 0 (its parameters are in the optimizer already),
    the backbone from epoch 2 in a param group of its own."""

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module)

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
        if epoch == 0:
            self.make_trainable(pl_module.head)
        if epoch == 2:
            optimizer.add_param_group({"params": list(pl_module.backbone.parameters()), "lr": LR / 10})
            self.make_trainable(pl_module.backbone)


class FinetuneRecorder(pl.Callback):
    """Per optimizer step: the loss on this rank, the backbone, and (SCAPE) the engine's buckets and bytes."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        rec = {"loss": float(outputs["loss"]), "backbone": flat(pl_module.backbone.parameters())}
        if isinstance(trainer.strategy, ScapeStrategy):
            engine = trainer.strategy.engine
            rec.update(
                numels=[bs.layout.numel for bs in engine.buckets],
                dense_equivalent=engine.counters.step_dense_equivalent,
                step_count=engine.step_count,
            )
        self.steps.append(rec)


@scenario(LAUNCH)
def item5_backbone_finetuning(outdir: str) -> None:
    """``BackboneFinetuning`` unfreezing the backbone at epoch 1 (after SCAPE's dense warm-up), under DDP and
    SCAPE, checkpointing every epoch (issue 32 resumes them); then, SCAPE only, a model all frozen at set-up (DDP
    refuses it: its error is kept)."""
    for name, strategy in strategies():
        recorder = FinetuneRecorder()
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1)
        every_epoch = ModelCheckpoint(dirpath=os.path.join(outdir, f"item5_{name}"), filename="{epoch}", save_top_k=-1)
        callbacks = [finetuning, recorder, every_epoch]
        trainer = quiet_trainer(strategy, callbacks=callbacks, max_epochs=4, enable_checkpointing=True)
        trainer.fit(Finetuned(), loader())
        out = {"steps": recorder.steps, "params": flat(trainer.lightning_module.parameters())}
        if name == "scape":
            out["state_layout"] = trainer.strategy.engine.state_dict()["layout"]
        save_output(outdir, f"item5_{name}", trainer.global_rank, out)
    expect_failure(
        "item5_ddp_all_frozen",
        outdir,
        lambda: quiet_trainer("ddp", callbacks=[UnfreezeHeadThenBackbone()]).fit(Finetuned(freeze_all=True), loader()),
    )
    recorder = FinetuneRecorder()
    trainer = quiet_trainer(ScapeStrategy(**SCAPE), callbacks=[UnfreezeHeadThenBackbone(), recorder], max_epochs=4)
    trainer.fit(Finetuned(freeze_all=True), loader())
    params = flat(trainer.lightning_module.parameters())
    save_output(outdir, "item5_scape_all_frozen", trainer.global_rank, {"steps": recorder.steps, "params": params})


def epoch_losses(outs: list[dict[str, Any]]) -> list[float]:
    """Per epoch (4 steps), the mean loss over the steps and the ranks."""
    steps = [sum(o["steps"][i]["loss"] for o in outs) / len(outs) for i in range(len(outs[0]["steps"]))]
    return [sum(steps[i : i + 4]) / 4 for i in range(0, len(steps), 4)]


@pytest.mark.dist
def test_item5_backbone_finetuning_trains_the_backbone_like_ddp(items_runs: str) -> None:
    ddp, scape = load_outputs(items_runs, "item5_ddp"), load_outputs(items_runs, "item5_scape")
    head, backbone = OUT * HID + OUT, IN * HID + HID + HID * HID + HID
    for outs in (ddp, scape):
        for o in outs:
            trace = [s["backbone"] for s in o["steps"]]
            assert all(torch.equal(t, trace[0]) for t in trace[:4])  # frozen through epoch 0
            assert not torch.equal(trace[4], trace[3])  # trained from the first step of epoch 1
    for o in scape:
        steps = o["steps"]
        # The backbone joined the engine after step 4 (the warm-up was 2 steps): in buckets of its own, its
        # bytes counted from then on (what DDP's all-reduce of the trainable gradients would send).
        assert sum(steps[3]["numels"]) == head and sum(steps[4]["numels"]) == head + backbone
        for s in steps:
            assert s["dense_equivalent"] == sum(all_reduce_bytes(n, 4, 2) for n in s["numels"])
        assert [s["step_count"] for s in steps] == list(range(1, 17))
        assert {group for group, _, _ in o["state_layout"]} == {0, 1}  # the checkpointed state holds it
    assert torch.equal(scape[0]["params"], scape[1]["params"])  # replicas identical
    # The loss trend follows DDP's (AdamS on SCAPE's sparse steps against AdamW on dense ones): two dense steps, then
    # d = 0.1, so over these 16 steps SCAPE lags dense AdamW (by 17% at most: 1.761 against 1.501 at epoch 2).
    ddp_losses, scape_losses = epoch_losses(ddp), epoch_losses(scape)
    print(f"mean loss per epoch: DDP {ddp_losses}, SCAPE {scape_losses}")
    for losses in (ddp_losses, scape_losses):
        assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses
    assert all(s <= 1.2 * d for s, d in zip(scape_losses, ddp_losses, strict=True))


@pytest.mark.dist
def test_item5_a_model_all_frozen_at_setup_trains_once_unfrozen(items_runs: str) -> None:
    (ddp_error, _) = (o["error"] for o in load_outputs(items_runs, "item5_ddp_all_frozen"))
    assert "DistributedDataParallel is not needed" in ddp_error  # DDP itself refuses such a model at set-up
    outs = load_outputs(items_runs, "item5_scape_all_frozen")
    for o in outs:
        steps = o["steps"]
        assert [s["step_count"] for s in steps] == list(range(1, 17))  # the head joined before the first step
        assert sum(steps[0]["numels"]) == OUT * HID + OUT and len(steps[-1]["numels"]) > len(steps[0]["numels"])
        assert all(torch.equal(s["backbone"], steps[0]["backbone"]) for s in steps[:8])
        assert not torch.equal(steps[8]["backbone"], steps[7]["backbone"])
    assert torch.equal(outs[0]["params"], outs[1]["params"])


def _joining_worker(rank: int, comm: Communicator) -> dict[str, Any]:
    """A model all frozen at set-up whose head is unfrozen after 2 steps, and whose body joins as a new param
    group after 6: integer fp64 gradients (every sum exact); per bucket, the sum of this rank's gradients since
    it joined, what it sent, and its residual."""
    cfg = ScapeConfig(density=0.05, chunk_size=64, dense_warmup_steps=0, density_ramp_steps=0, exploration=0.25)
    net = make_net(0, torch.float64)
    net.requires_grad_(False)
    head, body = list(net[4].parameters()), [*net[0].parameters(), *net[2].parameters()]
    adamw = torch.optim.AdamW(head, lr=1e-3)
    adams = to_adams(adamw)
    engine = ScapeEngine(adams, cfg, comm, param_order=list(net.parameters()))
    opt = ScapeOptimizer(adams, engine, source=adamw)
    gen = torch.Generator().manual_seed(rank)
    sums: list[torch.Tensor] = []
    sent: list[torch.Tensor] = []
    for step in range(12):
        if step == 2:
            for p in head:
                p.requires_grad_(True)
        if step == 6:
            opt.add_param_group({"params": body, "lr": 1e-4})
            for p in body:
                p.requires_grad_(True)
        opt.zero_grad()  # parameters unfrozen since the last step join here
        for p in head + body:
            if p.requires_grad:
                assert p.grad is not None
                p.grad.copy_(torch.randint(-1000, 1000, p.shape, generator=gen).double())
        masks = engine.current_masks() if engine.buckets else []
        opt.step()
        for i, bs in enumerate(engine.buckets):
            if i == len(sums):
                sums.append(torch.zeros_like(bs.residual))
                sent.append(torch.zeros_like(bs.residual))
            sums[i] += bs.grads
            sent[i].index_add_(0, mask_positions(masks[i], bs.layout.chunk_size), bs.values)
    return {
        "sums": sums, "sent": sent, "residual": [bs.residual.clone() for bs in engine.buckets],
        "step_count": engine.step_count, "params": flat(net.parameters()),
        "lrs": [g["lr"] for g in adamw.param_groups], "groups": [bs.layout.group_index for bs in engine.buckets],
    }  # fmt: skip


def test_item5_parameters_that_join_later_lose_no_gradient_mass() -> None:
    outs = simulate(2, _joining_worker)
    for o in outs:
        assert o["step_count"] == 10  # steps with nothing trainable do nothing and are not counted
        assert o["groups"][0] == 0 and set(o["groups"][1:]) == {1}  # the head's bucket, then the body's
        assert o["lrs"] == [1e-3, 1e-4]  # the new group is the user's optimizer's too
        for total, sent, residual in zip(o["sums"], o["sent"], o["residual"], strict=True):
            assert torch.equal(total, sent + residual)  # every gradient value was sent or is still held
            assert sent.any()
    assert torch.equal(outs[0]["params"], outs[1]["params"])


# ------------------------------------------------ issue 32, item 1: resuming after BaseFinetuning unfroze


class UnfreezeAgainOnResume(BackboneFinetuning):
    """``BackboneFinetuning`` that unfreezes the backbone again at every later epoch. Nothing changes in an
    uninterrupted fit; in a resumed one, whose ``BaseFinetuning.setup`` froze the backbone again, it trains on
    (what Lightning's fix of its issue #21901 restores). It restores the state ``BackboneFinetuning`` saved."""

    @property
    def state_key(self) -> str:
        return BackboneFinetuning.__qualname__

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
        super().finetune_function(pl_module, epoch, optimizer)
        if epoch > self.unfreeze_backbone_at_epoch:
            self.make_trainable(pl_module.backbone)


class EngineAtStart(pl.Callback):
    """The engine's whole state as the fit's training starts (after the checkpoint loaded)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if isinstance(trainer.strategy, ScapeStrategy):
            self.state = trainer.strategy.engine.state_dict()


class OnEpochLayerFinetuning(BaseFinetuning):
    """Lightning's callback of ``test_base_finetuning_internal_optimizer_metadata``: every layer frozen, and at
    each epoch the next one unfrozen in a param group of its own."""

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.layer)

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
        self.unfreeze_and_add_param_group(pl_module.layer[epoch + 1], optimizer)


class SixLayers(BoringModel):
    """Lightning's ``FreezeModel`` of that test, with AdamW (SCAPE steps AdamS; SGD is refused)."""

    def __init__(self) -> None:
        super().__init__()
        widths = [(32, False), (32, True), (32, False), (32, True), (32, False), (2, True)]
        self.layer = torch.nn.Sequential(*(torch.nn.Linear(32, out, bias=bias) for out, bias in widths))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.layer[0].parameters(), lr=1e-3)


class FinetunedBN(Finetuned):
    """:class:`Finetuned` with a BatchNorm layer in the backbone and an optimizer over the head alone, as
    ``BackboneFinetuning``'s docs write it: ``train_bn=True`` keeps the BatchNorm layer trainable while the rest of
    the backbone is frozen, outside the optimizer until the backbone's param group takes it."""

    def __init__(self) -> None:
        super().__init__(freeze_all=True)
        self.backbone = torch.nn.Sequential(self.backbone[0], torch.nn.BatchNorm1d(HID), *self.backbone[1:])


RESUMES = {"again": UnfreezeAgainOnResume, "frozen": BackboneFinetuning}


def resume_finetuning(name: str, model: type[Finetuned], finetuning: type[BackboneFinetuning], ckpt: str) -> Any:
    """A 4-epoch fit resumed from ``ckpt`` with ``finetuning`` (unfreezing at epoch 1): per step what
    :class:`FinetuneRecorder` records, the final parameters, and (SCAPE) the engine's state at the start and end."""
    recorder, probe = FinetuneRecorder(), EngineAtStart()
    callbacks = [finetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1), recorder, probe]
    trainer = quiet_trainer(ScapeStrategy(**SCAPE) if name == "scape" else "ddp", callbacks=callbacks, max_epochs=4)
    trainer.fit(model(), loader(), ckpt_path=ckpt)
    out = {"steps": recorder.steps, "params": flat(trainer.lightning_module.parameters())}
    if name == "scape":
        out.update(loaded=probe.state, final=trainer.strategy.engine.state_dict())
    return out


@scenario(LAUNCH)
def issue32_resume_after_unfreezing(outdir: str) -> None:
    """Item 5's fits resumed from their checkpoint of epoch 1, the epoch that unfroze the backbone, under DDP and
    SCAPE: with ``BackboneFinetuning`` itself, which leaves the backbone frozen in a resumed fit (Lightning 2.6,
    its issue #21901), and with :class:`UnfreezeAgainOnResume`; the same for :class:`FinetunedBN`, uninterrupted
    first. Then Lightning's ``test_base_finetuning_internal_optimizer_metadata`` under SCAPE (DDP refuses its model,
    all frozen at set-up)."""
    rank = dist.get_rank()
    for name, strategy in strategies():
        ckpt = os.path.join(outdir, f"item5_{name}", "epoch=1.ckpt")
        out = {kind: resume_finetuning(name, Finetuned, finetuning, ckpt) for kind, finetuning in RESUMES.items()}
        save_output(outdir, f"issue32_{name}", rank, out)
        recorder, ckdir = FinetuneRecorder(), os.path.join(outdir, f"issue32_bn_{name}")
        every_epoch = ModelCheckpoint(dirpath=ckdir, filename="{epoch}", save_top_k=-1)
        callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1), recorder]
        trainer = quiet_trainer(strategy, callbacks=[*callbacks, every_epoch], max_epochs=4, enable_checkpointing=True)
        trainer.fit(FinetunedBN(), loader())
        out = {"whole": {"steps": recorder.steps, "params": flat(trainer.lightning_module.parameters())}}
        ckpt = os.path.join(ckdir, "epoch=1.ckpt")
        out |= {kind: resume_finetuning(name, FinetunedBN, finetuning, ckpt) for kind, finetuning in RESUMES.items()}
        save_output(outdir, f"issue32_bn_{name}", rank, out)
    finetuning = OnEpochLayerFinetuning()
    last = ModelCheckpoint(dirpath=os.path.join(outdir, "issue32"), save_last=True)
    kw: dict[str, Any] = dict(limit_train_batches=1, limit_val_batches=0)
    trainer = quiet_trainer(
        ScapeStrategy(**SCAPE), callbacks=[finetuning, last], max_epochs=5, enable_checkpointing=True, **kw
    )
    trainer.fit(SixLayers())
    save_output(outdir, "issue32_metadata", rank, [g["params"] for g in finetuning._internal_optimizer_metadata[0]])
    trainer = quiet_trainer(ScapeStrategy(**SCAPE), callbacks=[OnEpochLayerFinetuning()], max_epochs=10, **kw)
    expect_failure("issue32_resumed_metadata", outdir, lambda: trainer.fit(SixLayers(), ckpt_path=last.last_model_path))


@pytest.mark.dist
def test_issue32_a_resumed_fit_that_unfreezes_the_backbone_again_continues_as_the_uninterrupted_one(
    items_runs: str,
) -> None:
    for name in ("ddp", "scape"):
        whole, resumed = load_outputs(items_runs, f"item5_{name}"), load_outputs(items_runs, f"issue32_{name}")
        for w, r in zip(whole, resumed, strict=True):
            steps = r["again"]["steps"]
            assert len(steps) == 8 and not torch.equal(steps[0]["backbone"], steps[-1]["backbone"])  # it trains
            if name == "ddp":
                # DDP never synchronises a backbone unfrozen after its set-up: the ranks' copies drift apart, the
                # checkpoint holds rank 0's, and the resumed fit cannot be the uninterrupted one.
                continue
            # SCAPE: the backbone's buckets waited for it while it was frozen, and joined as saved: bitwise.
            assert torch.equal(r["again"]["params"], w["params"])
            for a, b in zip(steps, w["steps"][8:], strict=True):
                assert a["loss"] == b["loss"] and torch.equal(a["backbone"], b["backbone"])
                assert a["numels"] == b["numels"] and a["step_count"] == b["step_count"]
                assert a["dense_equivalent"] == b["dense_equivalent"]


@pytest.mark.dist
def test_issue32_backbone_finetuning_resumed_after_its_epoch_leaves_the_backbone_frozen_as_ddp_does(
    items_runs: str,
) -> None:
    head = OUT * HID + OUT
    for name in ("ddp", "scape"):
        whole, resumed = load_outputs(items_runs, f"item5_{name}"), load_outputs(items_runs, f"issue32_{name}")
        at_checkpoint = whole[0]["steps"][7]["backbone"]  # rank 0's after epoch 1's last step, what it saved
        for w, r in zip(whole, resumed, strict=True):
            steps = r["frozen"]["steps"]
            assert len(steps) == 8 and all(torch.equal(s["backbone"], at_checkpoint) for s in steps)
            assert not torch.equal(r["frozen"]["params"], w["params"])  # the head trained on
            if name == "ddp":
                continue
            assert [s["step_count"] for s in steps] == list(range(9, 17)) and all(
                s["numels"] == [head] for s in steps
            )  # only the head is sent
            # The backbone's buckets wait, as a torch optimizer keeps a frozen parameter's state: still in the
            # state saved 8 steps later, unchanged but for their step counts, which moved on by the 8 steps.
            loaded, final = r["frozen"]["loaded"], r["frozen"]["final"]
            assert loaded["layout"] == final["layout"] == w["state_layout"] and len(final["layout"]) > 1
            for before, after in zip(loaded["buckets"][1:], final["buckets"][1:], strict=True):
                assert torch.equal(after["momentum"], before["momentum"]) and before["momentum"].any()
                assert torch.equal(after["residual"], before["residual"])
                assert torch.equal(after["last_sent"], before["last_sent"] + 8)
                assert after["first_step"] == before["first_step"] + 8 and after["params"] == before["params"]


@pytest.mark.dist
def test_issue32_a_batchnorm_layer_in_the_refrozen_backbone_trains_on_as_under_ddp(items_runs: str) -> None:
    """``train_bn=True`` keeps the BatchNorm layer trainable when the resumed fit freezes the backbone again: it
    trains on and the linear layers stay as saved, under DDP and SCAPE. Under SCAPE it joined the engine before the
    state loaded; the state lays it out again (bitwise the uninterrupted fit when the rest is unfrozen again), or
    gives it a bucket of its own with its saved coordinates' state while the rest of its saved bucket waits."""
    bn = slice(IN * HID + HID, IN * HID + 3 * HID)  # the backbone: the first layer, the BatchNorm layer, the second
    for name in ("ddp", "scape"):
        outs = load_outputs(items_runs, f"issue32_bn_{name}")
        at_checkpoint = outs[0]["whole"]["steps"][7]["backbone"]  # rank 0's, what the checkpoint holds
        linear = torch.ones_like(at_checkpoint, dtype=torch.bool)
        linear[bn] = False
        for o in outs:
            last = o["frozen"]["steps"][-1]["backbone"]
            assert torch.equal(last[linear], at_checkpoint[linear]) and not torch.equal(last[bn], at_checkpoint[bn])
            if name == "ddp":
                continue
            assert torch.equal(o["again"]["params"], o["whole"]["params"])
            steps = o["frozen"]["steps"]
            assert all(s["numels"] == [OUT * HID + OUT, 2 * HID] for s in steps)  # the head; the BatchNorm layer
            final = o["frozen"]["final"]  # the saved buckets of the backbone, still there after the head's and BN's
            assert final["layout"][2:] == o["frozen"]["loaded"]["layout"][1:]
        assert torch.equal(outs[0]["frozen"]["params"], outs[1]["frozen"]["params"]) or name == "ddp"


@pytest.mark.dist
def test_issue32_lightnings_metadata_test_resumes_to_its_index_error_under_scape(items_runs: str) -> None:
    """Lightning's ``test_base_finetuning_internal_optimizer_metadata``: six param groups recorded, and the resumed
    fit (all six put back, every layer frozen again) reaches epoch 5, whose layer 6 does not exist."""
    for groups in load_outputs(items_runs, "issue32_metadata"):
        assert groups == [
            ["layer.0.weight"],
            *([f"layer.{i}.weight", f"layer.{i}.bias"][: 1 + i % 2] for i in range(1, 6)),
        ]
    for o in load_outputs(items_runs, "issue32_resumed_metadata"):
        assert o["error"] is not None and "IndexError: index 6 is out of range" in o["error"], o["error"]


# ------------------------------------------------------------- item 9: two remote checkpoints in a row


@scenario(LAUNCH)
def item9_two_remote_checkpoints(outdir: str) -> None:
    """Two checkpoints of different fits served over ``http://`` and resumed one after the other: Lightning reads
    remote files through ``torch.hub``, which caches them by file name (here in a folder per rank)."""
    rank = dist.get_rank()
    remote = os.path.join(outdir, "item9")
    torch.hub.set_dir(os.path.join(outdir, f"item9_hub_rank{rank}"))
    saved = {}
    for name, epochs in (("a", 1), ("b", 2)):
        trainer = quiet_trainer(ScapeStrategy(**SCAPE), max_epochs=epochs)
        trainer.fit(Regression(), loader())
        trainer.save_checkpoint(os.path.join(remote, f"{name}.ckpt"))
        saved[name] = engine_snapshot(trainer.strategy.engine)
    port = [free_port() if rank == 0 else 0]
    server = None
    if rank == 0:
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=remote)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port[0]), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
    dist.broadcast_object_list(port)
    loaded = {}
    for name, epochs in (("a", 1), ("b", 2)):
        probe = LoadedState()
        trainer = quiet_trainer(ScapeStrategy(**SCAPE), max_epochs=epochs + 1, callbacks=[probe])
        trainer.fit(Regression(), loader(), ckpt_path=f"http://127.0.0.1:{port[0]}/{name}.ckpt")
        loaded[name] = probe.loaded
    dist.barrier()
    if server is not None:
        server.shutdown()
    files = {name: rank_file_names(os.path.join(remote, f"{name}.ckpt.scape")) for name in ("a", "b")}
    save_output(outdir, "item9", rank, {"saved": saved, "loaded": loaded, "files": files})


class LoadedState(pl.Callback):
    """The engine's state as the resumed fit starts (right after the checkpoint was loaded)."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.loaded = engine_snapshot(trainer.strategy.engine)


@pytest.mark.dist
def test_item9_a_second_remote_checkpoint_loads_its_own_rank_files(items_runs: str) -> None:
    for o in load_outputs(items_runs, "item9"):
        for name in ("a", "b"):
            for key in ("momentum", "residual", "last_sent", "masks", "step_count", "refresh_count"):
                assert same(o["loaded"][name][key], o["saved"][name][key]), (name, key)
        assert o["saved"]["a"]["step_count"] == 4 and o["saved"]["b"]["step_count"] == 8
        assert o["files"] == {"a": ["rank-00000.pt", "rank-00001.pt"], "b": ["rank-00000.pt", "rank-00001.pt"]}


def test_item9_checkpoints_of_format_1_still_load(tmp_path: Any) -> None:
    """A checkpoint as the previous format wrote it (``rank-00000.pt``, no save id in the name) still loads; a format
    this version does not know is refused, naming the formats it reads."""
    io = TorchCheckpointIO()
    net = make_net()
    opt = engine_setup.build_scape_optimizer(AdamS(net.parameters(), lr=0.01), ScapeConfig(**SCAPE), net, None)
    full = opt.state_dict()
    path = str(tmp_path / "old.ckpt")
    stub = checkpoint_protocol.make_stub(full, "0123abcd")
    stub["scape_checkpoint"]["format"] = 1
    io.save_checkpoint({"optimizer": stub}, path)
    rank_state = {"format": 1, "save_id": "0123abcd", "rank": 0, "world_size": 1, "optimizers": {"optimizer": full}}
    io.save_checkpoint({"scape_rank_state": rank_state}, str(tmp_path / "old.ckpt.scape" / "rank-00000.pt"))
    loaded = checkpoint_protocol.load_rank_states(io, path, {"optimizer": stub}, 0, 1)
    assert same(loaded["optimizer"], full)
    opt.check_state_dict(loaded["optimizer"])
    stub["scape_checkpoint"]["format"] = 3
    with pytest.raises(ValueError, match=r"format 3; this version reads formats \[1, 2\]"):
        checkpoint_protocol.load_rank_states(io, path, {"optimizer": stub}, 0, 1)


# -------------------------------------------- what SCAPE cannot do as DDP does: refused at set-up, named


class TwoOptimizers(Regression):
    """A GAN-style module: two optimizers, stepped by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
            opt.zero_grad()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.net[0].parameters()), torch.optim.Adam(self.net[2:].parameters())


class WithSGD(Regression):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@scenario(LAUNCH)
def item2_what_is_refused(outdir: str) -> None:
    """Two optimizers, and SGD: under DDP they train; under SCAPE each fit stops at set-up."""
    for name, module in (("two_optimizers", TwoOptimizers), ("sgd", WithSGD)):
        scape = quiet_trainer(ScapeStrategy(**SCAPE))
        expect_failure(f"refused_{name}", outdir, lambda m=module, t=scape: t.fit(m(), loader()))
        model = module()
        before = flat(model.parameters())
        quiet_trainer("ddp", max_epochs=1).fit(model, loader())
        save_output(outdir, f"ddp_{name}", dist.get_rank(), not torch.equal(before, flat(model.parameters())))


@pytest.mark.dist
def test_item2_a_second_optimizer_or_sgd_is_refused_at_setup_naming_it_and_the_fix(items_runs: str) -> None:
    for o in load_outputs(items_runs, "refused_two_optimizers"):
        assert "returned 2 (AdamW, Adam)" in o["error"] and "param groups of one AdamS / AdamW" in o["error"]
    for o in load_outputs(items_runs, "refused_sgd"):
        assert "torch.optim.sgd.SGD" in o["error"] and "torch.optim.AdamW" in o["error"], o["error"]
    assert all(load_outputs(items_runs, "ddp_two_optimizers") + load_outputs(items_runs, "ddp_sgd"))  # DDP trains


# ------------------------------------------------------------------------------------------- the launch


@pytest.fixture(scope="module")
def items_runs(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The folder of what this module's scenarios saved: two processes, rank 1 started by Lightning's launcher."""
    out = str(tmp_path_factory.mktemp("conformance"))
    run_script(
        launcher_args("test_lightning_conformance", LAUNCH, out),
        timeout_s=600,
        env=child_env(MASTER_PORT=str(free_port())),
    )
    return out


# =============================================================== items 1, 6, 7, 8 and 10 (their own launch)

LAUNCH_1 = "items_1_6_7_8_10"
# All steps dense (the fits take 8 steps): SCAPE sends what DDP sends, so DDP + AdamS is the reference.
DENSE = {**SCAPE, "dense_warmup_steps": 100}
# Sparse steps at density 1 (every coordinate in the mask): DDP + AdamS again.
DENSITY_ONE = {**SCAPE, "density": 1.0, "dense_warmup_steps": 0, "exploration": 0.0}


def heartbeats() -> int:
    """The SCAPE heartbeat threads alive in this process."""
    return sum(t.name == "scape-heartbeat" and t.is_alive() for t in threading.enumerate())


class HeartbeatProbe(pl.Callback):
    """The heartbeat threads alive at the end of the fit's first training batch."""

    def __init__(self) -> None:
        self.during: int | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.during is None:
            self.during = heartbeats()


def fit_scape_or_ddp(strategy: Any, model: pl.LightningModule, **extra: Any) -> dict[str, Any]:
    """``trainer.fit`` of ``model``; the final parameters, the warnings rank 0 gave, the engine's step count and
    bytes (SCAPE), and the heartbeat threads alive during the fit and after it returned."""
    probe = HeartbeatProbe()
    with warnings.catch_warnings(record=True) as caught:  # the children run with PYTHONWARNINGS=ignore
        warnings.simplefilter("always")
        trainer = quiet_trainer(strategy, callbacks=[probe], **extra)
        trainer.fit(model, loader())
    out: dict[str, Any] = {
        "params": flat(model.parameters()),
        "warnings": [str(w.message) for w in caught],
        "heartbeats": (probe.during, heartbeats()),
    }
    if isinstance(trainer.strategy, ScapeStrategy):
        engine = trainer.strategy.engine
        out.update(step_count=engine.step_count, values=engine.counters.total_sent["values"])
    return out


# ------------------------------------------------------- item 1: several backward passes before one step


class TwoBackwardPasses(pl.LightningModule):
    """Manual optimization with two ``manual_backward`` calls per optimizer step, as Lightning's docs write it.

    ``mode``: "accumulate" (each batch's ``loss / 2``, a step every second batch), "toggle" (the same with the
    first backward inside ``optimizer.toggle_model(sync_grad=False)``, which sends nothing), "closure" (two
    losses, each half the batch, backward inside the closure given to ``optimizer.step``).
    """

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = make_net()
        self.mode = mode

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        if self.mode == "closure":

            def closure() -> torch.Tensor:
                first = torch.nn.functional.mse_loss(self.net(x[:2]), y[:2]) / 2
                self.manual_backward(first)
                second = torch.nn.functional.mse_loss(self.net(x[2:]), y[2:]) / 2
                self.manual_backward(second)
                return first + second

            opt.step(closure=closure)
            opt.zero_grad()
            return
        loss = torch.nn.functional.mse_loss(self.net(x), y) / 2
        if self.mode == "toggle" and batch_idx % 2 == 0:
            with opt.toggle_model(sync_grad=False):
                self.manual_backward(loss)
        else:
            self.manual_backward(loss)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return AdamS(param_groups(self.net, LR), lr=LR)


@scenario(LAUNCH_1)
def item1_two_manual_backward_passes(outdir: str) -> None:
    """Two ``manual_backward`` per step under DDP (with AdamS), and under SCAPE dense, at density 1 and sparse;
    four epochs: 8 steps accumulating, 16 with the closure."""
    runs = [
        ("ddp", "ddp", "accumulate"),
        ("ddp", "ddp", "closure"),
        ("dense", DENSE, "accumulate"),
        ("dense", DENSE, "toggle"),
        ("dense", DENSE, "closure"),
        ("density_one", DENSITY_ONE, "accumulate"),
        ("sparse", SCAPE, "accumulate"),
        ("sparse", SCAPE, "toggle"),
    ]
    for name, options, mode in runs:
        strategy = options if isinstance(options, str) else ScapeStrategy(**options)
        out = fit_scape_or_ddp(strategy, TwoBackwardPasses(mode), max_epochs=4)
        save_output(outdir, f"item1_{name}_{mode}", dist.get_rank(), out)


def item1(runs: str, name: str, mode: str) -> list[dict[str, Any]]:
    return load_outputs(runs, f"item1_{name}_{mode}")


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["accumulate", "closure"])
def test_item1_two_manual_backward_passes_per_step_train_as_under_ddp(items_1_runs: str, mode: str) -> None:
    ddp = item1(items_1_runs, "ddp", mode)
    references = [("dense", mode)] + ([("density_one", mode)] if mode == "accumulate" else [])
    for name, m in references:
        scape = item1(items_1_runs, name, m)
        assert scape[0]["step_count"] == (8 if mode == "accumulate" else 16)
        for r in range(2):
            assert rel_err(scape[r]["params"], ddp[r]["params"]) < 1e-5  # fp32 rounding, summed in another order
        assert torch.equal(scape[0]["params"], scape[1]["params"])
    assert not torch.equal(ddp[0]["params"], flat(make_net().parameters()))  # it trained


@pytest.mark.dist
@pytest.mark.parametrize("name", ["dense", "sparse"])
def test_item1_a_second_backward_sends_and_adds_up_like_toggle_model(items_1_runs: str, name: str) -> None:
    """Two synchronised backward passes give what ``toggle_model(sync_grad=False)`` on the first gives (each pass
    sends, so the values cost more); dense steps send the sum again, bitwise the same."""
    both, toggled = item1(items_1_runs, name, "accumulate"), item1(items_1_runs, name, "toggle")
    for r in range(2):
        if name == "dense":
            assert torch.equal(both[r]["params"], toggled[r]["params"])
        else:
            assert rel_err(both[r]["params"], toggled[r]["params"]) < 1e-5
            assert both[r]["values"] > toggled[r]["values"] > 0
    assert torch.equal(both[0]["params"], both[1]["params"])


@pytest.mark.dist
def test_item8_no_heartbeat_thread_outlives_a_fit(items_1_runs: str) -> None:
    for name, mode in (("dense", "accumulate"), ("sparse", "toggle"), ("density_one", "accumulate")):
        for o in item1(items_1_runs, name, mode):
            assert o["heartbeats"] == (1, 0), (name, mode)  # alive while it trained, gone after fit returned


def test_item1_a_gradient_that_bypassed_autograd_is_refused_naming_the_ways_to_accumulate() -> None:
    """The one gradient that cannot join a step already sent: one reported without autograd's accumulation
    (the hook before it never ran, so it cannot be told apart from what was sent)."""
    net = make_net()
    engine = ScapeEngine(AdamS(net.parameters(), lr=LR), ScapeConfig(**SCAPE))
    x, y = random_batch(0, 4)
    torch.nn.functional.mse_loss(net(x), y).backward()
    with pytest.raises(RuntimeError, match="already sent this step") as err:
        engine._on_grad_ready(next(net.parameters()))
    for way in ("toggle_model(sync_grad=False)", "block_backward_sync()", "fabric.no_backward_sync(model)"):
        assert way in str(err.value)


# ------------------------------------------------- items 1 and 6: Fabric's backward, once or twice a step


def fabric_run(strategy: Any, backward: str, steps: int = 8) -> tuple[torch.Tensor, tuple[int, int]]:
    """``steps`` optimizer steps of the tiny net with AdamS through a two-process Fabric; ``backward``: "plain"
    (``loss.backward()``), "fabric" (``fabric.backward(loss)``), "twice" (two ``fabric.backward`` of halved losses
    per step) or "twice_no_sync" (the first inside ``fabric.no_backward_sync``). Returns the parameters and the
    heartbeat threads alive before and after ``fabric.strategy.teardown()``."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    net = make_net()
    model, opt = fabric.setup(net, AdamS(param_groups(net, LR), lr=LR))
    batches = rank_batches(fabric.global_rank, fabric.world_size, epochs=4)
    per_step = 2 if backward.startswith("twice") else 1
    for step in range(steps):
        for micro in range(per_step):
            x, y = batches[step * per_step + micro]
            loss = torch.nn.functional.mse_loss(model(x), y) / per_step
            if backward == "plain":
                loss.backward()
            elif backward == "twice_no_sync" and micro == 0:
                with fabric.no_backward_sync(model):
                    fabric.backward(loss)
            else:
                fabric.backward(loss)
        opt.step()
        opt.zero_grad()
    params = flat(model.parameters())
    during = heartbeats()
    fabric.strategy.teardown()
    return params, (during, heartbeats())


@scenario(LAUNCH_1)
def items1_6_fabric(outdir: str) -> None:
    """Fabric under DDP (with AdamS) and SCAPE, with each way of calling backward."""
    runs = [
        ("ddp", "ddp", "plain"),
        ("ddp", "ddp", "twice"),
        ("dense", DENSE, "plain"),
        ("dense", DENSE, "fabric"),
        ("dense", DENSE, "twice"),
        ("sparse", SCAPE, "plain"),
        ("sparse", SCAPE, "fabric"),
        ("sparse", SCAPE, "twice"),
        ("sparse", SCAPE, "twice_no_sync"),
    ]
    out = {}
    for name, options, backward in runs:
        strategy = options if isinstance(options, str) else lightning_scape.ScapeStrategy(**options)
        out[f"{name}_{backward}"] = fabric_run(strategy, backward)
    save_output(outdir, "items1_6_fabric", dist.get_rank(), out)


@pytest.mark.dist
def test_item6_fabric_accepts_a_plain_loss_backward_as_with_ddp(items_1_runs: str) -> None:
    for o in load_outputs(items_1_runs, "items1_6_fabric"):
        for name in ("dense", "sparse"):
            assert torch.equal(o[f"{name}_plain"][0], o[f"{name}_fabric"][0])  # the same run as fabric.backward
        assert rel_err(o["dense_plain"][0], o["ddp_plain"][0]) < 1e-5


@pytest.mark.dist
def test_item1_fabric_backward_twice_per_step_adds_up_as_with_ddp(items_1_runs: str) -> None:
    outs = load_outputs(items_1_runs, "items1_6_fabric")
    for o in outs:
        assert rel_err(o["dense_twice"][0], o["ddp_twice"][0]) < 1e-5
        assert rel_err(o["sparse_twice"][0], o["sparse_twice_no_sync"][0]) < 1e-5
    assert torch.equal(outs[0]["sparse_twice"][0], outs[1]["sparse_twice"][0])


@pytest.mark.dist
def test_item8_no_heartbeat_thread_outlives_fabrics_teardown(items_1_runs: str) -> None:
    for o in load_outputs(items_1_runs, "items1_6_fabric"):
        for key, (_, heartbeat) in o.items():
            assert heartbeat == ((0, 0) if key.startswith("ddp") else (1, 0)), key


# ----------------------------------------------------- item 7 and item 10: what set-up refuses, and why


class SubclassedAdamW(torch.optim.AdamW):
    """A user's AdamW with its own ``step`` (it counts its calls)."""

    calls = 0

    def step(self, closure: Any = None) -> Any:
        type(self).calls += 1
        return super().step(closure)


class Configured(pl.LightningModule):
    """The tiny net under MSE; ``configure_optimizers`` returns ``optimizer(self.net)``."""

    def __init__(self, optimizer: Any) -> None:
        super().__init__()
        self.net = make_net()
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return self.optimizer(self.net)


@scenario(LAUNCH_1)
def items7_10_refused_at_setup(outdir: str) -> None:
    """An AdamW subclass under DDP (its step runs) and SCAPE; ``configure_optimizers`` returning None under SCAPE."""
    quiet_trainer("ddp", max_epochs=None, max_steps=2).fit(
        Configured(lambda net: SubclassedAdamW(net.parameters())), loader()
    )
    save_output(outdir, "item7_ddp_calls", dist.get_rank(), SubclassedAdamW.calls)
    subclassed = Configured(lambda net: SubclassedAdamW(net.parameters(), lr=0.02, weight_decay=0.1))
    expect_failure("item7_scape", outdir, lambda: quiet_trainer(ScapeStrategy(**SCAPE)).fit(subclassed, loader()))
    expect_failure(
        "item10_none", outdir, lambda: quiet_trainer(ScapeStrategy(**SCAPE)).fit(Configured(lambda net: None), loader())
    )


@pytest.mark.dist
def test_item7_a_subclass_of_adamw_is_refused_naming_it_and_the_fix(items_1_runs: str) -> None:
    assert load_outputs(items_1_runs, "item7_ddp_calls") == [2, 2]  # DDP runs the subclass's own step
    for o in load_outputs(items_1_runs, "item7_scape"):
        error = o["error"]
        assert error is not None and error.startswith("TypeError")
        assert "SubclassedAdamW subclasses torch.optim.AdamW" in error
        assert "lightning_scape.AdamS(params, lr=0.02, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.1)" in error


@pytest.mark.dist
def test_item10_configure_optimizers_returning_none_is_refused_clearly(items_1_runs: str) -> None:
    for o in load_outputs(items_1_runs, "item10_none"):
        error = o["error"]
        assert error is not None and "configure_optimizers returned None" in error
        assert "_MockOptimizer" not in error and "lightning_scape.AdamS(self.parameters()" in error


def test_item7_subclasses_are_refused_and_exact_adamw_and_adam_still_convert() -> None:
    net = make_net()

    class StepLoggingAdamS(AdamS):
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    class ConvenientAdamS(AdamS):
        pass

    with pytest.raises(TypeError, match=r"SubclassedAdamW subclasses torch\.optim\.AdamW"):
        to_adams(SubclassedAdamW(net.parameters()))
    with pytest.raises(TypeError, match="overrides step"):
        to_adams(StepLoggingAdamS(net.parameters()))
    convenient = ConvenientAdamS(net.parameters())
    assert to_adams(convenient) is convenient
    for cls in (torch.optim.AdamW, torch.optim.Adam):
        assert type(to_adams(cls(net.parameters()))) is AdamS


# ---------------------------------------------------------------- item 10: what param.grad holds


class NormLogging(pl.LightningModule):
    """Automatic optimization that logs Lightning's ``grad_norm`` of ``param.grad`` in ``on_before_optimizer_step``
    (Lightning's documented recipe) and, under SCAPE, the strategy's global norm; ``clip``: it also clips
    ``param.grad`` there."""

    def __init__(self, clip: bool = False) -> None:
        super().__init__()
        self.net = make_net()
        self.clip = clip
        self.norms: list[dict[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        norms = grad_norm(self, norm_type=2)
        self.log_dict(norms)
        record = {"param_grad": float(norms["grad_2.0_norm_total"])}
        if isinstance(self.trainer.strategy, ScapeStrategy):
            record["global"] = float(self.trainer.strategy.global_grad_norm())
        self.norms.append(record)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1e-3)

    def configure_optimizers(self) -> Any:
        return AdamS(param_groups(self.net, LR), lr=LR)


@scenario(LAUNCH_1)
def item10_gradient_reading_hooks(outdir: str) -> None:
    """``NormLogging`` with and without clipping, under DDP and SCAPE (every step dense)."""
    for name, options in (("ddp", "ddp"), ("scape", DENSE)):
        for clip in (False, True):
            strategy = options if isinstance(options, str) else ScapeStrategy(**options)
            model = NormLogging(clip)
            out = fit_scape_or_ddp(strategy, model)
            save_output(outdir, f"item10_{name}_{clip}", dist.get_rank(), {**out, "norms": model.norms})


@pytest.mark.dist
def test_item10_the_global_norm_is_ddps_and_param_grad_is_this_ranks(items_1_runs: str) -> None:
    ddp, scape = (load_outputs(items_1_runs, f"item10_{name}_False") for name in ("ddp", "scape"))
    assert len(scape[0]["norms"]) == len(ddp[0]["norms"]) == 8
    for r in range(2):
        global_norms = [n["global"] for n in scape[r]["norms"]]
        # The strategy's global norm is what DDP's param.grad gives: the norm of the averaged gradient ...
        assert global_norms == pytest.approx([n["param_grad"] for n in ddp[r]["norms"]], rel=1e-5)
        # ... while SCAPE's param.grad holds this rank's own gradient (documented), whose norm differs.
        local = [n["param_grad"] for n in scape[r]["norms"]]
        assert all(abs(g - p) > 1e-4 * g for g, p in zip(global_norms, local, strict=True))
        assert rel_err(scape[r]["params"], ddp[r]["params"]) < 1e-5
    (rank0, rank1) = ([w for w in o["warnings"] if "looks like Lightning's grad_norm()" in w] for o in scape)
    assert len(rank0) == 1 and not rank1 and "global_grad_norm()" in rank0[0]


@pytest.mark.dist
def test_item10_clipping_param_grad_has_no_effect_and_says_so(items_1_runs: str) -> None:
    ddp = {clip: load_outputs(items_1_runs, f"item10_ddp_{clip}") for clip in (False, True)}
    scape = {clip: load_outputs(items_1_runs, f"item10_scape_{clip}") for clip in (False, True)}
    for r in range(2):
        assert not torch.equal(ddp[True][r]["params"], ddp[False][r]["params"])  # under DDP the clip acts
        assert torch.equal(scape[True][r]["params"], scape[False][r]["params"])  # under SCAPE it cannot
    told = [w for w in scape[True][0]["warnings"] if "param.grad was changed after backward" in w]
    assert len(told) == 1 and "gradient_clip_val" in told[0]
    assert not any("param.grad was changed" in w for w in scape[False][0]["warnings"])


@pytest.fixture(scope="module")
def items_1_runs(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The folder of what the scenarios of items 1, 6, 7, 8 and 10 saved: two processes, rank 1 started by
    Lightning's launcher (the Fabric scenarios run in the same two processes)."""
    out = str(tmp_path_factory.mktemp("conformance_1"))
    run_script(
        launcher_args("test_lightning_conformance", LAUNCH_1, out),
        timeout_s=600,
        env=child_env(MASTER_PORT=str(free_port())),
    )
    return out
