"""``ScapeFSDPStrategy`` for Lightning Fabric: FSDP2 inside each group of ``shard_size`` processes, SCAPE across.

A thin adapter over Lightning's ``ModelParallelStrategy`` (FSDP2); what it shares with the Trainer's form
(``lightning_scape/pytorch/fsdp_strategy.py``) lives in :mod:`lightning_scape.runtime.fsdp` and
:mod:`lightning_scape.runtime.fsdp_checkpoint`. Design and measurements: ``docs/fsdp.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_scape.comm import rank_failures
from lightning_scape.config import ScapeConfig, ScapeOptions
from lightning_scape.engine import fsdp_binding
from lightning_scape.fabric.runtime_hooks import FabricRuntimeHooks
from lightning_scape.runtime import fsdp, fsdp_checkpoint, setup_checks
from lightning_scape.runtime.optimizer import ScapeOptimizer, unwrap_optimizer
from lightning_scape.runtime.options import RunSettings, resolve_config, strategy_options_doc
from lightning_scape.runtime.parameter_holding import ShardedParameters
from lightning_scape.runtime.scape_runtime import ScapeRuntime

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import _LRScheduler


class ScapeFSDPStrategy(FabricRuntimeHooks, ModelParallelStrategy):
    """SCAPE across groups of processes, FSDP2 inside each: ``Fabric(strategy=ScapeFSDPStrategy(density=0.01))``.

    Create the optimizer after ``fabric.setup_module(model)``, as with every FSDP2 strategy. The groups, what is
    sharded, what works and the checkpoint folders: ``docs/fsdp.md``.

    Args:
        shard_size: S, the processes that shard one model copy between them; default: the processes of one node.
            Pick the largest group joined by fast links (NVLink): FSDP's traffic stays inside it. 1 shards
            nothing (each rank holds the whole model, like :class:`~lightning_scape.ScapeStrategy`).
        auto_wrap_policy: Which modules become FSDP units: a set of block classes, or a predicate on modules;
            default ``{litgpt.model.Block}``. One unit per transformer block keeps only one block's full
            parameters alive at a time; the root module is always a unit (embeddings, head, final norm).
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
        before_launch = "The shard grid is known once Fabric has launched the processes (fabric.launch())."
        self._holding = ShardedParameters(before_launch)
        self.scape_runtime = ScapeRuntime(
            type(self).__name__,
            resolve_config(config, options),
            settings,
            self._holding,
            "fabric.setup_optimizers(optimizer)",
        )
        super().__init__(
            parallelize_fn=self._parallelize,
            process_group_backend=process_group_backend,
            timeout=settings.process_group_timeout,
        )
        self._shard_size = shard_size
        self._wrap_policy = auto_wrap_policy

    @property
    def grid(self) -> fsdp_binding.ShardGrid:
        """The processes as groups of ``shard_size`` (known once the processes are set up)."""
        return self._holding.grid

    @property
    def binding(self) -> fsdp_binding.ShardBinding:
        """How the most recently set-up optimizer's engine holds FSDP's shards."""
        if not self._holding.bindings:
            raise RuntimeError("No optimizer was set up yet: call fabric.setup_optimizers(optimizer) first.")
        return self._holding.bindings[-1]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every process reads its own data: FSDP inside a group is data parallel too."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup_environment(self) -> None:
        """Start the processes, then the ``("replicate", "shard")`` mesh."""
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        grid = fsdp_binding.shard_grid(self.world_size, self._shard_size, self.num_processes, self.global_rank)
        self._device_mesh = fsdp_binding.build_mesh(self.root_device.type, grid)
        self._holding.place(grid, self._device_mesh)

    def _parallelize(self, module: Module, mesh: Any) -> Module:
        with rank_failures.agreed("Sharding the model for ScapeFSDPStrategy"):  # reported once, by rank 0
            fsdp_binding.shard_module(module, mesh["shard"], self._wrap_policy)
        return module

    # ------------------------------------------------------------------------------------------ set-up

    @override
    def setup_module(self, module: Module) -> Module:
        """Shard the model in each group, materialise it if it was built on the meta device, and give every group
        the first group's weights."""
        with fsdp.cpu_init_warned_once(self.global_rank):  # Lightning materialises a meta-device model here
            module = super().setup_module(module)
            _materialize_distributed_module(module, self.root_device)
        grid = self.grid
        fsdp_binding.sync_replicas(module, self.device_mesh["replicate"].get_group(), replicate_src=grid.shard_index)
        self.scape_runtime.add_module(module)
        return module

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: _LRScheduler | None = None
    ) -> tuple[Module, list[Optimizer], _LRScheduler | None]:
        """``fabric.setup(model, optimizer)``: shard the model, then point the optimizer at the sharded parameters."""
        optimizer = setup_checks.the_one_optimizer("ScapeFSDPStrategy", optimizers, "fabric.setup was given")
        names = {id(p): n for n, p in module.named_parameters()}
        module = self.setup_module(module)
        fsdp.replace_params(optimizer, names, module)
        return module, [self.setup_optimizer(optimizer)], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Build the SCAPE engine for ``optimizer`` on this rank's shard, across the groups."""
        runtime = self.scape_runtime
        with rank_failures.agreed("Setting up the optimizer for ScapeFSDPStrategy"):  # reported once, by rank 0
            return runtime.set_up(optimizer, runtime.module_of(optimizer))

    # ------------------------------------------------------------------------------------- checkpoints

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write the checkpoint folder ``path``: one file per rank (model shard, SCAPE state) and ``meta.pt``."""
        if storage_options is not None or filter is not None:
            raise TypeError("ScapeFSDPStrategy.save_checkpoint takes neither storage_options nor filter.")
        folder = Path(self.broadcast(str(path)))
        modules, optimizers, rest = _split_state(state)
        metadata = {k: v.state_dict() if isinstance(v, _Stateful) else v for k, v in rest.items()}
        module_states = {k: fsdp_checkpoint.local_module_state(m) for k, m in modules.items()}
        optimizer_states = {k: opt.state_dict() for k, opt in optimizers.items()}
        fsdp_checkpoint.save(folder, self.grid, module_states, optimizer_states, metadata)
        self.barrier()

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore a checkpoint folder; everything is read and checked on every rank before anything is loaded.

        ``fabric.load_raw(path, model)`` loads a plain, whole-model state dict file into the sharded model, as
        Lightning's ``ModelParallelStrategy`` does (:func:`~lightning_scape.runtime.fsdp_checkpoint.load_full_state`).
        """
        if isinstance(state, Module):
            fsdp_checkpoint.load_full_state(Path(self.broadcast(str(path))), state, strict, weights_only)
            return {}
        if isinstance(state, Optimizer):
            raise NotImplementedError(
                "Loading a single optimizer object from a checkpoint is not supported yet with ScapeFSDPStrategy: a "
                "SCAPE optimizer's state is per rank (the momentum, residual and masks of its shard). Save and load "
                "it with fabric.save / fabric.load and a state dict."
            )
        if not isinstance(state, dict) or not state:
            raise ValueError(
                f"Got ScapeFSDPStrategy.load_checkpoint(..., state={state!r}), but a state with at least a model to "
                "reload is required: fabric.load(path, {'model': model, 'optimizer': optimizer, ...}), or "
                "fabric.load_raw(path, model) for a plain state dict file."
            )
        folder = Path(self.broadcast(str(path)))
        modules, optimizers, rest = _split_state(state)
        checked = fsdp_checkpoint.read_and_check(folder, self.grid, modules, optimizers, strict)
        fsdp_checkpoint.load(checked, modules, optimizers)
        metadata = dict(checked.meta["metadata"])
        self._restore_values(state, metadata, rest)
        return metadata

    # -------------------------------------------------------------------------------------- lifecycle

    @override
    def teardown(self) -> None:
        """Remove the engines' hooks (without waiting on collectives when a rank failed) and the bindings', stop the
        heartbeat, log the run's summary."""
        self.scape_runtime.close()
        # Lightning's ModelParallelStrategy.teardown ends in its checkpoint_io, which it refuses to have
        # (NotImplementedError): tear down what it holds without it.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision.teardown()
        self.accelerator.teardown()


def _split_state(
    state: dict[str, Any],
) -> tuple[dict[str, Module], dict[str, ScapeOptimizer], dict[str, Any]]:
    """The state's models, SCAPE optimizers, and everything else, by key."""
    modules: dict[str, Module] = {}
    optimizers: dict[str, ScapeOptimizer] = {}
    rest: dict[str, Any] = {}
    for key, obj in state.items():
        inner = unwrap_optimizer(obj)
        if isinstance(inner, ScapeOptimizer):
            optimizers[key] = inner
        elif isinstance(obj, Module):
            modules[key] = obj
        elif isinstance(obj, Optimizer):
            raise TypeError(f"state[{key!r}] is an optimizer that ScapeFSDPStrategy did not set up; it cannot save it.")
        else:
            rest[key] = obj
    return modules, optimizers, rest


ScapeFSDPStrategy.register_strategies(STRATEGY_REGISTRY)
