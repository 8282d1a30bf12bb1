"""``ScapeFSDPStrategy``'s set-up of the SCAPE optimizer over FSDP2's shards, shared by its Fabric and Trainer forms.

* :func:`build_fsdp_scape_optimizer`: the user's optimizer, its engine on the replicate group and the binding
  (:mod:`lightning_scape.engine.fsdp_binding` holds the grid, the sharding and the binding themselves);
* :func:`request_global_clip`: clipping by the norm over all shards;
* :func:`describe_shard_engine` and :func:`cpu_init_warned_once`: the start-up line, and torch's warning about
  initialising on a CPU mesh shown once rather than by every process;
* :func:`replace_params`: an optimizer created before ``fabric.setup`` pointed at the sharded parameters.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.nn import Module
from torch.optim import Optimizer

from lightning_scape.adams import AdamS
from lightning_scape.comm import Communicator
from lightning_scape.config import ScapeConfig
from lightning_scape.engine import ScapeEngine
from lightning_scape.engine.fsdp_binding import ShardBinding, ShardGrid, global_clip_norm, shard_max_norm
from lightning_scape.runtime.engine_setup import describe_engine, logged_pilot
from lightning_scape.runtime.optimizer import ScapeOptimizer, to_adams


def build_fsdp_scape_optimizer(
    optimizer: Optimizer,
    config: ScapeConfig,
    module: Module,
    communicator: Communicator,
    grid: ShardGrid | None = None,
    resume_with_new_config: bool = False,
    agree: Callable[[Tensor], Tensor] | None = None,
) -> tuple[ScapeOptimizer, ShardBinding]:
    """The user's optimizer as a :class:`ScapeOptimizer` whose engine steps this rank's shard across the groups.

    Args:
        optimizer: AdamS, AdamW or Adam over the sharded model's parameters.
        config: The SCAPE configuration.
        module: The sharded model.
        communicator: The replicate group's collectives (:func:`replicate_communicator`).
        grid: The processes' groups; given (the strategies give it), rank 0 logs what SCAPE will do, as
            ``ScapeStrategy`` does (:func:`describe_shard_engine`).
        resume_with_new_config: Let a state saved with other settings load (the engine's argument).
        agree: The mean over the other shards' engines (:func:`~lightning_scape.engine.fsdp_binding.shard_mean`),
            through which the engines of all shards choose the same form where SCAPE chooses it.

    Returns:
        The optimizer to hand back to Lightning, and the binding (its hooks are removed at teardown).
    """
    if isinstance(optimizer, ScapeOptimizer):
        raise ValueError("This optimizer was already set up by a SCAPE strategy; set up the original once.")
    adams = to_adams(optimizer)
    binding = ShardBinding(module)
    shadow = AdamS(binding.order or [nn.Parameter(torch.zeros(1))])
    shadow.param_groups = binding.proxy_groups(adams)
    engine = ScapeEngine(
        shadow,
        config,
        communicator,
        param_order=binding.order,
        sync_params=False,
        form_pilot=logged_pilot(agree),
        resume_with_new_config=resume_with_new_config,
    )
    binding.attach(engine)
    if grid is not None:
        rank_zero_info(describe_shard_engine(engine, grid, sum(p.numel() for p in module.parameters())))
    return ScapeOptimizer(adams, engine, source=optimizer), binding


def describe_shard_engine(engine: ScapeEngine, grid: ShardGrid, model_numel: int) -> str:
    """The start-up line of ``ScapeStrategy`` (:func:`~lightning_scape.runtime.engine_setup.describe_engine`) for one
    rank's engine of ``ScapeFSDPStrategy``: the groups SCAPE runs across, and the rank's shard of the model."""
    subject = (
        f"SCAPE on each rank's shard of the {model_numel:,} parameters, across {grid.replicas} "
        f"group{'' if grid.replicas == 1 else 's'} of shard_size={grid.shard_size} processes (FSDP2 inside each); "
        f"rank {grid.rank}'s shard: {engine.numel:,} coordinates, FSDP's padding included,"
    )
    line = describe_engine(engine, subject)
    if grid.replicas == 1:  # a single group: SCAPE's collectives have no peer
        line += " With one group SCAPE has nothing to send: FSDP's reduce-scatter alone averages the gradients."
    return line


# torch's warning when sharded parameters are initialised on a CPU mesh (the meta-device models that Lightning's
# FSDP2 strategies materialise), which every process would print once.
DTENSOR_CPU_INIT_WARNING = "DTensor random operators may not have complete support on cpu device mesh"


@contextmanager
def cpu_init_warned_once(rank: int) -> Iterator[None]:
    """Inside, torch's :data:`DTENSOR_CPU_INIT_WARNING` shows on rank 0 only: the same words from every process
    tell nothing more. Only that warning, and only inside."""
    with warnings.catch_warnings():
        if rank != 0:
            warnings.filterwarnings("ignore", message=re.escape(DTENSOR_CPU_INIT_WARNING), category=UserWarning)
        yield


def replace_params(optimizer: Optimizer, before: dict[int, str], module: Module) -> None:
    """Point the optimizer's param groups at the sharded parameters that replaced the model's ones.

    ``fabric.setup(model, optimizer)`` passes an optimizer over the parameters ``fully_shard`` replaced.

    Args:
        optimizer: The user's optimizer.
        before: ``id(parameter) -> name`` of the model before sharding.
        module: The sharded model.
    """
    now = dict(module.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [now[before[id(p)]] if id(p) in before else p for p in group["params"]]


def request_global_clip(optimizer: ScapeOptimizer, max_norm: float, shard_group: Any, shard_size: int) -> float:
    """Clip the coming step's synchronised gradient to global norm ``max_norm`` over all shards.

    Returns:
        The global norm before clipping.
    """
    norm, shard_norm = global_clip_norm(optimizer.engine, shard_group, shard_size)
    optimizer.request_clip(max_norm=shard_max_norm(max_norm, norm, shard_norm))
    return norm
