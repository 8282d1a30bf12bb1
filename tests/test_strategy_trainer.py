"""The Trainer's ScapeStrategy on two gloo processes, against bare-engine references.

Each ``@scenario("trainer")`` function below is one Trainer run; the ``trainer_runs`` fixture (conftest) runs
them all, in the order they are defined, in one launch of two processes (``_launch_scenarios.py``), and the
test under each scenario reads what it saved. The references (:func:`helpers.reference`) drive
:class:`ScapeEngine` directly in two simulated ranks, so bitwise equality means the adapter added nothing and
lost nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import (
    BATCH,
    LR,
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
    rank_file,
    rank_file_names,
    rank_zero_messages,
    reference,
    run_script,
    same,
    save_output,
    scenario,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from lightning_scape import CommunicationMonitor, MaskMonitor, ScapeConfig
from lightning_scape.engine import feedback
from lightning_scape.examples.workloads import free_port
from lightning_scape.planning import run_summary
from lightning_scape.pytorch import ScapeStrategy

pytestmark = pytest.mark.dist

# ------------------------------------------------------------------------------ what the scenarios run


class LitModel(pl.LightningModule):
    """The tiny net under MSE, AdamW with two param groups and a per-step LR schedule."""

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
        opt = torch.optim.AdamW(param_groups(self.net, LR), lr=LR)
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
            "residual_norm": feedback.residual_norm(engine.buckets),
            "oldest": feedback.oldest_unsent_age(engine.buckets, engine.step_count, engine.in_warmup),
            "lr": [g["lr"] for g in trainer.optimizers[0].param_groups],
        }
        if self.snapshots:
            rec["params"] = flat(pl_module.parameters())
            rec["engine"] = engine_snapshot(engine)
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            rec["scale"] = None if scaler is None else scaler.get_scale()
        self.steps.append(rec)


def loaders(val: bool = False) -> tuple[DataLoader, DataLoader | None]:
    """The training loader (batches of 4) and, with ``val``, a validation loader over the same samples."""
    train = DataLoader(dataset(), batch_size=BATCH)
    return train, (DataLoader(dataset(), batch_size=8) if val else None)


def trainer_kwargs(**extra: Any) -> dict[str, Any]:
    """A quiet two-process CPU Trainer for two epochs, with ``extra`` on top."""
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


def fit_and_record(
    name: str,
    outdir: str,
    strategy: Any,
    model: Any = None,
    val: bool = False,
    ckpt_path: str | None = None,
    recorder: Recorder | None = None,
    **kw: Any,
) -> pl.Trainer:
    """``Trainer.fit`` with a :class:`Recorder`; save, as ``name``, the final parameters, the recorded steps,
    what the strategy set up (wrapper, sampler, optimizer, configuration) and the engine's state."""
    model = model if model is not None else LitModel()
    recorder = recorder or Recorder()
    callbacks = [recorder, *kw.pop("callbacks", [])]
    trainer = pl.Trainer(strategy=strategy, callbacks=callbacks, **trainer_kwargs(**kw))
    train, val_loader = loaders(val)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, rank_zero_messages() as logged:
        warnings.simplefilter("always")  # the children run with PYTHONWARNINGS=ignore
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
        "warmup_warnings": [str(w.message) for w in caught if "dense_warmup_steps" in str(w.message)],
        "summaries": [m for m in logged if m.startswith(run_summary.HEADING)],
        "run_summary": trainer.strategy.run_summary(),
        "wait_s_at_end": trainer.strategy.scape_optimizers[0].engine.counters.total_wait_s,
    }
    save_output(outdir, name, trainer.global_rank, out)
    return trainer


@contextlib.contextmanager
def all_reduce_numels() -> Iterator[list[int]]:
    """The size of every ``torch.distributed.all_reduce`` any code issues inside: a dense gradient all-reduce
    would show here."""
    numels: list[int] = []
    original = dist.all_reduce

    def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        numels.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce  # type: ignore[assignment]
    try:
        yield numels
    finally:
        dist.all_reduce = original


def checkpoint_dir(outdir: str) -> str:
    """Where :func:`resume_from_a_checkpoint` checkpoints (and later scenarios find ``last.ckpt``)."""
    return os.path.join(outdir, "ckpt")


# ------------------------------------------------------------------------------ what the tests read


def runs(outdir: str, name: str) -> list[Any]:
    """What both ranks saved under ``name``."""
    return load_outputs(outdir, name)


def assert_plain_replicas(out: list[dict[str, Any]]) -> None:
    """No DDP wrapper, the injected DistributedSampler, SCAPE's optimizer, identical replicas."""
    for o in out:
        assert not o["ddp_wrapped"]
        assert o["sampler"] == "DistributedSampler"
        assert o["optimizer_type"] == "ScapeOptimizer"
    assert torch.equal(out[0]["params"], out[1]["params"])


# ------------------------------------------------------------------------------ scenarios and their tests


@scenario("trainer")
def registered_name(outdir: str) -> None:
    """``strategy="scape"`` with the default configuration, two steps."""
    fit_and_record("default", outdir, "scape", max_epochs=None, max_steps=2)


def test_registered_name_with_default_configuration(trainer_runs: str) -> None:
    out = runs(trainer_runs, "default")
    assert_plain_replicas(out)
    assert out[0]["config"] == ScapeConfig()
    # Two steps of the default configuration are dense warm-up: only dense traffic, as its formula says.
    sent = out[0]["steps"][0]["sent"]
    assert sent["values"] == sent["params"] == sent["indices"] == 0 and sent["dense"] > 0


def test_a_short_fit_at_the_defaults_is_not_warned_its_dense_steps_measure_the_link(trainer_runs: str) -> None:
    # Where SCAPE chooses its form, its first steps are dense on purpose (test_lightning_conformance's item 3 and
    # test_runtime check the warning of a fixed form that never leaves its warm-up); the summary says what they did.
    assert all(not o["warmup_warnings"] for o in runs(trainer_runs, "default") + runs(trainer_runs, "main"))
    (summary,) = runs(trainer_runs, "default")[0]["summaries"]
    assert "steps:         2, in the forms SCAPE chose: fp32 dense 1-2, measuring the link" in summary


@scenario("trainer")
def accumulation_clipping_schedule_validation_and_monitors(outdir: str) -> None:
    """Two micro-batches per step, norm clipping, the LR schedule, validation with a sanity check, and both
    monitors logging through a CSVLogger every step (``test_monitors`` reads the log); also every
    all-reduce's size."""
    with all_reduce_numels() as numels:
        fit_and_record(
            "main",
            outdir,
            ScapeStrategy(**SCAPE),
            val=True,
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
            num_sanity_val_steps=1,
            limit_val_batches=2,
            logger=CSVLogger(os.path.join(outdir, "logs"), name="csv", version=0),
            log_every_n_steps=1,
            callbacks=[CommunicationMonitor(), MaskMonitor(topk_every_n_steps=2)],
        )
    save_output(outdir, "all_reduce_main", dist.get_rank(), numels)


def test_rank_0_sums_the_fit_up_once_at_its_end(trainer_runs: str) -> None:
    (summary,), rank1 = [o["summaries"] for o in runs(trainer_runs, "main")]
    main = runs(trainer_runs, "main")[0]
    assert summary == main["run_summary"] and not rank1  # what strategy.run_summary() returns, logged by rank 0 only
    last = main["steps"][-1]  # the engine's counters after the last step
    sent, ddp = last["total_sent"], last["total_dense_equivalent"]
    bytes_line = (
        f"{run_summary.format_bytes(sent)} sent per process; DDP would have sent {run_summary.format_bytes(ddp)}"
    )
    assert bytes_line in summary
    assert f"{run_summary.format_bytes(ddp - sent)} saved ({ddp / sent:.1f}x fewer" in summary
    # After the last step: closing waits for the all-gather of the mask built ahead, and the summary counts it.
    assert main["wait_s_at_end"] >= last["total_wait_s"]
    assert f"{main['wait_s_at_end']:.2f} s blocked on SCAPE's collectives" in summary
    # The phases of SCAPE (2 dense warm-up steps, then density 0.1, no ramp) over the fit's 4 optimizer steps.
    assert "steps:         4: 2 dense warm-up (dense_warmup_steps=2), 2 sparse at density 0.1" in summary


def test_accumulation_clipping_schedule_and_validation_match_the_engine(trainer_runs: str) -> None:
    out = runs(trainer_runs, "main")
    assert_plain_replicas(out)
    ref = reference(accumulate=2, max_norm=0.5)
    for r in range(2):
        assert torch.equal(out[r]["params"], ref[r]["params"])
        for key in ("momentum", "residual"):
            assert torch.equal(out[r]["engine"][key], torch.cat([b[key] for b in ref[r]["engine"]["buckets"]]))
    # 16 samples per rank, batches of 4, two epochs, two micro-batches per step: 4 optimizer steps.
    assert out[0]["global_step"] == 4 and out[0]["steps"][-1]["step_count"] == 4
    # The LR schedule reached the engine's param groups (it reads them every step).
    assert out[0]["steps"][-1]["lr"] == pytest.approx([0.02 / 1.4, 0.01 / 1.4])
    assert out[0]["sanity_checked"] and out[0]["val_batches"] == 5  # 1 sanity batch + 2 per epoch
    assert out[0]["val_loss"] == pytest.approx(out[1]["val_loss"])


@scenario("trainer")
def clipping_by_value(outdir: str) -> None:
    """Clipping by value, no monitor (the only all-reduces left are scalars); also every all-reduce's size."""
    with all_reduce_numels() as numels:
        fit_and_record("value", outdir, ScapeStrategy(**SCAPE), gradient_clip_val=0.02, gradient_clip_algorithm="value")
    save_output(outdir, "all_reduce_value", dist.get_rank(), numels)


def test_no_dense_gradient_all_reduce_after_warmup(trainer_runs: str) -> None:
    out = runs(trainer_runs, "value")
    cfg = ScapeConfig(**SCAPE)
    for o in out:
        for rec in o["steps"]:
            dense = rec["sent"]["dense"]
            assert (dense > 0) == (rec["step_count"] <= cfg.dense_warmup_steps), rec
    # The only all_reduce calls of the whole value-clipping run are scalars (no norm clipping here).
    for numels in runs(trainer_runs, "all_reduce_value"):
        assert all(n <= 1 for n in numels), numels
    # With MaskMonitor(topk_every_n_steps=2), exactly its measurements all-reduce the dense gradient.
    main = runs(trainer_runs, "main")[0]
    measured = sum(1 for s in main["steps"] if s["masks"] is not None and s["step_count"] % 2 == 0)
    for numels in runs(trainer_runs, "all_reduce_main"):
        assert sum(1 for n in numels if n > 8) == measured > 0


def test_clipping_by_value_matches_the_engine(trainer_runs: str) -> None:
    out = runs(trainer_runs, "value")
    assert_plain_replicas(out)
    ref = reference(clip_value=0.02)
    assert torch.equal(out[0]["params"], ref[0]["params"])


@scenario("trainer")
def bf16_mixed(outdir: str) -> None:
    """bf16 autocast."""
    fit_and_record("bf16", outdir, ScapeStrategy(**SCAPE), precision="bf16-mixed")


def test_bf16_mixed_matches_the_engine(trainer_runs: str) -> None:
    out = runs(trainer_runs, "bf16")
    assert_plain_replicas(out)
    ref = reference(autocast=torch.bfloat16)
    assert torch.equal(out[0]["params"], ref[0]["params"])


@scenario("trainer")
def fp16_with_an_inf_on_rank_1(outdir: str) -> None:
    """fp16 with a GradScaler, and an inf in rank 1's loss at step 3 (a sparse step); snapshots every step."""
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    fit_and_record(
        "fp16",
        outdir,
        ScapeStrategy(**SCAPE),
        model=LitModel(inject_inf_at=3),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        recorder=Recorder(snapshots=True),
    )


def test_fp16_inf_step_is_skipped_on_every_rank_without_touching_state(trainer_runs: str) -> None:
    out = runs(trainer_runs, "fp16")
    assert_plain_replicas(out)
    for o in out:
        steps = o["steps"]
        assert [s["skipped"] for s in steps] == [i == 3 for i in range(8)]
        # The skipped step changed neither parameters nor momentum, residual, masks or step count.
        before, after = steps[2], steps[3]
        assert torch.equal(before["params"], after["params"])
        for key in ("momentum", "residual", "last_sent", "masks", "step_count", "refresh_count"):
            assert same(before["engine"][key], after["engine"][key]), key
        # The GradScaler backed off once, on both ranks alike.
        assert [s["scale"] for s in steps] == [256.0] * 3 + [128.0] * 5
    ref = reference(autocast=torch.float16, fp16_scale=256.0, inject_inf_at=3)
    assert ref[0]["skipped"] == [i == 3 for i in range(8)]
    assert torch.equal(out[0]["params"], ref[0]["params"])


@scenario("trainer")
def compiled_model(outdir: str) -> None:
    """``torch.compile`` with AOT autograd (the post-accumulate-grad hooks must still fire), one epoch."""
    compiled = torch.compile(LitModel(), backend="aot_eager")
    fit_and_record("compiled", outdir, ScapeStrategy(**SCAPE), model=compiled, max_epochs=1)


def test_compiled_model_matches_the_engine(trainer_runs: str) -> None:
    out = runs(trainer_runs, "compiled")
    assert_plain_replicas(out)
    ref = reference(epochs=1)
    assert torch.equal(out[0]["params"], ref[0]["params"])


@scenario("trainer")
def resume_from_a_checkpoint(outdir: str) -> None:
    """Four epochs uninterrupted; and two epochs with ModelCheckpoint(save_top_k=1, save_last) then two more
    resumed from ``last.ckpt``; also the files left in the checkpoint folder."""
    fit_and_record("uninterrupted", outdir, ScapeStrategy(**SCAPE), max_epochs=4)
    ckdir = checkpoint_dir(outdir)
    ckpt = ModelCheckpoint(dirpath=ckdir, filename="e{epoch}", save_top_k=1, monitor="step", mode="max", save_last=True)
    fit_and_record(
        "first_half", outdir, ScapeStrategy(**SCAPE), max_epochs=2, enable_checkpointing=True, callbacks=[ckpt]
    )
    last = os.path.join(ckdir, "last.ckpt")
    fit_and_record("resumed", outdir, ScapeStrategy(**SCAPE), max_epochs=4, ckpt_path=last)
    save_output(outdir, "ckpt_files", dist.get_rank(), rank_file_names(ckdir) + rank_file_names(last + ".scape"))


def test_resume_continues_bitwise_identically(trainer_runs: str) -> None:
    whole, resumed = runs(trainer_runs, "uninterrupted"), runs(trainer_runs, "resumed")
    assert_plain_replicas(resumed)
    for r in range(2):
        assert torch.equal(whole[r]["params"], resumed[r]["params"])
        for key in ("momentum", "residual", "last_sent", "masks", "step_count", "refresh_count", "total_sent"):
            assert same(whole[r]["engine"][key], resumed[r]["engine"][key]), (r, key)
    assert torch.equal(whole[0]["params"], reference(epochs=4)[0]["params"])
    # ModelCheckpoint(save_top_k=1) removed the epoch-0 checkpoint together with its per-rank files, and the rank
    # files of every earlier save to last.ckpt are gone (each save's files have names of their own).
    files = runs(trainer_runs, "ckpt_files")[0]
    assert files == [
        "eepoch=1.ckpt",
        "eepoch=1.ckpt.scape",
        "last.ckpt",
        "last.ckpt.scape",
        "rank-00000.pt",
        "rank-00001.pt",
    ]


@scenario("trainer")
def resume_with_another_configuration(outdir: str) -> None:
    """Resuming ``last.ckpt`` with density 0.2 instead of 0.1: the error on each rank."""
    last = os.path.join(checkpoint_dir(outdir), "last.ckpt")
    expect_failure(
        "other_config",
        outdir,
        lambda: pl.Trainer(strategy=ScapeStrategy(**{**SCAPE, "density": 0.2}), **trainer_kwargs(max_epochs=3)).fit(
            LitModel(), loaders()[0], ckpt_path=last
        ),
    )


def test_checkpoint_from_another_configuration_is_refused(trainer_runs: str) -> None:
    for o in runs(trainer_runs, "other_config"):
        assert o["error"] is not None
        assert "another configuration" in o["error"] and "'density': (0.1, 0.2)" in o["error"]
        assert "Nothing was loaded" in o["error"]


@scenario("trainer")
def resume_with_a_new_density_on_purpose(outdir: str) -> None:
    """Resuming ``last.ckpt`` (density 0.1) at density 0.2 with ``resume_with_new_config=True``; the layout."""
    last = os.path.join(checkpoint_dir(outdir), "last.ckpt")
    new = ScapeStrategy(**{**SCAPE, "density": 0.2}, resume_with_new_config=True)
    trainer = fit_and_record("new_density", outdir, new, max_epochs=3, ckpt_path=last)
    layout = [(b.layout.numel, b.layout.padded_numel, b.layout.chunk_size) for b in trainer.strategy.engine.buckets]
    save_output(outdir, "new_density_layout", dist.get_rank(), layout)


def test_a_new_density_on_purpose_resumes_and_sends_the_new_densitys_bytes(trainer_runs: str) -> None:
    from lightning_scape.engine.layout import Bucket
    from lightning_scape.planning.run_traffic import sparse_step_bytes

    layout = [
        Bucket(0, 0, torch.float32, torch.device("cpu"), numel=n, padded_numel=p, world_size=2, chunk_size=c)
        for n, p, c in runs(trainer_runs, "new_density_layout")[0]
    ]
    new, old = runs(trainer_runs, "new_density"), runs(trainer_runs, "resumed")
    assert_plain_replicas(new)
    cfg = new[0]["config"]
    assert cfg.density == 0.2
    assert new[0]["steps"][0]["step_count"] == old[0]["steps"][0]["step_count"]  # the step counter continued
    for step in new[0]["steps"]:  # every step of the resumed fit is sparse, at the new density
        sent = step["sent"]
        assert sent["dense"] == 0 and sent["values"] + sent["params"] == sparse_step_bytes(layout, cfg, 2, 1000)
    first_old = old[0]["steps"][0]["sent"]
    assert new[0]["steps"][0]["sent"]["values"] > first_old["values"]  # more than the saved density sent


@scenario("trainer")
def resume_with_a_truncated_rank_file(outdir: str) -> None:
    """Resuming a copy of ``last.ckpt`` whose rank-1 file is cut in half: the error on each rank, and the
    parameters before and after."""
    last = os.path.join(checkpoint_dir(outdir), "last.ckpt")
    bad = os.path.join(outdir, "bad.ckpt")
    if dist.get_rank() == 0:
        shutil.copy(last, bad)
        shutil.copytree(last + ".scape", bad + ".scape")
        with open(rank_file(bad, 1), "r+b") as f:
            f.truncate(os.path.getsize(rank_file(bad, 1)) // 2)
    dist.barrier()
    probe = LitModel()
    before = flat(probe.parameters())

    def resume_truncated() -> None:
        pl.Trainer(strategy=ScapeStrategy(**SCAPE), **trainer_kwargs(max_epochs=3)).fit(
            probe, loaders()[0], ckpt_path=bad
        )

    expect_failure("truncated", outdir, resume_truncated)
    save_output(outdir, "truncated_params", dist.get_rank(), {"before": before, "after": flat(probe.parameters())})


def test_truncated_rank_file_stops_every_rank_before_loading(trainer_runs: str) -> None:
    errors = [o["error"] for o in runs(trainer_runs, "truncated")]
    assert "rank-00001.pt" in errors[1] and "truncated or corrupt" in errors[1]
    assert "failed on rank 1" in errors[0]  # rank 0's own file was fine; it stops too instead of hanging
    for o in runs(trainer_runs, "truncated_params"):
        assert torch.equal(o["before"], o["after"])


@scenario("trainer_other_world")
def resume_on_one_process(outdir: str, ckpt: str) -> None:
    """One process resuming ``ckpt``, written by two: any error, and the parameters before and after."""
    model = LitModel()
    before = flat(model.parameters())
    expect_failure(
        "one_rank",
        outdir,
        lambda: pl.Trainer(strategy=ScapeStrategy(**SCAPE), **trainer_kwargs(devices=1, max_epochs=3)).fit(
            model, loaders()[0], ckpt_path=ckpt
        ),
    )
    save_output(outdir, "one_rank_params", 0, {"before": before, "after": flat(model.parameters())})


@pytest.fixture(scope="module")
def trainer_other_world_runs(trainer_runs: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The folder of what the "trainer_other_world" scenario saved: one process, the two-process ``last.ckpt``."""
    out = str(tmp_path_factory.mktemp("trainer_w1"))
    ckpt = os.path.join(checkpoint_dir(trainer_runs), "last.ckpt")
    run_script(
        launcher_args("test_strategy_trainer", "trainer_other_world", out, ckpt),
        timeout_s=120,
        env=child_env(MASTER_PORT=str(free_port())),
    )
    return out


def test_resume_on_another_world_size_loads_and_trains(trainer_runs: str, trainer_other_world_runs: str) -> None:
    """One process resumes the two-process checkpoint (re-sharded; tests/test_reshard_dist.py checks how)."""
    (result,) = load_outputs(trainer_other_world_runs, "one_rank", world_size=1)
    assert result["error"] is None, result
    (params,) = load_outputs(trainer_other_world_runs, "one_rank_params", world_size=1)
    assert not torch.equal(params["before"], params["after"])
    assert os.path.isdir(os.path.join(checkpoint_dir(trainer_runs), "last.ckpt.scape"))
