"""How a strategy's engine holds the parameters: the one thing the DDP and FSDP forms do differently at run time.

* :class:`ReplicatedParameters` (``ScapeStrategy``): every rank holds the whole model, and SCAPE runs across all
  processes;
* :class:`ShardedParameters` (``ScapeFSDPStrategy``): FSDP2 shards the model inside groups of ``shard_size``
  processes, and each rank's engine runs SCAPE on its shard across the groups (through a
  :class:`~lightning_scape.engine.fsdp_binding.ShardBinding`).

:class:`~lightning_scape.runtime.scape_runtime.ScapeRuntime` asks its holding to build an engine, to clip by the
global norm and for the number of SCAPE's ranks; the rest of a run is the same in both forms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch.nn import Module
from torch.optim import Optimizer

from lightning_scape.config import ScapeConfig
from lightning_scape.engine import fsdp_binding
from lightning_scape.runtime import engine_setup, fsdp
from lightning_scape.runtime.optimizer import ScapeOptimizer
from lightning_scape.runtime.options import RunSettings

if TYPE_CHECKING:
    from torch.amp import GradScaler


class _Processes(Protocol):
    @property
    def world_size(self) -> int:
        """Lightning's ``ParallelStrategy.world_size``: known once the processes are launched."""
        ...


class ReplicatedParameters:
    """Every rank holds the whole model; SCAPE runs across all processes (``ScapeStrategy``)."""

    baseline = "DDP"

    def __init__(self, strategy: _Processes) -> None:
        """``strategy``: whose processes SCAPE runs across (held, not a function of it: a strategy is pickled when
        ``start_method="spawn"`` starts its processes)."""
        self._strategy = strategy

    def ranks(self) -> int | None:
        """The ranks SCAPE runs across (the processes, or the groups), None until the processes are set up."""
        return self._strategy.world_size

    def build(
        self,
        optimizer: Optimizer,
        module: Module | None,
        config: ScapeConfig,
        settings: RunSettings,
        scaler: GradScaler | None,
    ) -> ScapeOptimizer:
        """The user's ``optimizer`` as a :class:`ScapeOptimizer` whose engine holds ``module``'s parameters (None:
        the parameters in param-group order; ``scaler``: fp16 mixed precision's enabled ``GradScaler``)."""
        return engine_setup.build_scape_optimizer(optimizer, config, module, scaler, settings)

    def global_norm(self, optimizer: ScapeOptimizer) -> float:
        """The global L2 norm of the coming step's synchronised gradient, over the whole model."""
        return optimizer.engine.global_grad_norm()  # this rank's engine holds the whole gradient

    def request_global_clip(self, optimizer: ScapeOptimizer, max_norm: float) -> float:
        """Clip the coming step to global norm ``max_norm``; returns the norm before clipping."""
        norm = self.global_norm(optimizer)
        self.request_clip(optimizer, max_norm)
        return norm

    def request_clip(self, optimizer: ScapeOptimizer, max_norm: float) -> None:
        """:meth:`request_global_clip` where the norm is not wanted: the step computes it where it clips, so none is
        computed (nor read to the host) ahead of it."""
        optimizer.request_clip(max_norm=max_norm)

    def close(self) -> None:
        """The end of a run: remove what the holding hooked into the model."""
        return None


class ShardedParameters:
    """FSDP2 shards the model inside groups of ``shard_size``; each rank's engine runs SCAPE on its shard across the
    groups (``ScapeFSDPStrategy``)."""

    baseline = "HSDP"  # the engines send each rank's shard across the groups, as HSDP's all-reduce does

    def __init__(self, before_launch: str) -> None:
        """``before_launch``: the error's words for a grid asked for before the processes are set up."""
        self._before_launch = before_launch
        self._grid: fsdp_binding.ShardGrid | None = None
        self._mesh: Any = None
        self.bindings: list[fsdp_binding.ShardBinding] = []

    def place(self, grid: fsdp_binding.ShardGrid, mesh: Any) -> None:
        """The processes' groups and their ``("replicate", "shard")`` device mesh, once the processes are set up."""
        self._grid, self._mesh = grid, mesh

    @property
    def grid(self) -> fsdp_binding.ShardGrid:
        """The processes as groups of ``shard_size``."""
        if self._grid is None:
            raise RuntimeError(self._before_launch)
        return self._grid

    def ranks(self) -> int | None:
        return self._grid.replicas if self._grid is not None else None  # SCAPE runs across the groups

    def build(
        self,
        optimizer: Optimizer,
        module: Module | None,
        config: ScapeConfig,
        settings: RunSettings,
        scaler: GradScaler | None,
    ) -> ScapeOptimizer:
        if scaler is not None:  # Lightning's FSDP2 strategies refuse precision="16-mixed" before this
            raise ValueError("ScapeFSDPStrategy does not train with fp16 loss scaling; use precision='bf16-mixed'.")
        if module is None:
            raise ValueError(
                "ScapeFSDPStrategy found no set-up model whose parameters this optimizer holds. Create it "
                "after model = fabric.setup_module(model), from model.parameters()."
            )
        comm = fsdp_binding.replicate_communicator(self._mesh, self.grid, settings.timeout_s)
        agree = fsdp_binding.shard_mean(self._mesh, self.grid)
        scape, binding = fsdp.build_fsdp_scape_optimizer(
            optimizer, config, module, comm, self.grid, settings.resume_with_new_config, agree
        )
        self.bindings.append(binding)
        return scape

    def global_norm(self, optimizer: ScapeOptimizer) -> float:
        shard_group = self._mesh["shard"].get_group()  # the norm sums over this group's shards
        return fsdp_binding.global_clip_norm(optimizer.engine, shard_group, self.grid.shard_size)[0]

    def request_global_clip(self, optimizer: ScapeOptimizer, max_norm: float) -> float:
        shard_group = self._mesh["shard"].get_group()
        return fsdp.request_global_clip(optimizer, max_norm, shard_group, self.grid.shard_size)

    def request_clip(self, optimizer: ScapeOptimizer, max_norm: float) -> None:
        self.request_global_clip(optimizer, max_norm)  # each shard's clip is set from the global norm

    def close(self) -> None:
        for binding in self.bindings:
            binding.detach()
        self.bindings.clear()


# What :class:`~lightning_scape.runtime.scape_runtime.ScapeRuntime` asks of a form: ``baseline`` (what the summary
# compares the bytes sent with), ``ranks()``, ``build(...)``, ``global_norm(...)``, ``request_global_clip(...)``,
# ``request_clip(...)`` and ``close()``, as :class:`ReplicatedParameters` documents them.
ParameterHolding = ReplicatedParameters | ShardedParameters
