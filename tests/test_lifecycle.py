"""One lifecycle, four strategies: what one form does, all do.

The DDP and FSDP forms, each under Fabric and the Trainer, run the same model on the same batches through set-up,
accumulation (2 micro-batches), clipping by the global norm, a checkpoint saved and resumed, and a rank that dies.
Two processes, started by hand as two one-process "nodes" (``NODE_RANK``), so that no launcher stands between a
dead rank and its survivor; the FSDP forms then shard within a node of one (``shard_size=1``) and SCAPE runs
across the two, as in the DDP forms. ``lifecycle_runs`` runs every form's scenarios in one launch;
``failure_runs`` one launch per form, since a dead rank ends its process group.

The references are independent of the strategies: data-parallel AdamS over both ranks' batches in one process
(density 1), and each form's own uninterrupted run (the resumed one).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    PYTHON,
    child_env,
    launcher_args,
    load_outputs,
    rank_zero_messages,
    rel_err,
    save_output,
    scenario,
    survivor_outcome,
)
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny_gpt import LR, LitGPT, RankBatches, full_params, lm_loss, reference_adams, tiny_gpt, tokens
from torch import Tensor

import lightning_scape
from lightning_scape import AdamS, DenseWarmupWarning, ScapeEngine
from lightning_scape.examples.workloads import free_port
from lightning_scape.planning import run_summary

pytestmark = pytest.mark.dist

W = 2
FORMS = ("fabric", "fabric_fsdp", "trainer", "trainer_fsdp")
STRATEGIES: dict[str, Callable[..., Any]] = {
    "fabric": lightning_scape.ScapeStrategy,
    "fabric_fsdp": lightning_scape.ScapeFSDPStrategy,
    "trainer": lightning_scape.pytorch.ScapeStrategy,
    "trainer_fsdp": lightning_scape.pytorch.ScapeFSDPStrategy,
}
# Every step sent dense: the result is data-parallel AdamS's, whatever the form.
DENSE = {"density": 1.0, "dense_warmup_steps": 0}
# One dense step, then sparse ones with error feedback and a mask the next step uses.
SPARSE = {"density": 0.05, "dense_warmup_steps": 1, "density_ramp_steps": 0, "chunk_size": 64}
DENSE_STEPS, ACCUMULATE, MAX_NORM = 3, 2, 0.2
SPARSE_STEPS, SAVED_AT = 4, 2


def node_rank() -> int:
    return int(os.environ["NODE_RANK"])


class Told:
    """What a run tells: its DenseWarmupWarnings, rank 0's end-of-run summaries and start-up lines."""

    def __init__(self) -> None:
        self.warnings: list[str] = []
        self.messages: list[str] = []

    def __call__(self, fn: Callable[[], Any]) -> Any:
        with warnings.catch_warnings(record=True) as caught, rank_zero_messages() as logged:
            warnings.simplefilter("always")  # the children run with PYTHONWARNINGS=ignore
            result = fn()
        self.warnings += [str(w.message) for w in caught if issubclass(w.category, DenseWarmupWarning)]
        self.messages += logged
        return result

    def record(self) -> dict[str, Any]:
        summaries = [m for m in self.messages if m.startswith(run_summary.HEADING)]
        return {"notices": self.warnings, "summaries": summaries, "messages": self.messages}


# ------------------------------------------------------------------------------------------------ Fabric


def fabric_for(form: str, config: dict[str, Any], **options: Any) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=1, num_nodes=W, strategy=STRATEGIES[form](**config, **options))
    fabric.launch()
    return fabric


def fabric_steps(
    fabric: Fabric, model: Any, opt: Any, steps: range, totals: list[int], dense: bool, norms: list[float] | None = None
) -> None:
    """Steps over this rank's batches; after every backward, what the engine has sent so far (``totals``); before
    each dense step's clipping, ``strategy.global_grad_norm()`` (``norms``)."""
    engine: ScapeEngine = fabric.strategy.engine
    accumulate = ACCUMULATE if dense else 1
    for step in steps:
        for micro in range(accumulate):
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                fabric.backward(lm_loss(model, tokens(fabric.global_rank, step, micro)) / accumulate)
            totals.append(engine.counters.total_sent_bytes)
        if dense:
            if norms is not None:
                norms.append(float(fabric.strategy.global_grad_norm()))
            fabric.clip_gradients(model, opt, max_norm=MAX_NORM)
        opt.step()
        opt.zero_grad()
        totals.append(engine.counters.total_sent_bytes)


def fabric_set_up(fabric: Fabric) -> tuple[Any, Any]:
    model = fabric.setup_module(tiny_gpt())
    return model, fabric.setup_optimizers(AdamS(model.parameters(), lr=LR))


def fabric_dense(form: str, told: Told) -> dict[str, Any]:
    fabric = fabric_for(form, DENSE)
    model, opt = told(lambda: fabric_set_up(fabric))
    totals: list[int] = []
    norms: list[float] = []
    told(lambda: fabric_steps(fabric, model, opt, range(DENSE_STEPS), totals, dense=True, norms=norms))
    told(fabric.strategy.teardown)
    return {"params": full_params(model), "totals": totals, "norms": norms}


def fabric_sparse(form: str, outdir: str) -> dict[str, Any]:
    path = os.path.join(outdir, f"{form}_ckpt")
    fabric = fabric_for(form, SPARSE)
    model, opt = fabric_set_up(fabric)
    fabric_steps(fabric, model, opt, range(SAVED_AT), [], dense=False)
    fabric.save(path, {"model": model, "optimizer": opt, "step": SAVED_AT})
    fabric_steps(fabric, model, opt, range(SAVED_AT, SPARSE_STEPS), [], dense=False)
    whole = full_params(model)
    fabric.strategy.teardown()

    fabric = fabric_for(form, SPARSE)
    model, opt = fabric_set_up(fabric)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(path, state)
    fabric_steps(fabric, model, opt, range(state["step"], SPARSE_STEPS), [], dense=False)
    resumed = full_params(model)
    fabric.strategy.teardown()
    return {"whole": whole, "resumed": resumed}


# ------------------------------------------------------------------------------------------- the Trainer


class EpochBatch(torch.utils.data.Dataset[Tensor], L.Callback):
    """One batch an epoch, the Fabric runs' batch of the step it is fetched for: an epoch is one step (Lightning
    may not resume the data order of an epoch it saved at its end; one batch an epoch leaves it nothing to get
    wrong). The step is read when the batch is fetched: a resumed fit fetches its first before any epoch starts."""

    def __init__(self) -> None:
        self.trainer: L.Trainer | None = None

    def __len__(self) -> int:
        return 1

    def __getitem__(self, k: int) -> Tensor:
        assert self.trainer is not None
        return tokens(node_rank(), self.trainer.global_step)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.trainer = trainer


class Recorded(L.Callback):
    """What the engine has sent after every backward and every optimizer step; the full parameters at the end."""

    def __init__(self) -> None:
        self.totals: list[int] = []
        self.norms: list[float] = []
        self.params = torch.empty(0)

    def _sent(self, trainer: L.Trainer) -> None:
        self.totals.append(trainer.strategy.engine.counters.total_sent_bytes)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sent(trainer)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.norms.append(float(trainer.strategy.global_grad_norm()))  # before the clipping

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.fit_loop.epoch_loop._accumulated_batches_reached():
            self._sent(trainer)  # after the optimizer step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params = full_params(pl_module)


def fit(form: str, config: dict[str, Any], data: Any, ckpt_path: str | None = None, **kwargs: Any) -> Recorded:
    recorded = Recorded()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=W,
        strategy=STRATEGIES[form](**config),
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        **{"enable_checkpointing": False, **kwargs, "callbacks": [recorded, *kwargs.get("callbacks", [])]},
    )
    trainer.fit(LitGPT(), torch.utils.data.DataLoader(data, batch_size=1), ckpt_path=ckpt_path)
    return recorded


def trainer_dense(form: str, told: Told) -> dict[str, Any]:
    recorded = told(
        lambda: fit(
            form,
            DENSE,
            RankBatches(DENSE_STEPS, node_rank(), ACCUMULATE),
            max_steps=DENSE_STEPS,
            accumulate_grad_batches=ACCUMULATE,
            gradient_clip_val=MAX_NORM,
        )
    )
    return {"params": recorded.params, "totals": recorded.totals, "norms": recorded.norms}


def trainer_sparse(form: str, outdir: str) -> dict[str, Any]:
    """A checkpoint after every epoch (one step); the fit resumed from the one after step ``SAVED_AT``."""
    folder = os.path.join(outdir, f"{form}_ckpts")
    save = ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True)
    data = EpochBatch()
    whole = fit(form, SPARSE, data, max_steps=SPARSE_STEPS, callbacks=[save, data], enable_checkpointing=True)
    first = os.path.join(folder, f"epoch={SAVED_AT - 1}-step={SAVED_AT}.ckpt")
    data = EpochBatch()
    resumed = fit(form, SPARSE, data, ckpt_path=first, max_steps=SPARSE_STEPS, callbacks=[data])
    return {"whole": whole.params, "resumed": resumed.params}


# ----------------------------------------------------------------------------------------- the scenarios


def lifecycle(form: str, outdir: str) -> None:
    told = Told()
    dense = fabric_dense(form, told) if form.startswith("fabric") else trainer_dense(form, told)
    sparse = fabric_sparse(form, outdir) if form.startswith("fabric") else trainer_sparse(form, outdir)
    save_output(outdir, form, node_rank(), {"dense": dense, "sparse": sparse, **told.record()})


for _form in FORMS:
    scenario("lifecycle")(lambda outdir, form=_form: lifecycle(form, outdir))


class DieAfter(L.Callback):
    """Rank 1 kills itself after ``steps`` optimizer steps; rank 0 says ``READY`` and goes on."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.steps:
            die_or_go_on()


def die_or_go_on() -> None:
    if node_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    print("READY", flush=True)


@scenario("failure")
def a_rank_dies(outdir: str, form: str) -> None:
    """Two sparse steps, then rank 1 dies; rank 0 tries four more (collective timeout 20 s: the survivor sees the
    closed connection at once, and the heartbeat's diagnosis waits a tenth of it)."""
    timeout = timedelta(seconds=20)
    if form.startswith("fabric"):
        fabric = fabric_for(form, SPARSE, timeout=timeout)
        model, opt = fabric_set_up(fabric)
        fabric_steps(fabric, model, opt, range(SAVED_AT), [], dense=False)
        die_or_go_on()
        try:
            fabric_steps(fabric, model, opt, range(SAVED_AT, 6), [], dense=False)
        finally:
            fabric.strategy.teardown()  # as a script's `finally` would: nothing to wait on, nothing to sum up
    else:
        config = {**SPARSE, "timeout": timeout}
        fit(form, config, RankBatches(6, node_rank()), max_steps=6, callbacks=[DieAfter(SAVED_AT)])


# ------------------------------------------------------------------------------------------- the launches


def launch_two_nodes(launch: str, out: str, *args: str) -> list[subprocess.Popen[str]]:
    """Rank 1 and rank 0 of ``launch``, each a one-process node of its own."""
    port = str(free_port())
    return [
        subprocess.Popen(
            [PYTHON, *launcher_args("test_lifecycle", launch, out, *args)],
            env=child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node)),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for node in (1, 0)
    ]


@pytest.fixture(scope="module")
def lifecycle_runs(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("lifecycle"))
    procs = launch_two_nodes("lifecycle", out)
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise AssertionError("\n\n".join(f"--- rank {1 - i}\n{o[-5000:]}" for i, o in enumerate(outputs)))
    return out


@pytest.fixture(scope="module")
def failure_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per form: rank 0's exit code and output. A survivor still running
    after 3 minutes (it stops within seconds) is killed: its exit code is then negative."""
    jobs = {form: launch_two_nodes("failure", str(tmp_path_factory.mktemp(form)), form) for form in FORMS}
    results: dict[str, dict[str, Any]] = {}

    def watch(form: str) -> None:
        victim, survivor = jobs[form]
        results[form] = survivor_outcome(survivor, victim, timeout_s=180)

    threads = [threading.Thread(target=watch, args=(form,)) for form in FORMS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# ------------------------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("form", FORMS)
def test_accumulation_and_clipping_reproduce_data_parallel_adams(lifecycle_runs: str, form: str) -> None:
    ref = reference_adams(W, DENSE_STEPS, ACCUMULATE, MAX_NORM)[-1]
    for out in load_outputs(lifecycle_runs, form, W):
        assert rel_err(out["dense"]["params"], ref) < 1e-5, rel_err(out["dense"]["params"], ref)


@pytest.mark.parametrize("form", FORMS)
def test_the_strategy_gives_the_global_norm_of_the_synchronised_gradient(lifecycle_runs: str, form: str) -> None:
    """``strategy.global_grad_norm()`` before each step's clipping: data-parallel AdamS's norm of the averaged
    gradient, on every rank (``param.grad`` holds each rank's own)."""
    norms: list[float] = []
    reference_adams(W, DENSE_STEPS, ACCUMULATE, MAX_NORM, norms)
    assert min(norms) > MAX_NORM  # the clipping was active
    for out in load_outputs(lifecycle_runs, form, W):
        assert len(out["dense"]["norms"]) == DENSE_STEPS
        for got, want in zip(out["dense"]["norms"], norms, strict=True):
            assert abs(got - want) < 1e-5 * want, (out["dense"]["norms"], norms)


@pytest.mark.parametrize("form", FORMS)
def test_a_micro_batch_sends_nothing_and_a_step_sends_ddps_bytes(lifecycle_runs: str, form: str) -> None:
    """Per step: the first micro-batch's backward (no sync) adds nothing to what the engine has sent; the step
    sends one ring all-reduce's bytes of the whole model, as DDP would (density 1, two ranks: 2 (W - 1) / W x 4 =
    4 bytes a parameter), and the clipping norm's (one fp32 value, the same 4 bytes)."""
    out = load_outputs(lifecycle_runs, form, W)[0]
    n = out["dense"]["params"].numel()
    totals = [0, *out["dense"]["totals"]]
    per_step = ACCUMULATE + 1  # a total after each backward, then after the step
    for step in range(DENSE_STEPS):
        before, first, *_, after = totals[step * per_step : (step + 1) * per_step + 1]
        assert first == before, (step, totals)
        assert after - before == 4 * n + 4, (step, totals, n)


@pytest.mark.parametrize("form", FORMS)
def test_a_checkpoint_resumes_bitwise_and_replicas_stay_identical(lifecycle_runs: str, form: str) -> None:
    outs = load_outputs(lifecycle_runs, form, W)
    for out in outs:
        assert torch.equal(out["sparse"]["whole"], out["sparse"]["resumed"])
        assert torch.equal(out["sparse"]["whole"], outs[0]["sparse"]["whole"])
        assert torch.equal(out["dense"]["params"], outs[0]["dense"]["params"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_fabric_and_trainer_forms_of_a_strategy_train_alike(lifecycle_runs: str, strategy: str) -> None:
    suffix = "" if strategy == "ddp" else "_fsdp"
    fabric, trainer = (load_outputs(lifecycle_runs, f"{kind}{suffix}", W)[0] for kind in ("fabric", "trainer"))
    assert rel_err(fabric["dense"]["params"], trainer["dense"]["params"]) < 1e-6
    assert torch.equal(fabric["sparse"]["whole"], trainer["sparse"]["whole"])


@pytest.mark.parametrize("form", FORMS)
def test_rank_0_tells_the_run_once_and_sums_it_up_once(lifecycle_runs: str, form: str) -> None:
    """Rank 0: the engine's start-up line, the notice that every step was sent dense (density 1), and the run's
    summary, each once; rank 1 says none of it."""
    rank0, rank1 = load_outputs(lifecycle_runs, form, W)
    (summary,) = rank0["summaries"]
    assert f"steps:         {DENSE_STEPS}: {DENSE_STEPS} dense (density=1 is above 1/4" in summary, summary
    (notice,) = rank0["notices"]
    # The settings it suggests are written for the strategy in use.
    strategy = STRATEGIES[form].__name__
    assert f"{DENSE_STEPS} optimizer steps, all sent dense" in notice and f"{strategy}(density=0.01)" in notice, notice
    (start,) = [m for m in rank0["messages"] if m.startswith("lightning_scape: SCAPE on ")]
    assert "100.00% of the coordinates per step" in start, start
    assert not rank1["summaries"] and not rank1["notices"] and not rank1["messages"]


@pytest.mark.parametrize("form", FORMS)
def test_a_dead_rank_is_named_once_and_the_survivor_stops_without_a_summary(
    failure_runs: dict[str, dict[str, Any]], form: str
) -> None:
    result = failure_runs[form]
    out = result["output"]
    # It stopped by itself with an error, after the good steps (not killed by the fixture). A failed process
    # destroys nothing at exit (a peer is gone): gloo may then abort it as the interpreter finalizes (-6).
    assert result["returncode"] not in (None, 0, -signal.SIGKILL), out[-4000:]
    assert "READY" in out and "rank 1 stopped answering" in out, out[-4000:]
    assert out.count("Traceback (most recent call last)") <= 1, out[-8000:]
    assert not re.search(r"Operation timed out|Timed out waiting", out), out[-4000:]
    assert run_summary.HEADING not in out, out[-4000:]
