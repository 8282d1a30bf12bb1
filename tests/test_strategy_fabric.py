"""Fabric's ScapeStrategy on two gloo processes started by torchrun, against bare-engine references.

Each ``@scenario("fabric")`` function below is one Fabric run; the ``fabric_runs`` fixture (conftest) runs
them all, in the order they are defined, in one ``torchrun --nproc_per_node=2`` launch
(``_launch_scenarios.py``), and the test under each scenario reads what it saved.

Also: a rank that stops answering makes the other one stop within the collective timeout, with
an error that names the missing rank and the collective (two "nodes" started by hand, NODE_RANK style:
the ``@scenario("fault")`` function and the ``fault_run`` fixture).
"""

from __future__ import annotations

import os
import subprocess
import time
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
from helpers import (
    LR,
    PYTHON,
    SCAPE,
    child_env,
    engine_snapshot,
    expect_failure,
    flat,
    launcher_args,
    load_outputs,
    lr_lambda,
    make_net,
    param_groups,
    rank_batches,
    rank_zero_messages,
    reference,
    same,
    save_output,
    scenario,
    survivor_outcome,
)
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision.amp import MixedPrecision

from lightning_scape import CommunicationMonitor, MaskMonitor, ScapeConfig, ScapeStrategy
from lightning_scape.examples.workloads import free_port
from lightning_scape.planning import run_summary

pytestmark = pytest.mark.dist

ENGINE_STATE = ("momentum", "residual", "last_sent", "masks", "step_count", "refresh_count")

# ------------------------------------------------------------------------------ what the scenarios run


def fabric_loop(
    fabric: Fabric,
    model: Any,
    opt: Any,
    sched: Any,
    start: int,
    stop: int,
    accumulate: int = 1,
    max_norm: float | None = None,
    inject_inf_at: int | None = None,
) -> list[float]:
    """Optimizer steps ``start``..``stop-1`` over this rank's batches (the data order of the reference); the
    norms ``fabric.clip_gradients`` returned when ``max_norm`` is given."""
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
    """The tiny net, AdamW and the LR schedule through ``fabric``: model and optimizer ``separately`` (litgpt's
    order) or together with ``fabric.setup``."""
    net = make_net()
    if separately:  # litgpt's order: model first, then an optimizer over its parameters
        model = fabric.setup_module(net)
        opt = torch.optim.AdamW(param_groups(net, LR), lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        opt = fabric.setup_optimizers(opt)
    else:
        opt = torch.optim.AdamW(param_groups(net, LR), lr=LR)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        model, opt = fabric.setup(net, opt)
    return model, opt, sched


def two_process_fabric(**kwargs: Any) -> Fabric:
    """A launched two-process CPU Fabric (the torchrun processes) with ``kwargs``."""
    fabric = Fabric(accelerator="cpu", devices=2, **kwargs)
    fabric.launch()
    return fabric


def torchrun_rank() -> int:
    """This process's rank, as torchrun set it."""
    return int(os.environ["RANK"])


def checkpoint_path(outdir: str) -> str:
    """Where :func:`resume_mid_run` saves (and :func:`load_another_configuration` loads)."""
    return os.path.join(outdir, "fabric.ckpt")


def runs(outdir: str, name: str) -> list[Any]:
    """What both ranks saved under ``name``."""
    return load_outputs(outdir, name)


# ------------------------------------------------------------------------------ scenarios and their tests


@scenario("fabric")
def registered_name(outdir: str) -> None:
    """``strategy="scape"`` with the default configuration, set up jointly, two steps."""
    fabric = two_process_fabric(strategy="scape")
    model, opt, sched = fabric_setup(fabric, separately=False)
    fabric_loop(fabric, model, opt, sched, 0, 2)
    save_output(
        outdir,
        "f_default",
        torchrun_rank(),
        {
            "config": fabric.strategy.scape_config,
            "wrapped": type(model._forward_module).__name__,
            "sent": dict(fabric.strategy.engine.counters.total_sent),
            "strategy": type(fabric.strategy).__name__,
            **end_of_run(fabric),
        },
    )


def end_of_run(fabric: Fabric) -> dict[str, list[str]]:
    """What the strategy says at the end of the run (at teardown, or the exit hook it registered), said twice: its
    warm-up warnings, its summaries, and what ``strategy.run_summary()`` returns."""
    with warnings.catch_warnings(record=True) as caught, rank_zero_messages() as logged:
        warnings.simplefilter("always")  # the children run with PYTHONWARNINGS=ignore
        fabric.strategy.scape_runtime.end_of_run()
        fabric.strategy.scape_runtime.end_of_run()
    return {
        "warmup_warnings": [str(w.message) for w in caught if "dense_warmup_steps" in str(w.message)],
        "summaries": [m for m in logged if m.startswith(run_summary.HEADING)],
        "run_summary": [fabric.strategy.run_summary()],
    }


def test_registered_name_with_default_configuration(fabric_runs: str) -> None:
    for o in runs(fabric_runs, "f_default"):
        assert o["strategy"] == "ScapeStrategy" and o["config"] == ScapeConfig()
        assert o["wrapped"] == "Sequential"  # the module itself, no DistributedDataParallel
        assert o["sent"]["values"] == 0 and o["sent"]["dense"] > 0  # dense warm-up only


def test_a_short_run_at_the_defaults_is_not_warned_its_dense_steps_measure_the_link(fabric_runs: str) -> None:
    # Where SCAPE chooses its form its first steps are dense on purpose; a fixed form's run that ends in its
    # warm-up is warned (test_runtime).
    assert all(not o["warmup_warnings"] for o in runs(fabric_runs, "f_default") + runs(fabric_runs, "f_main"))


@scenario("fabric")
def separate_setup_accumulation_clipping_and_monitors(outdir: str) -> None:
    """Set up separately (litgpt), two micro-batches per step (``no_backward_sync``), ``clip_gradients`` and
    both monitors, steps 0..7; per step, what the monitors returned and what the engine counted (read by
    ``test_monitors`` too)."""
    comm, masks = CommunicationMonitor(), MaskMonitor(topk_every_n_steps=2)
    fabric = two_process_fabric(strategy=ScapeStrategy(**SCAPE), callbacks=[comm, masks])
    model, opt, sched = fabric_setup(fabric)
    engine = fabric.strategy.engine
    logged, recorded = [], []
    norms = []
    for step in range(8):
        norms += fabric_loop(fabric, model, opt, sched, step, step + 1, accumulate=2, max_norm=0.5)
        c = engine.counters
        recorded.append(
            {
                "sent": c.step_sent_bytes,
                "dense_equivalent": c.step_dense_equivalent,
                "values": c.step_sent["values"],
                "wait_s": c.step_wait_s,
            }
        )
        logged.append({**comm.compute(), **masks.compute()})
    save_output(
        outdir,
        "f_main",
        torchrun_rank(),
        {
            "params": flat(model.parameters()),
            "norms": norms,
            "logged": logged,
            "recorded": recorded,
            "engine": engine_snapshot(engine),
            "totals": (engine.counters.total_sent_bytes, engine.counters.total_dense_equivalent),
            **end_of_run(fabric),
        },
    )


def test_rank_0_sums_the_run_up_once_at_its_end(fabric_runs: str) -> None:
    main = runs(fabric_runs, "f_main")
    (summary,), rank1 = [o["summaries"] for o in main]
    assert [summary] == main[0]["run_summary"] and not rank1  # strategy.run_summary(), logged once by rank 0
    sent, ddp = main[0]["totals"]
    kb = run_summary.format_bytes
    assert f"{kb(sent)} sent per process; DDP would have sent {kb(ddp)}: {kb(ddp - sent)} saved" in summary
    assert "steps:         8: 2 dense warm-up (dense_warmup_steps=2), 6 sparse at density 0.1" in summary
    assert " s blocked on SCAPE's collectives (" in summary


def test_separate_setup_accumulation_and_clipping_match_the_engine(fabric_runs: str) -> None:
    out = runs(fabric_runs, "f_main")
    assert torch.equal(out[0]["params"], out[1]["params"])
    ref = reference(epochs=4, accumulate=2, max_norm=0.5, shuffle=False)
    assert torch.equal(out[0]["params"], ref[0]["params"])
    # fabric.clip_gradients returns the global norm of the synchronised gradient, before clipping.
    assert out[0]["norms"] == pytest.approx(ref[0]["norms"], rel=1e-6)
    assert out[0]["norms"] == out[1]["norms"]


@scenario("fabric")
def resume_mid_run(outdir: str) -> None:
    """Resume at step 3 (mid-epoch, sparse phase): steps 0..7 uninterrupted; and 0..2, ``fabric.save``,
    ``fabric.load`` into a fresh set-up, then 3..7."""
    fabric = two_process_fabric(strategy=ScapeStrategy(**SCAPE))
    model, opt, sched = fabric_setup(fabric)
    fabric_loop(fabric, model, opt, sched, 0, 8, max_norm=1.0)
    save_output(
        outdir,
        "f_uninterrupted",
        torchrun_rank(),
        {"params": flat(model.parameters()), "engine": engine_snapshot(fabric.strategy.engine)},
    )
    path = checkpoint_path(outdir)
    model, opt, sched = fabric_setup(fabric)
    fabric_loop(fabric, model, opt, sched, 0, 3, max_norm=1.0)
    fabric.save(path, {"model": model, "optimizer": opt, "scheduler": sched, "step": 3})
    model, opt, sched = fabric_setup(fabric)
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    remainder = fabric.load(path, state)
    fabric_loop(fabric, model, opt, sched, remainder["step"], 8, max_norm=1.0)
    save_output(
        outdir,
        "f_resumed",
        torchrun_rank(),
        {"params": flat(model.parameters()), "engine": engine_snapshot(fabric.strategy.engine)},
    )


def test_resume_mid_run_continues_bitwise_identically(fabric_runs: str) -> None:
    whole, resumed = runs(fabric_runs, "f_uninterrupted"), runs(fabric_runs, "f_resumed")
    for r in range(2):
        assert torch.equal(whole[r]["params"], resumed[r]["params"])
        for key in ENGINE_STATE:
            assert same(whole[r]["engine"][key], resumed[r]["engine"][key]), (r, key)
    assert torch.equal(whole[0]["params"], reference(epochs=2, max_norm=1.0, shuffle=False)[0]["params"])


@scenario("fabric")
def load_another_configuration(outdir: str) -> None:
    """``fabric.load`` of :func:`resume_mid_run`'s checkpoint with chunks of 128 instead of 64: the error on
    each rank, and the parameters before and after."""
    fabric = two_process_fabric(strategy=ScapeStrategy(**{**SCAPE, "chunk_size": 128}))
    model, opt, _ = fabric_setup(fabric)
    before = flat(model.parameters())
    expect_failure(
        "f_other_config", outdir, lambda: fabric.load(checkpoint_path(outdir), {"model": model, "optimizer": opt})
    )
    save_output(outdir, "f_other_config_params", torchrun_rank(), {"before": before, "after": flat(model.parameters())})


def test_checkpoint_from_another_configuration_is_refused_before_loading(fabric_runs: str) -> None:
    for o in runs(fabric_runs, "f_other_config"):
        assert o["error"] is not None and "'chunk_size': (64, 128)" in o["error"]
    for o in runs(fabric_runs, "f_other_config_params"):
        assert torch.equal(o["before"], o["after"])


@scenario("fabric")
def fp16_with_an_inf_on_rank_1(outdir: str) -> None:
    """fp16 with a GradScaler, and an inf in rank 1's loss at step 3; a snapshot after each of 6 steps."""
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    fabric = two_process_fabric(
        strategy=ScapeStrategy(**SCAPE), plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    )
    model, opt, sched = fabric_setup(fabric)
    snaps = []
    for step in range(6):
        fabric_loop(fabric, model, opt, sched, step, step + 1, inject_inf_at=3)
        snaps.append(
            {
                "params": flat(model.parameters()),
                "engine": engine_snapshot(fabric.strategy.engine),
                "skipped": fabric.strategy.engine.last_step_skipped,
                "scale": scaler.get_scale(),
            }
        )
    save_output(outdir, "f_fp16", torchrun_rank(), snaps)


def test_fp16_inf_step_is_skipped_on_every_rank(fabric_runs: str) -> None:
    out = runs(fabric_runs, "f_fp16")
    for snaps in out:
        assert [s["skipped"] for s in snaps] == [i == 3 for i in range(6)]
        assert [s["scale"] for s in snaps] == [256.0] * 3 + [128.0] * 3
        assert torch.equal(snaps[2]["params"], snaps[3]["params"])
        for key in ENGINE_STATE:
            assert same(snaps[2]["engine"][key], snaps[3]["engine"][key]), key
    ref = reference(epochs=2, autocast=torch.float16, fp16_scale=256.0, inject_inf_at=3, shuffle=False)
    assert torch.equal(out[0][-1]["params"], ref[0]["trace"][5])


@scenario("fabric")
def compiled_model(outdir: str) -> None:
    """A ``torch.compile``'d model (eager backend; the Trainer run covers AOT autograd) through ``fabric.setup``,
    four steps."""
    fabric = two_process_fabric(strategy=ScapeStrategy(**SCAPE))
    net = torch.compile(make_net(), backend="eager")
    opt = torch.optim.AdamW(param_groups(net, LR), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    model, opt = fabric.setup(net, opt)
    fabric_loop(fabric, model, opt, sched, 0, 4)
    save_output(outdir, "f_compiled", torchrun_rank(), {"params": flat(model.parameters())})


def test_compiled_model_matches_the_engine(fabric_runs: str) -> None:
    out = runs(fabric_runs, "f_compiled")
    ref = reference(epochs=1, shuffle=False)
    assert torch.equal(out[0]["params"], ref[0]["trace"][3])


# ------------------------------------------------------------------------------ a rank that fails


@scenario("fault")
def peer_stops_in_a_sparse_step(outdir: str) -> None:
    """Two "nodes" (NODE_RANK, MASTER_ADDR), collective timeout ``$SCAPE_TIMEOUT``: after three steps rank 1
    stops issuing collectives (a killed rank: ``tests/test_lifecycle.py``); rank 0 prints ``READY`` and tries
    three more steps."""
    fabric = Fabric(
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy=ScapeStrategy(**SCAPE, timeout=timedelta(seconds=float(os.environ["SCAPE_TIMEOUT"]))),
    )
    fabric.launch()
    model, opt, sched = fabric_setup(fabric)
    fabric_loop(fabric, model, opt, sched, 0, 3)
    if fabric.global_rank == 1:
        time.sleep(3600)  # never issue the next collective
    print("READY", flush=True)
    fabric_loop(fabric, model, opt, sched, 3, 6)


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The "fault" scenario as a two-"node" job started by hand, with a 6 s collective timeout.

    Returns rank 0's exit code and its output. A survivor still running after 5 minutes (it stops within
    seconds) is killed: its exit code is then negative.
    """
    out = str(tmp_path_factory.mktemp("fault"))
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), SCAPE_TIMEOUT="6")
    victim, survivor = (
        subprocess.Popen(
            [PYTHON, *launcher_args("test_strategy_fabric", "fault", out)],
            env={**env, "NODE_RANK": str(node)},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for node in (1, 0)
    )
    return survivor_outcome(survivor, victim, timeout_s=300)


def test_survivor_stops_naming_the_silent_rank(fault_run: dict[str, Any]) -> None:
    result = fault_run
    out = result["output"]
    # It stopped by itself with an error, in the step after the three good ones (not killed by the fixture).
    assert result["returncode"] is not None and result["returncode"] > 0, out[-3000:]
    assert "READY" in out and "SCAPE collective" in out and "rank 0 of 2" in out, out[-3000:]  # what failed
    # One traceback: the collective's own error and the process group's are in its message, not chained after it.
    assert out.count("Traceback (most recent call last)") == 1, out[-6000:]
    # A silent peer: the collective timeout ends the wait, and the heartbeat says the peer is alive elsewhere.
    assert "rank 1 at #" in out and "never issued this collective" in out, out[-3000:]
