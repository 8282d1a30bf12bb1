"""``ScapeStrategy`` for the Lightning Trainer: DDP's processes and cluster handling, SCAPE's communication.

A thin adapter: the engine (:mod:`lightning_scape.engine`) holds the algorithm; what this strategy
shares with the Fabric's (``lightning_scape/fabric/strategy.py``) lives in
:mod:`lightning_scape.runtime`, one module per concern.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_scape.comm import rank_failures
from lightning_scape.config import ScapeConfig, ScapeOptions
from lightning_scape.pytorch import clipping
from lightning_scape.pytorch.runtime_hooks import TrainerRuntimeHooks, state_key
from lightning_scape.runtime import checkpoint_protocol, engine_setup, setup_checks
from lightning_scape.runtime.optimizer import ScapeOptimizer, unwrap_optimizer
from lightning_scape.runtime.options import RunSettings, resolve_config, strategy_options_doc
from lightning_scape.runtime.parameter_holding import ReplicatedParameters
from lightning_scape.runtime.scape_runtime import ScapeRuntime


class ScapeStrategy(TrainerRuntimeHooks, DDPStrategy):
    """SCAPE sparse data parallelism for the Trainer: ``Trainer(strategy=ScapeStrategy(density=0.01))`` or ``"scape"``.

    Processes and clusters as in Lightning's ``DDPStrategy``; gradients travel through the SCAPE engine, and
    ``configure_optimizers`` returns one :class:`~lightning_scape.AdamS`, ``torch.optim.AdamW`` or ``Adam`` (with any
    LR scheduler). What works, what differs from DDP (``param.grad``, clipping) and how checkpoints resume:
    ``docs/lightning.md``.

    Args:
        accelerator: The accelerator (the Trainer picks it from ``Trainer(accelerator=...)`` when None).
        parallel_devices: The devices of this node (the Trainer fills it from ``devices``).
        cluster_environment: How processes find each other (auto-detected: torchrun, SLURM, LSF, ...).
        checkpoint_io: How checkpoint files are written; the per-rank SCAPE files go through it as well.
        precision_plugin: The precision plugin (the Trainer builds it from ``Trainer(precision=...)``).
        process_group_backend: ``"gloo"`` or ``"nccl"``; default: NCCL on CUDA, gloo on the CPU.
        timeout: How long any collective may wait (default 30 minutes): see below.
        start_method: ``"popen"`` (default: re-runs the script for every local rank), ``"spawn"``, ``"fork"``
            or ``"forkserver"`` (for notebooks).
        resume_with_new_config: Load a checkpoint saved with other SCAPE settings, on purpose: see below.
        config: A whole :class:`~lightning_scape.ScapeConfig`; keyword options below override its fields.
        **options: Any :class:`~lightning_scape.ScapeConfig` field.
    """

    __doc__ = (__doc__ or "") + strategy_options_doc()

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        resume_with_new_config: bool = False,
        config: ScapeConfig | None = None,
        **options: Unpack[ScapeOptions],
    ) -> None:
        settings = RunSettings.of(timeout, resume_with_new_config)
        holding = ReplicatedParameters(self)
        self.scape_runtime = ScapeRuntime(type(self).__name__, resolve_config(config, options), settings, holding)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=settings.process_group_timeout,
            start_method=start_method,
        )
        self._pending_states: checkpoint_protocol.PendingStates | None = None  # read before set-up, loaded after

    # ------------------------------------------------------------------------------------------ set-up

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """DDP's set-up without the ``DistributedDataParallel`` wrapper: rank 0's weights, then the engine."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        with rank_failures.agreed("Setting up ScapeStrategy"):  # an error on any rank: reported once, by rank 0
            setup_checks.refuse_low_precision(self.precision_plugin)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        engine_setup.broadcast_module_states(self.model)
        if fitting:
            self.scape_runtime.start_fit()
            self.setup_optimizers(trainer)
            setup_checks.warn_if_one_process(self.world_size, "Trainer")
        self.setup_precision_plugin()
        if fitting:
            clipping.redirect(self.precision_plugin, self.scape_runtime)

    # ----------------------------------------------------------------------------------------- a step

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulating micro-batches: gradients stay local and nothing is sent."""
        opts = self.scape_optimizers
        if not opts:
            yield None
            return
        with opts[0].engine.no_sync():
            yield None

    # ------------------------------------------------------------------------------------- checkpoints

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's full state for a SCAPE optimizer (the checkpoint splits it into stub and rank file)."""
        opt = unwrap_optimizer(optimizer)
        if isinstance(opt, ScapeOptimizer):
            return opt.state_dict()
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Every rank writes its SCAPE state beside ``filepath``; rank 0 then writes ``filepath`` itself."""
        states = checkpoint.get("optimizer_states")
        if not states or not any(checkpoint_protocol.is_scape_state(s) for s in states):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return

        def with_stubs(stubs: dict[str, dict[str, Any]]) -> dict[str, Any]:
            return {**checkpoint, "optimizer_states": [stubs.get(state_key(i), s) for i, s in enumerate(states)]}

        checkpoint_protocol.save_scape_checkpoint(
            self.checkpoint_io,
            filepath,
            {state_key(i): s for i, s in enumerate(states) if checkpoint_protocol.is_scape_state(s)},
            with_stubs,
            rank=self.global_rank,
            world_size=self.world_size,
            broadcast=self.broadcast,
            barrier=self.barrier,
            storage_options=storage_options,
        )

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Remove the checkpoint file (rank 0) and every rank's SCAPE file."""
        checkpoint_protocol.remove_rank_states(self.checkpoint_io, filepath, self.global_rank, self.is_global_zero)
        super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Read the checkpoint and this rank's SCAPE file, and check them, before Lightning restores anything.

        Lightning calls this before set-up, as for DDP (the model and callbacks, e.g. ``StochasticWeightAveraging``,
        are restored before their set-up hooks see them). Everything that does not need the engine is checked here,
        on every rank (files, save ids, format, configuration, the model's state); the rest (the bucket layout,
        and the re-sharding of a checkpoint from another world size) when the optimizer states are restored
        (:meth:`load_optimizer_state_dict`). If any rank finds a problem, all of them stop with the error.
        """
        checkpoint, pending = checkpoint_protocol.read_checkpoint(
            self.checkpoint_io,
            checkpoint_path,
            self._load_plan,
            rank=self.global_rank,
            world_size=self.world_size,
            weights_only=weights_only,
        )
        self._pending_states = pending if pending.stubs else None
        return checkpoint

    def _load_plan(self, checkpoint: dict[str, Any]) -> checkpoint_protocol.LoadPlan:
        """What a resumed fit loads from ``checkpoint``: its SCAPE optimizers' states and the module's.

        Args:
            checkpoint: The main checkpoint file's contents.

        Returns:
            The plan for :func:`~lightning_scape.runtime.checkpoint_protocol.read_checkpoint`: nothing to check when
            not fitting (validate/test/predict) or for a weights-only checkpoint.
        """
        module = self.lightning_module
        states = checkpoint.get("optimizer_states")
        if module is None or module.trainer.state.fn != TrainerFn.FITTING or states is None:
            return checkpoint_protocol.LoadPlan()
        modules: dict[str, tuple[Module, Any, bool]] = {}
        if "state_dict" in checkpoint:
            modules["state_dict"] = (module, checkpoint["state_dict"], module.strict_loading)
        return checkpoint_protocol.LoadPlan(
            stubs={state_key(i): s for i, s in enumerate(states)},
            modules=modules,
            config=self.scape_config,
            resume_with_new_config=self.scape_run.resume_with_new_config,
        )

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Check the SCAPE states against the engine (re-sharding them on another world size), then load them.

        Every rank checks its own; if any rank finds a problem, all of them stop with the error before any
        optimizer state is loaded.
        """
        pending, self._pending_states = self._pending_states, None
        if pending is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        opts = self.scape_optimizers
        if len(pending.stubs) != len(opts):
            raise ValueError(
                f"Checkpoint {pending.path!r} has {len(pending.stubs)} optimizer states, this run {len(opts)}. "
                "No optimizer state was loaded."
            )
        keys = [state_key(i) for i in range(len(opts))]
        full = checkpoint_protocol.complete_load(self.checkpoint_io, pending, dict(zip(keys, opts, strict=True)))
        # Lightning loads the full states where the stubs were.
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": [full[k] for k in keys]})

    # -------------------------------------------------------------------------------------- lifecycle

    @override
    def teardown(self) -> None:
        """Forget a checkpoint read for a fit that never set up; then the teardown of both Trainer forms."""
        self._pending_states = None
        super().teardown()


ScapeStrategy.register_strategies(StrategyRegistry)
