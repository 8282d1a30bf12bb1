"""Setting a model and its optimizer up for SCAPE (rank 0's weights everywhere, the engine, and its log line),
and closing the engines at the end of a run."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_scape.comm import abandon_in_flight, make_communicator, stop_heartbeat
from lightning_scape.config import ScapeConfig, first_decision_step
from lightning_scape.engine import ScapeEngine
from lightning_scape.planning import forms
from lightning_scape.planning.pilot import Decision, FormPilot
from lightning_scape.runtime.optimizer import ScapeOptimizer, to_adams
from lightning_scape.runtime.options import RunSettings

if TYPE_CHECKING:
    from torch.amp import GradScaler


def broadcast_module_states(module: Module) -> None:
    """Give every rank rank 0's parameters and buffers (what DDP's constructor does), once at set-up."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from torch.distributed.utils import _sync_module_states

    group = dist.group.WORLD
    assert group is not None
    _sync_module_states(module, group, 250 * 1024 * 1024, 0, set(), True)


def build_scape_optimizer(
    optimizer: Optimizer,
    config: ScapeConfig,
    module: Module | None,
    scaler: GradScaler | None,
    run: RunSettings | None = None,
) -> ScapeOptimizer:
    """Convert ``optimizer``, build the engine on this process's group, and wrap both.

    Args:
        optimizer: The user's optimizer (AdamS, AdamW or Adam).
        config: The SCAPE configuration.
        module: The model, for the order its gradients arrive in (None: param-group order).
        scaler: The precision plugin's enabled ``GradScaler`` (fp16 mixed precision), if any: the engine
            divides its scale out of the gradients and skips non-finite steps on every rank.
        run: The strategy's timeout and load setting (default: the strategies' defaults).

    Returns:
        The optimizer to hand back to Lightning.
    """
    if isinstance(optimizer, ScapeOptimizer):
        raise ValueError("This optimizer was already set up by a SCAPE strategy; set up the original once.")
    adams = to_adams(optimizer)
    run = run or RunSettings.of(None, resume_with_new_config=False)
    order = list(module.parameters()) if module is not None else None
    loss_scale: Callable[[], float] | None = None if scaler is None else scaler.get_scale
    engine = ScapeEngine(
        adams,
        config,
        make_communicator(run.timeout_s),
        param_order=order,
        # The strategies broadcast rank 0's parameters and buffers at module set-up (broadcast_module_states).
        sync_params=False,
        loss_scale=loss_scale,
        skip_nonfinite=scaler is not None,
        form_pilot=logged_pilot(),
        resume_with_new_config=run.resume_with_new_config,
    )
    rank_zero_info(describe_engine(engine))
    return ScapeOptimizer(adams, engine, source=optimizer)


def logged_pilot(agree: Callable[[Tensor], Tensor] | None = None) -> FormPilot:
    """A form pilot whose decisions rank 0 logs, as it logs the set-up line and the summary (``agree``: the
    pilot's argument)."""

    def log(decision: Decision) -> None:
        rank_zero_info("lightning_scape: " + decision.describe())

    return FormPilot(on_decision=log, agree=agree)


def close_engines(optimizers: Iterable[ScapeOptimizer], wait: bool) -> None:
    """The end of a run (the strategies' teardown): remove every engine's hooks and stop this process's heartbeat.

    Args:
        optimizers: The run's SCAPE optimizers.
        wait: Wait for collectives still in flight; False after a failure (an engine whose own collective
            failed waits for nothing either), and then the process does not wait for them at exit either.
    """
    for opt in optimizers:
        opt.engine.close(wait=wait)
    if not wait:
        abandon_in_flight()  # nor at exit: a failed run's peers may never answer what is in flight
    # The heartbeat thread serves the run's collectives; a thread left running outlives the fit (a new set-up
    # starts it again).
    stop_heartbeat()


def describe_engine(engine: ScapeEngine, subject: str | None = None) -> str:
    """One line for the log: the parameters, the dense warm-up, and the density the sparse steps really send.

    The effective density is the mask slots over the (padded) coordinates. It is ``slots_per_chunk /
    chunk_size`` (41 / 4096 = 1.00% for d = 0.01), except in a model so small that some buckets use smaller
    chunks (``docs/algorithm.md``, layout), where one slot per chunk is more than d.

    Args:
        engine: The engine just built.
        subject: What SCAPE runs on, after ``"lightning_scape: "``; default ``"SCAPE on N parameters"``
            (``ScapeFSDPStrategy`` names the groups and this rank's shard).
    """
    cfg = engine.config
    if not engine.buckets:
        return (
            "lightning_scape: SCAPE has no trainable parameters yet (all frozen): they join the engine when they "
            "are unfrozen or their param group is added to the optimizer, and its steps do nothing until then."
        )
    if engine.pilot is not None:
        return _auto_line(engine, subject)
    slots = sum(bs.layout.chunks * cfg.slots_for(bs.layout.chunk_size) for bs in engine.buckets)
    density = slots / engine.padded_numel
    n = len(engine.buckets)
    phases = []
    if cfg.dense_warmup_steps:
        phases.append(f"the first {cfg.dense_warmup_steps} steps dense (dense_warmup_steps)")
        if cfg.density_ramp_steps:
            dense_ramp = cfg.dense_steps - cfg.dense_warmup_steps
            phases.append(
                f"a density ramp over {cfg.density_ramp_steps} steps (density_ramp_steps; its first {dense_ramp} dense)"
            )
    phases.append(f"then {density:.2%} of the coordinates per step (effective density; density={cfg.density:g})")
    subject = subject or f"SCAPE on {engine.numel:,} parameters"
    line = f"lightning_scape: {subject} in {_count(n, 'bucket')}: " + ", ".join(phases)
    small = [bs.layout for bs in engine.buckets if bs.layout.chunk_size < cfg.chunk_size]
    if small:
        sizes = "; ".join(
            f"{b.numel:,} parameters in chunks of {b.chunk_size:,}, {_count(cfg.slots_for(b.chunk_size), 'slot')} each"
            for b in small
        )
        line += (
            f". This model is small: {_count(len(small), 'bucket')} {'uses' if len(small) == 1 else 'use'} chunks "
            "smaller than chunk_size="
            f"{cfg.chunk_size}, sized so that the padding the dense steps send stays within 5% ({sizes})"
        )
    return line + "."


def _auto_line(engine: ScapeEngine, subject: str | None) -> str:
    """The set-up line where SCAPE chooses the form: what it measures, when it decides, what it chooses from."""
    cfg = engine.requested_config
    first = first_decision_step(cfg.dense_warmup_steps)
    subject = subject or f"SCAPE on {engine.numel:,} parameters"
    choices = ", ".join(f.name for f in forms.candidates(cfg.sharded))
    rest = (
        f"the warm-up's other {cfg.dense_warmup_steps - first} dense steps on its wire, then "
        if cfg.dense_warmup_steps > first
        else ""
    )
    return (
        f"lightning_scape: {subject} in {_count(len(engine.buckets), 'bucket')}: the first {first} steps fp32 dense "
        f"(as DDP + AdamS sends them), measuring the compute and the link; then the form predicted to reach the same "
        f"loss first, of {choices} (a sparse form: {rest}a {cfg.density_ramp_steps}-step density ramp), checked "
        "again as the run goes on. Each decision is logged; set wire_format= and density= to fix the form"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
