"""What the Fabric and Trainer strategies share to wire the engine into Lightning's lifecycle.

The two adapters (``lightning_scape/strategy.py`` for Fabric, ``lightning_scape/pytorch/strategy.py`` for
the Trainer) route Lightning's calls to the engine through these helpers: the SCAPE options a strategy
accepts, the process-group timeout, building the optimizer and its engine (and the line that describes it),
rank 0's weights at set-up, fp16 loss scaling, the notice of a run that never leaves its dense warm-up, and
the strategy registry. The algorithm is :class:`~lightning_scape.engine.ScapeEngine`,
the optimizer :mod:`lightning_scape.optimizer`, the checkpoint files :mod:`lightning_scape.checkpoints`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer

from lightning_scape.comm import make_communicator
from lightning_scape.comm.fault_naming import collective_wait_seconds
from lightning_scape.config import OPTION_NAMES, ScapeConfig
from lightning_scape.engine import ScapeEngine
from lightning_scape.optimizer import ScapeOptimizer, to_adams

if TYPE_CHECKING:
    from torch.amp import GradScaler


def resolve_config(config: ScapeConfig | None, options: Mapping[str, Any]) -> ScapeConfig:
    """``config`` (default: :class:`ScapeConfig`) with ``options`` applied; unknown names raise ``TypeError``.

    Args:
        config: A base configuration, or None for the defaults.
        options: :class:`ScapeConfig` field names and values.

    Returns:
        The validated configuration.
    """
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(
            f"ScapeStrategy got unexpected argument(s) {unknown}. SCAPE does not wrap the model in "
            "DistributedDataParallel, so DDP options (find_unused_parameters, static_graph, ...) do not apply. "
            f"Valid SCAPE options are {list(OPTION_NAMES)}, or pass config=ScapeConfig(...)."
        )
    base = config if config is not None else ScapeConfig()
    if not isinstance(base, ScapeConfig):
        raise TypeError(f"config must be a lightning_scape.ScapeConfig, got {type(base).__name__}.")
    return base.replace(**options) if options else base


def process_group_timeout(timeout: timedelta | None, config: ScapeConfig) -> timedelta:
    """The process-group timeout: the one given, else how long the engine's own waits may block.

    The two should agree: a gloo or NCCL operation that outlives the engine's wait would keep a failed
    process from exiting, and one that fails first decides when the error comes.
    """
    if timeout is not None:
        return timeout
    return timedelta(seconds=collective_wait_seconds(config.collective_timeout_s))


def build_scape_optimizer(
    optimizer: Optimizer,
    config: ScapeConfig,
    module: Module | None,
    scaler: GradScaler | None,
) -> ScapeOptimizer:
    """Convert ``optimizer``, build the engine on this process's group, and wrap both.

    Args:
        optimizer: The user's optimizer (AdamS, AdamW or Adam).
        config: The SCAPE configuration.
        module: The model, for the order its gradients arrive in (None: param-group order).
        scaler: The precision plugin's enabled ``GradScaler`` (fp16 mixed precision), if any: the engine
            divides its scale out of the gradients and skips non-finite steps on every rank.

    Returns:
        The optimizer to hand back to Lightning.
    """
    if isinstance(optimizer, ScapeOptimizer):
        raise ValueError("This optimizer was already set up by a SCAPE strategy; set up the original once.")
    adams = to_adams(optimizer)
    order = list(module.parameters()) if module is not None else None
    loss_scale: Callable[[], float] | None = None if scaler is None else scaler.get_scale
    engine = ScapeEngine(
        adams,
        config,
        make_communicator(config.collective_timeout_s),
        param_order=order,
        # The strategies broadcast rank 0's parameters and buffers at module set-up (broadcast_module_states).
        sync_params=False,
        loss_scale=loss_scale,
        skip_nonfinite=scaler is not None,
    )
    rank_zero_info(describe_engine(engine))
    return ScapeOptimizer(adams, engine, source=optimizer)


def describe_engine(engine: ScapeEngine) -> str:
    """One line for the log: the parameters, the dense warm-up, and the density the sparse steps really send.

    The effective density is the mask slots over the (padded) coordinates. It is ``slots_per_chunk /
    chunk_size`` (41 / 4096 = 1.00% for d = 0.01), except in a model so small that some buckets use smaller
    chunks (``docs/algorithm.md``, layout), where one slot per chunk is more than d.
    """
    cfg = engine.config
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
    line = f"lightning_scape: SCAPE on {engine.numel:,} parameters in {_count(n, 'bucket')}: " + ", ".join(phases)
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


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


# --------------------------------------------------------------------------------- the dense warm-up


class DenseWarmupWarning(UserWarning):
    """The warning of :class:`WarmupNotice`: a run that never leaves SCAPE's dense steps (filter it by category)."""


class WarmupNotice:
    """Says once, on rank 0, that a run is too short to leave its dense warm-up.

    A run that never leaves ``dense_warmup_steps`` sends the whole gradient at every step, as DDP does, and
    never shows what SCAPE does. Where the length of the run is known before it starts (the Trainer's
    ``estimated_stepping_batches``, the ``pretrain`` command's token budget) the warning comes then, while the
    user can still change the warm-up; otherwise (Fabric) it comes at the end of the run.
    """

    def __init__(self) -> None:
        self.given = False

    def before_run(self, config: ScapeConfig, planned_steps: float | None) -> None:
        """Warn if ``planned_steps`` optimizer steps (None or inf: not known) are all sent dense."""
        if self.given or planned_steps is None or not math.isfinite(planned_steps) or planned_steps < 1:
            return
        steps = int(planned_steps)
        if steps > config.dense_steps:
            return
        self.given = True
        rank_zero_warn(
            f"lightning_scape: this run has {steps} optimizer steps, {_all_dense(config, steps)}",
            category=DenseWarmupWarning,
        )

    def after_run(self, engine: ScapeEngine) -> None:
        """Warn if ``engine`` stepped, but never sparsely."""
        if self.given or not 0 < engine.step_count <= engine.config.dense_steps:
            return
        self.given = True
        rank_zero_warn(
            f"lightning_scape: the run ended after {engine.step_count} optimizer steps, "
            + _all_dense(engine.config, engine.step_count),
            category=DenseWarmupWarning,
        )


def _all_dense(config: ScapeConfig, steps: int) -> str:
    return (
        f"all sent dense by SCAPE's warm-up (dense_warmup_steps={config.dense_warmup_steps}, and the first "
        f"{config.dense_steps - config.dense_warmup_steps} of density_ramp_steps={config.density_ramp_steps}): "
        "every step sends the whole gradient, as DDP does, and no step is sparse. For a run this short pass a "
        f"smaller warm-up, e.g. ScapeStrategy(dense_warmup_steps={max(1, steps * 3 // 100)}, "
        f"density_ramp_steps={steps * 2 // 5})."
    )


def call_at_exit(method: Callable[[], None]) -> None:
    """Call the bound ``method`` when the interpreter exits, unless its object is gone by then."""
    import atexit

    atexit.register(_call_if_alive, weakref.WeakMethod(method))


def _call_if_alive(ref: weakref.WeakMethod[Callable[[], None]]) -> None:
    method = ref()
    if method is not None:
        method()


def broadcast_module_states(module: Module) -> None:
    """Give every rank rank 0's parameters and buffers (what DDP's constructor does), once at set-up."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from torch.distributed.utils import _sync_module_states

    group = dist.group.WORLD
    assert group is not None
    _sync_module_states(module, group, 250 * 1024 * 1024, 0, set(), True)


# --------------------------------------------------------------------------------- fp16 loss scaling


def grad_scaler_of(precision: Any) -> GradScaler | None:
    """The precision plugin's enabled ``GradScaler`` (fp16 mixed precision), if any."""
    scaler = getattr(precision, "scaler", None)
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return None
    return scaler


class _FoundInf:
    """A stand-in "optimizer" whose one gradient tells ``GradScaler.unscale_`` whether the step was skipped."""

    def __init__(self, skipped: bool, device: torch.device) -> None:
        p = torch.zeros(1, device=device)
        p.grad = torch.full((1,), float("inf") if skipped else 0.0, device=device)
        self.param_groups = [{"params": [p]}]


def report_step_to_scaler(scaler: GradScaler, optimizer: ScapeOptimizer) -> None:
    """Update ``scaler`` as if it had stepped ``optimizer``: back off when the engine skipped the step.

    The engine already unscaled the gradients and agreed across ranks on skipping; the scaler's own
    ``unscale_``/``step`` would touch gradients that were sent already, so it only sees the verdict.
    """
    device = optimizer.engine.buckets[0].params.device
    scaler.unscale_(_FoundInf(optimizer.engine.last_step_skipped, device))  # type: ignore[arg-type,unused-ignore]
    scaler.update()


# ----------------------------------------------------------------------------------------- registry


def register_strategies(cls: type, registry: Any) -> None:
    """Register ``cls`` as ``"scape"`` (started like ``"ddp"``) and ``"scape_spawn"`` (like ``"ddp_spawn"``)."""
    for name, start_method in (("scape", "popen"), ("scape_spawn", "spawn")):
        description = f"SCAPE sparse data parallelism with start_method={start_method!r}"
        _register(registry, name, cls, description=description, start_method=start_method)


def _register(registry: Any, name: str, cls: type, description: str, **init_params: Any) -> None:
    """Register ``cls`` under ``name`` unless this very class is there already (spawned workers import again)."""
    entry = dict.get(registry, name)  # the registry's own get() would instantiate the strategy
    if entry is not None and entry.get("strategy") is cls and entry.get("init_params") == init_params:
        return
    registry.register(name, cls, description=description, override=True, **init_params)
