"""``ScapeFSDPStrategy`` for the Lightning Trainer: FSDP2 inside each group of ``shard_size`` processes, SCAPE across.

A thin adapter over Lightning's ``ModelParallelStrategy`` (FSDP2); what it shares with the Fabric form
(``lightning_scape/fabric/fsdp_strategy.py``) lives in :mod:`lightning_scape.runtime.fsdp` and
:mod:`lightning_scape.runtime.fsdp_checkpoint`. Design and measurements: ``docs/fsdp.md``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.model_parallel import ModelParallelStrategy
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_scape.comm import rank_failures
from lightning_scape.config import ScapeConfig, ScapeOptions
from lightning_scape.engine import fsdp_binding
from lightning_scape.pytorch import clipping
from lightning_scape.pytorch.runtime_hooks import TrainerRuntimeHooks, state_key
from lightning_scape.runtime import fsdp, fsdp_checkpoint
from lightning_scape.runtime.optimizer import ScapeOptimizer, unwrap_optimizer
from lightning_scape.runtime.options import RunSettings, resolve_config, strategy_options_doc
from lightning_scape.runtime.parameter_holding import ShardedParameters
from lightning_scape.runtime.scape_runtime import ScapeRuntime


class ScapeFSDPStrategy(TrainerRuntimeHooks, ModelParallelStrategy):
    """SCAPE across groups of processes, FSDP2 inside each: ``Trainer(strategy=ScapeFSDPStrategy(density=0.01))``.

    Also ``Trainer(strategy="scape_fsdp")``; ``configure_model`` may build the model but must not shard it. The
    groups, what is sharded, what works and the checkpoint folders: ``docs/fsdp.md``.

    Args:
        shard_size: S, the processes that shard one model copy between them; default: the processes of one node.
            Pick the largest group joined by fast links (NVLink): FSDP's traffic stays inside it.
        auto_wrap_policy: Which modules become FSDP units: a set of block classes, or a predicate on modules;
            default ``{litgpt.model.Block}``.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default: NCCL on CUDA, gloo on the CPU.
        timeout: How long any collective may wait (default 30 minutes): see below.
        resume_with_new_config: Load a checkpoint saved with other SCAPE settings, on purpose: see below.
        config: A whole :class:`~lightning_scape.ScapeConfig`; keyword options below override its fields.
        **options: Any :class:`~lightning_scape.ScapeConfig` field.
    """

    __doc__ = (__doc__ or "") + strategy_options_doc()

    def __init__(
        self,
        shard_size: int | None = None,
        auto_wrap_policy: fsdp_binding.WrapPolicy | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        resume_with_new_config: bool = False,
        config: ScapeConfig | None = None,
        **options: Unpack[ScapeOptions],
    ) -> None:
        fsdp_binding.require_checked_torch()
        settings = RunSettings.of(timeout, resume_with_new_config)
        self._holding = ShardedParameters("The shard grid is known once the Trainer has set up the processes.")
        self.scape_runtime = ScapeRuntime(type(self).__name__, resolve_config(config, options), settings, self._holding)
        super().__init__(process_group_backend=process_group_backend, timeout=settings.process_group_timeout)
        self._shard_size = shard_size
        self._wrap_policy = auto_wrap_policy

    @property
    def grid(self) -> fsdp_binding.ShardGrid:
        """The processes as groups of ``shard_size`` (known once the processes are set up)."""
        return self._holding.grid

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every process reads its own data: FSDP inside a group is data parallel too."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup_environment(self) -> None:
        """Start the processes, then the ``("replicate", "shard")`` mesh (``LightningModule.device_mesh``)."""
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        grid = fsdp_binding.shard_grid(self.world_size, self._shard_size, self.num_processes, self.global_rank)
        self._device_mesh = fsdp_binding.build_mesh(self.root_device.type, grid)
        self._holding.place(grid, self._device_mesh)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    # ------------------------------------------------------------------------------------------ set-up

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the model in each group (once), give every group the first group's weights, then the engine."""
        from torch.distributed.fsdp import FSDPModule

        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if not any(isinstance(m, FSDPModule) for m in self.model.modules()):
            with rank_failures.agreed("Sharding the model for ScapeFSDPStrategy"):
                shard_mesh = self.device_mesh["shard"]
                fsdp_binding.shard_module(self.model, shard_mesh, self._wrap_policy, root_runs_forward=False)
            with fsdp.cpu_init_warned_once(self.global_rank):  # a model configure_model built on the meta device
                _materialize_distributed_module(self.model, self.root_device)
            replicate = self.device_mesh["replicate"].get_group()
            fsdp_binding.sync_replicas(self.model, replicate, replicate_src=self.grid.shard_index)
        self.model = self.precision_plugin.convert_module(self.model)
        self.barrier()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.scape_runtime.start_fit()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            clipping.redirect(self.precision_plugin, self.scape_runtime)  # by the norm over all shards, or by value

    # ----------------------------------------------------------------------------------------- a step

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulating micro-batches: FSDP keeps the gradients unsharded and nothing is sent, not even in a group."""
        from torch.distributed.fsdp import FSDPModule

        assert self.model is not None
        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in units:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield None
        finally:
            for m in units:
                m.set_requires_gradient_sync(True, recurse=False)

    # ------------------------------------------------------------------------------------- checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's part of the model: the local shards of its parameters, and its buffers."""
        assert self.model is not None
        return fsdp_checkpoint.local_module_state(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's SCAPE state (its shard's momentum, residual and masks)."""
        opt = unwrap_optimizer(optimizer)
        if not isinstance(opt, ScapeOptimizer):
            raise TypeError(f"ScapeFSDPStrategy saves only its own optimizer, got {type(opt).__name__}.")
        return opt.state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write the checkpoint folder ``filepath``: one file per rank (model shard, SCAPE state) and ``meta.pt``."""
        if storage_options is not None:
            raise TypeError("ScapeFSDPStrategy.save_checkpoint does not take storage_options.")
        folder = Path(self.broadcast(str(filepath)))
        rest = dict(checkpoint)
        modules = {"state_dict": rest.pop("state_dict")}
        optimizers = {state_key(i): s for i, s in enumerate(rest.pop("optimizer_states", []))}
        fsdp_checkpoint.save(folder, self.grid, modules, optimizers, rest)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Read and check the folder on every rank, load the model shard and SCAPE state; the rest for Lightning."""
        assert self.model is not None and self.lightning_module is not None
        folder = Path(self.broadcast(str(checkpoint_path)))
        opts = {state_key(i): opt for i, opt in enumerate(self.scape_optimizers)}
        modules = {"state_dict": self.model}
        checked = fsdp_checkpoint.read_and_check(folder, self.grid, modules, opts, self.lightning_module.strict_loading)
        fsdp_checkpoint.load(checked, modules, opts)
        return dict(checked.meta["metadata"])


ScapeFSDPStrategy.register_strategies(StrategyRegistry)
