"""``ScapeStrategy`` for the Lightning Trainer: DDP's processes and cluster handling, SCAPE's communication.

A thin adapter: the engine (:mod:`lightning_scape.engine`) holds the algorithm; what this strategy
shares with the Fabric's (``lightning_scape/fabric/strategy.py``) lives in
:mod:`lightning_scape.wiring`, one module per concern.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from types import MethodType
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_scape.config import ScapeConfig, ScapeOptions, options_doc
from lightning_scape.engine import ScapeEngine
from lightning_scape.wiring import checkpoint_protocol, engine_setup, loss_scaling, registry, warmup_notice
from lightning_scape.wiring.optimizer import ScapeOptimizer, scape_optimizers, unwrap_optimizer
from lightning_scape.wiring.options import process_group_timeout, resolve_config


class ScapeStrategy(DDPStrategy):
    """SCAPE sparse data parallelism for the Trainer: ``Trainer(strategy=ScapeStrategy(density=0.01))``.

    Also ``Trainer(strategy="scape")`` with the default configuration. Processes, devices and multi-node
    clusters (torchrun, SLURM, ``MASTER_ADDR``/``NODE_RANK``, ...) work as with Lightning's ``DDPStrategy``,
    but the model is not wrapped in ``DistributedDataParallel``: gradients travel through the SCAPE engine
    (one sparse collective per step after the dense warm-up) and the strategy steps the optimizer.
    ``configure_optimizers`` must return one :class:`~lightning_scape.AdamS`, ``torch.optim.AdamW`` or
    ``torch.optim.Adam`` (the last two are converted to AdamS with the same hyperparameters), with any LR
    scheduler.

    Supported: ``accumulate_grad_batches`` (nothing is sent on accumulating micro-batches),
    ``gradient_clip_val`` by norm (the global norm of the synchronised gradient) or by value, precision
    ``"32-true"``, ``"bf16-mixed"`` and ``"16-mixed"`` (a step with inf/nan gradients is skipped on every
    rank, momentum and residual untouched), ``torch.compile``, validation and the sanity check, the
    ``DistributedSampler``, and checkpoints: every rank writes its own SCAPE state beside the checkpoint
    file (``<file>.scape/rank-XXXXX.pt``), so ``trainer.fit(..., ckpt_path=...)`` continues bitwise
    identically. A checkpoint written by another number of processes is re-sharded when it is loaded
    (``docs/lightning.md``). The checkpoint file itself is an ordinary Lightning checkpoint (the model is
    replicated), loadable with ``LightningModule.load_from_checkpoint``.

    Not supported: clipping ``param.grad`` yourself, e.g. in ``on_before_optimizer_step`` (the gradients were sent
    during backward; use ``gradient_clip_val``, which clips the synchronised values).

    Args:
        accelerator: The accelerator (the Trainer picks it from ``Trainer(accelerator=...)`` when None).
        parallel_devices: The devices of this node (the Trainer fills it from ``devices``).
        cluster_environment: How processes find each other (auto-detected: torchrun, SLURM, LSF, ...).
        checkpoint_io: How checkpoint files are written; the per-rank SCAPE files go through it as well.
        precision_plugin: The precision plugin (the Trainer builds it from ``Trainer(precision=...)``).
        process_group_backend: ``"gloo"`` or ``"nccl"``; default: NCCL on CUDA, gloo on the CPU.
        timeout: Process-group timeout for Lightning's own collectives; default ``collective_timeout_s``. Keep
            it close to ``collective_timeout_s``: a failed rank's process cannot exit while a gloo/NCCL
            operation is still waiting for a dead peer.
        start_method: ``"popen"`` (default: re-runs the script for every local rank), ``"spawn"``, ``"fork"``
            or ``"forkserver"`` (for notebooks).
        config: A whole :class:`~lightning_scape.ScapeConfig`; keyword options below override its fields.
        **options: Any :class:`~lightning_scape.ScapeConfig` field.
    """

    __doc__ = (__doc__ or "") + options_doc()

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
        config: ScapeConfig | None = None,
        **options: Unpack[ScapeOptions],
    ) -> None:
        self.scape_config = resolve_config(config, options)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=process_group_timeout(timeout, self.scape_config),
            start_method=start_method,
        )
        self._failed = False
        self._pending_full_states: list[dict[str, Any]] | None = None
        self._warmup_notice = warmup_notice.WarmupNotice()

    @property
    def scape_optimizers(self) -> list[ScapeOptimizer]:
        """The SCAPE optimizers of the current fit (normally one)."""
        return list(scape_optimizers(self.optimizers))

    @property
    def engine(self) -> ScapeEngine:
        """The :class:`~lightning_scape.ScapeEngine` of the current fit."""
        opts = self.scape_optimizers
        if not opts:
            raise RuntimeError("ScapeStrategy has no engine outside trainer.fit (after the optimizers are set up).")
        return opts[0].engine

    # ------------------------------------------------------------------------------------------ set-up

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """DDP's set-up without the ``DistributedDataParallel`` wrapper: rank 0's weights, then the engine."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        self._failed = False
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        engine_setup.broadcast_module_states(self.model)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _redirect_clipping(self.precision_plugin)
            self._warmup_notice = warmup_notice.WarmupNotice()  # a new fit may warn again
            self.warn_if_all_dense(_planned_steps(trainer))

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Create the user's optimizer and schedulers, then hand the optimizer to a SCAPE engine."""
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"ScapeStrategy steps one optimizer, but configure_optimizers returned {len(self.optimizers)}. "
                "Put all parameters in param groups of one AdamS / AdamW."
            )
        assert self.model is not None
        scaler = loss_scaling.grad_scaler_of(self.precision_plugin)
        scape = engine_setup.build_scape_optimizer(self.optimizers[0], self.scape_config, self.model, scaler)
        self.optimizers = [scape]

    def warn_if_all_dense(self, planned_steps: float | None) -> None:
        """Warn once, on rank 0, if the fit's steps would all be sent dense (a ``DenseWarmupWarning``).

        Set-up calls it with ``trainer.estimated_stepping_batches``; when that is not known, the warning comes
        at the end of the fit instead.

        Args:
            planned_steps: The optimizer steps the fit will take; None or inf when not known (then nothing is
                said now).
        """
        self._warmup_notice.before_run(self.scape_config, planned_steps)

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

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """The SCAPE step (clipping requests from ``gradient_clip_val`` apply to the synchronised gradient)."""
        opt = unwrap_optimizer(optimizer)
        scaler = loss_scaling.grad_scaler_of(self.precision_plugin)
        if scaler is None or not isinstance(opt, ScapeOptimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        assert isinstance(model, pl.LightningModule)
        # The plain (not the mixed-precision) plugin logic: closure, hooks, clipping requests, then the SCAPE
        # step. GradScaler's own unscale_/step would touch gradients that the engine has already sent; the
        # engine divided the scale out in its hooks and skips non-finite steps on every rank.
        out = Precision.optimizer_step(self.precision_plugin, opt, model=model, closure=closure, **kwargs)
        loss_scaling.report_step_to_scaler(scaler, opt)
        return out

    # ------------------------------------------------------------------------------------- checkpoints

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore after set-up, so the engine exists and a checkpoint can be checked before anything loads."""
        return True

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
            return {**checkpoint, "optimizer_states": [stubs.get(_state_key(i), s) for i, s in enumerate(states)]}

        checkpoint_protocol.save_scape_checkpoint(
            self.checkpoint_io,
            filepath,
            {_state_key(i): s for i, s in enumerate(states) if checkpoint_protocol.is_scape_state(s)},
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
        """Read the checkpoint and this rank's SCAPE file; check everything before Lightning loads anything.

        Every rank checks its own file; if any rank finds a problem, all of them stop with the error.
        """
        checkpoint, full = checkpoint_protocol.read_and_check(
            self.checkpoint_io,
            checkpoint_path,
            lambda main: self._load_plan(main, f"Checkpoint {os.fspath(checkpoint_path)!r}"),
            rank=self.global_rank,
            world_size=self.world_size,
            weights_only=weights_only,
        )
        if full:  # Lightning loads the full states where the stubs were
            checkpoint["optimizer_states"] = [full[_state_key(i)] for i in range(len(full))]
        return checkpoint

    def _load_plan(self, checkpoint: dict[str, Any], where: str) -> checkpoint_protocol.LoadPlan:
        """What a resumed fit loads from ``checkpoint``: its SCAPE optimizers' states and the module's.

        Args:
            checkpoint: The main checkpoint file's contents.
            where: The checkpoint, as error messages name it.

        Returns:
            The plan for :func:`~lightning_scape.wiring.checkpoint_protocol.read_and_check`: nothing to check when
            not fitting (validate/test/predict) or for a weights-only checkpoint.
        """
        opts = self.scape_optimizers
        states = checkpoint.get("optimizer_states")
        if not opts or states is None:
            return checkpoint_protocol.LoadPlan()
        if len(states) != len(opts):
            raise ValueError(f"{where} has {len(states)} optimizer states, this run {len(opts)}. Nothing was loaded.")
        keys = [_state_key(i) for i in range(len(states))]
        modules: dict[str, tuple[Module, Any, bool]] = {}
        module = self.lightning_module
        if module is not None and "state_dict" in checkpoint:
            modules["state_dict"] = (module, checkpoint["state_dict"], module.strict_loading)
        return checkpoint_protocol.LoadPlan(
            stubs=dict(zip(keys, states, strict=True)),
            optimizers=dict(zip(keys, opts, strict=True)),
            modules=modules,
        )

    # -------------------------------------------------------------------------------------- lifecycle

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Remember a failure, so that teardown does not wait on collectives that will never finish."""
        self._failed = True
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Remove the engine's hooks and the clipping redirect, then DDP's teardown."""
        for opt in self.scape_optimizers:
            if not self._failed:  # a fit whose length was not known at the start (early stopping, ...)
                self._warmup_notice.after_run(opt.engine)
            opt.engine.close(wait=not self._failed)
        _restore_clipping(self.precision_plugin)
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """``"scape"`` (processes started like ``"ddp"``) and ``"scape_spawn"`` (like ``"ddp_spawn"``)."""
        registry.register_strategies(cls, strategy_registry)


def _state_key(index: int) -> str:
    """The key of the checkpoint's ``optimizer_states[index]`` in the checkpoint protocol's calls."""
    return f"optimizer_states.{index}"


def _planned_steps(trainer: pl.Trainer) -> float | None:
    """The optimizer steps the fit will take (``trainer.estimated_stepping_batches``), None if not known."""
    try:
        return float(trainer.estimated_stepping_batches)
    except Exception:  # no train dataloader yet, an unsized one, ...: the notice then comes at the end
        return None


def _scape_clip_gradients(
    plugin: Precision,
    optimizer: Optimizer,
    clip_val: int | float = 0.0,
    gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
) -> None:
    """``Precision.clip_gradients`` for SCAPE: record the request; the engine clips the synchronised values."""
    if clip_val <= 0:
        return
    opt = unwrap_optimizer(optimizer)
    if not isinstance(opt, ScapeOptimizer):
        raise TypeError(f"ScapeStrategy can only clip its own optimizer, got {type(opt).__name__}.")
    if GradClipAlgorithmType(gradient_clip_algorithm) == GradClipAlgorithmType.VALUE:
        opt.request_clip(clip_value=float(clip_val))
    else:
        opt.request_clip(max_norm=float(clip_val))


def _redirect_clipping(plugin: Precision) -> None:
    """Route the Trainer's gradient clipping (``gradient_clip_val``) to the engine.

    Clipping ``param.grad`` locally would act on gradients that were already sent; the engine instead clips
    the synchronised values of the coming step (by their global norm, or by value).
    """
    plugin.clip_gradients = MethodType(_scape_clip_gradients, plugin)  # type: ignore[method-assign]


def _restore_clipping(plugin: Precision) -> None:
    if "clip_gradients" in vars(plugin):
        del plugin.clip_gradients


ScapeStrategy.register_strategies(StrategyRegistry)
