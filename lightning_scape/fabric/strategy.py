"""``ScapeStrategy`` for Lightning Fabric: DDP's processes and cluster handling, SCAPE's communication.

A thin adapter: the engine (:mod:`lightning_scape.engine`) holds the algorithm; what this strategy
shares with the Trainer's (``lightning_scape/pytorch/strategy.py``) lives in
:mod:`lightning_scape.runtime`, one module per concern.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.accelerators.accelerator import Accelerator
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _PATH
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_scape.comm import rank_failures
from lightning_scape.config import ScapeConfig, ScapeOptions
from lightning_scape.fabric.runtime_hooks import FabricRuntimeHooks
from lightning_scape.runtime import checkpoint_protocol, engine_setup, loss_scaling, setup_checks
from lightning_scape.runtime.optimizer import ScapeOptimizer, unwrap_optimizer
from lightning_scape.runtime.options import RunSettings, resolve_config, strategy_options_doc
from lightning_scape.runtime.parameter_holding import ReplicatedParameters
from lightning_scape.runtime.scape_runtime import ScapeRuntime

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import _LRScheduler


class ScapeStrategy(FabricRuntimeHooks, DDPStrategy):
    """SCAPE sparse data parallelism for Fabric: ``Fabric(strategy=ScapeStrategy(density=0.01))``.

    Processes and clusters as in Lightning's ``DDPStrategy``; gradients travel through the SCAPE engine, and the
    optimizer ``fabric.setup`` returns (from an :class:`~lightning_scape.AdamS`, ``torch.optim.AdamW`` or ``Adam``) is
    a :class:`~lightning_scape.ScapeOptimizer`. What works, what differs from DDP (``param.grad``, clipping) and how
    checkpoints resume: ``docs/lightning.md``.

    Args:
        accelerator: The accelerator (Fabric picks it from ``Fabric(accelerator=...)`` when None).
        parallel_devices: The devices of this node (Fabric fills it from ``devices``).
        cluster_environment: How processes find each other (auto-detected: torchrun, SLURM, LSF, ...).
        checkpoint_io: How checkpoint files are written; the per-rank SCAPE files go through it as well.
        precision: The precision plugin (Fabric builds it from ``Fabric(precision=...)``).
        process_group_backend: ``"gloo"`` or ``"nccl"``; default: NCCL on CUDA, gloo on the CPU.
        timeout: How long any collective may wait (default 30 minutes): see below.
        resume_with_new_config: Load a checkpoint saved with other SCAPE settings, on purpose: see below.
        start_method: ``"popen"`` (default: re-runs the script for every local rank), ``"spawn"``, ``"fork"``
            or ``"forkserver"`` (for notebooks and functions launched with ``fabric.launch(fn)``).
        config: A whole :class:`~lightning_scape.ScapeConfig`; keyword options below override its fields.
        **options: Any :class:`~lightning_scape.ScapeConfig` field.
    """

    __doc__ = (__doc__ or "") + strategy_options_doc()

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        resume_with_new_config: bool = False,
        config: ScapeConfig | None = None,
        **options: Unpack[ScapeOptions],
    ) -> None:
        settings = RunSettings.of(timeout, resume_with_new_config)
        holding = ReplicatedParameters(self)
        self.scape_runtime = ScapeRuntime(
            type(self).__name__, resolve_config(config, options), settings, holding, "fabric.setup(model, optimizer)"
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=settings.process_group_timeout,
            start_method=start_method,
        )
        self._backward_sync_control = _ScapeBackwardSyncControl(self)
        self._checkpoint_world_size: int | None = None

    @property
    def checkpoint_world_size(self) -> int | None:
        """The number of ranks that wrote the SCAPE checkpoint this strategy last loaded (None before any).

        When it differs from ``world_size`` the SCAPE state was re-sharded; a training loop that counts its
        position per rank (litgpt's ``iter_num``) must rescale it (``lightning-scape pretrain`` does).
        """
        return self._checkpoint_world_size

    # ------------------------------------------------------------------------------------------ set-up

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: _LRScheduler | None = None
    ) -> tuple[Module, list[Optimizer], _LRScheduler | None]:
        """Broadcast rank 0's weights, lay the parameters out for SCAPE and wrap the optimizer."""
        with rank_failures.agreed("Setting up ScapeStrategy"):  # an error on any rank: reported once, by rank 0
            optimizer = setup_checks.the_one_optimizer("ScapeStrategy", optimizers, "fabric.setup was given")
        module = self.setup_module(module)
        return module, [self.setup_optimizer(optimizer)], scheduler

    @override
    def setup_module(self, module: Module) -> Module:  # type: ignore[override]
        """Give every rank rank 0's parameters and buffers; the module is not wrapped."""
        with rank_failures.agreed("Setting up ScapeStrategy"):  # an error on any rank: reported once, by rank 0
            setup_checks.refuse_low_precision(self.precision)
        if not self.scape_runtime.modules:
            setup_checks.warn_if_one_process(self.world_size, "Fabric")
        engine_setup.broadcast_module_states(module)
        self.scape_runtime.add_module(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Build the SCAPE engine for ``optimizer`` (its parameters become views of flat buffers)."""
        runtime = self.scape_runtime
        with rank_failures.agreed("Setting up the optimizer for ScapeStrategy"):
            return runtime.set_up(optimizer, runtime.module_of(optimizer), loss_scaling.grad_scaler_of(self.precision))

    # ------------------------------------------------------------------------------------- checkpoints

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's full state for a SCAPE optimizer (``fabric.save`` splits it into stub and rank file)."""
        opt = unwrap_optimizer(optimizer)
        if isinstance(opt, ScapeOptimizer):
            return opt.state_dict()
        return super().get_optimizer_state(optimizer)

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Rank 0 writes ``path`` (model, stubs, everything else); every rank writes its SCAPE file beside it."""
        keys = [k for k, v in state.items() if isinstance(unwrap_optimizer(v), ScapeOptimizer)]
        if not keys:
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
            return
        converted = self._convert_stateful_objects_in_state(state, filter=(filter or {}))
        checkpoint_protocol.save_scape_checkpoint(
            self.checkpoint_io,
            path,
            {k: converted[k] for k in keys},
            lambda stubs: {**converted, **stubs},  # the stubs take the full states' places, in the same order
            rank=self.global_rank,
            world_size=self.world_size,
            broadcast=self.broadcast,
            barrier=self.barrier,
            storage_options=storage_options,
        )

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore a checkpoint; everything is checked (files, configuration, shapes) before anything is loaded."""
        if isinstance(state, Optimizer) and isinstance(unwrap_optimizer(state), ScapeOptimizer):
            raise TypeError(
                "A SCAPE optimizer cannot load a raw optimizer file (fabric.load_raw): its state is per rank. "
                "Save and load it with fabric.save / fabric.load and a state dict."
            )
        if not isinstance(state, dict) or not state:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        scape = {k: opt for k, v in state.items() if isinstance(opt := unwrap_optimizer(v), ScapeOptimizer)}
        checkpoint, full = checkpoint_protocol.read_and_check(
            self.checkpoint_io,
            path,
            lambda main: _load_plan(main, state, scape, strict, self.scape_config, self.scape_run),
            rank=self.global_rank,
            world_size=self.world_size,
            weights_only=weights_only,
        )
        if scape:
            self._checkpoint_world_size = checkpoint_protocol.stub_world_size(checkpoint[next(iter(scape))])
        for name, obj in state.items():
            if name in scape and name in checkpoint:
                scape[name].load_state_dict(full[name])
                checkpoint.pop(name)
            elif isinstance(obj, Module) and name in checkpoint:
                self.load_module_state_dict(module=obj, state_dict=checkpoint.pop(name), strict=strict)
        self._restore_values(
            state, checkpoint, [k for k, v in state.items() if k not in scape and not isinstance(v, Module)]
        )
        return checkpoint


class _ScapeBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync``: backward passes accumulate locally and launch no collective."""

    def __init__(self, strategy: ScapeStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        for opt in reversed(self._strategy.scape_optimizers):
            if opt.owns(module):
                return opt.engine.no_sync()
        return nullcontext()  # no optimizer set up for this module yet: nothing would be sent anyway


def _load_plan(
    checkpoint: dict[str, Any],
    state: dict[str, Any],
    scape: dict[str, ScapeOptimizer],
    strict: bool,
    config: ScapeConfig,
    run: RunSettings,
) -> checkpoint_protocol.LoadPlan:
    """What ``fabric.load(path, state)`` loads from ``checkpoint``: the state's SCAPE optimizers and modules.

    Args:
        checkpoint: The main checkpoint file's contents.
        state: What the user asked to load, by key.
        scape: The SCAPE optimizers among ``state``, by key.
        strict: Whether every key of ``state`` must be in the checkpoint and modules must fit exactly.
        config: The strategy's SCAPE configuration, which the stubs' must match (or, with
            ``run.resume_with_new_config``, may differ from: the state is then carried over and its masks rebuilt).
        run: The strategy's run settings.

    Returns:
        The plan for :func:`~lightning_scape.runtime.checkpoint_protocol.read_and_check`.
    """
    return checkpoint_protocol.LoadPlan(
        stubs={k: checkpoint.get(k) for k in scape},
        optimizers=scape,
        modules={
            k: (obj, checkpoint[k], strict) for k, obj in state.items() if isinstance(obj, Module) and k in checkpoint
        },
        required=tuple(state) if strict else (),
        name_keys=True,
        config=config if scape else None,
        resume_with_new_config=run.resume_with_new_config,
    )


ScapeStrategy.register_strategies(STRATEGY_REGISTRY)
