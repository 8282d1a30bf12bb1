"""FSDP2's shards held by a :class:`~lightning_scape.engine.ScapeEngine`: the grid of processes, the sharding, the
binding of FSDP's sharded parameters to the engine's buffers, clipping over all shards (torch only, no Lightning).

* :class:`ShardGrid`: the W processes as R = W / S rows of S; rank ``r * S + s`` holds shard s. The "shard"
  group of a rank is its row (consecutive ranks: one node by default), its "replicate" group the R ranks that
  hold the same shard;
* :func:`shard_module`: ``fully_shard`` on the 1-D shard mesh, every block of the wrapping policy one FSDP unit,
  the root the rest;
* :class:`ShardBinding`: FSDP's sharded parameters as the parameters of a :class:`ScapeEngine` on the replicate
  group: their local shards become views into the engine's flat buffers (so the engine's update is what FSDP
  all-gathers for the next forward), and their ``.grad`` views into the engine's gradient buffers (so FSDP's
  reduce-scatter output lands there); FSDP's post-accumulate-grad hooks tell the engine a gradient is ready;
* :func:`global_clip_norm`: the gradient norm over all shards.

FSDP2 has no public way to put its sharded parameters into storage the caller owns. :class:`ShardBinding` is
the one place that touches its internals (``FSDPParam``: the padded shard ``_sharded_param_data`` that its
all-gather reads, ``sharded_size``, ``padded_sharded_param_size``, ``to_sharded_dtensor``), checked against
torch 2.11 and 2.13 (:func:`require_checked_torch`); :func:`fsdp_param_groups` fails with a clear error if they
move. ``ScapeFSDPStrategy`` (``docs/fsdp.md``) builds on it through :mod:`lightning_scape.runtime.fsdp`.
"""

from __future__ import annotations

import math
import re
from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import Module

from lightning_scape.adams import AdamS
from lightning_scape.comm import Communicator, FaultNamingCommunicator, SoloCommunicator
from lightning_scape.engine.scape_engine import ScapeEngine

WrapPolicy = set[type[Module]] | Callable[[Module], bool]


@dataclass(frozen=True)
class ShardGrid:
    """The processes as R rows ("replicate") of S consecutive ranks ("shard").

    Attributes:
        world_size: W, all processes.
        shard_size: S, the processes that shard one model copy between them (a node by default).
        rank: This process's global rank.
    """

    world_size: int
    shard_size: int
    rank: int

    @property
    def replicas(self) -> int:
        """R = W / S: the groups SCAPE runs across."""
        return self.world_size // self.shard_size

    @property
    def replica_index(self) -> int:
        """This rank's group (its rank in the replicate group)."""
        return self.rank // self.shard_size

    @property
    def shard_index(self) -> int:
        """The shard this rank holds (its rank in the shard group)."""
        return self.rank % self.shard_size


def shard_grid(world_size: int, shard_size: int | None, processes_per_node: int, rank: int) -> ShardGrid:
    """The grid for ``shard_size`` (None: the processes of one node), checked.

    Args:
        world_size: W.
        shard_size: S, or None for ``processes_per_node``.
        processes_per_node: The processes Lightning starts on each node.
        rank: This process's global rank.

    Returns:
        The grid.
    """
    size = processes_per_node if shard_size is None else shard_size
    if size < 1 or world_size % size != 0:
        raise ValueError(
            f"ScapeFSDPStrategy(shard_size={size}) must divide the {world_size} processes into equal groups. "
            f"Pick a divisor of {world_size} (normally the processes of one node, the default)."
        )
    return ShardGrid(world_size=world_size, shard_size=size, rank=rank)


def build_mesh(device_type: str, grid: ShardGrid) -> Any:
    """The 2-D ``("replicate", "shard")`` device mesh of ``grid`` (every process must call it)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (grid.replicas, grid.shard_size), mesh_dim_names=("replicate", "shard"))


def default_wrap_policy() -> set[type[Module]]:
    """litgpt's transformer block, the unit litgpt's own FSDP runs use (empty when litgpt is not installed)."""
    try:
        from litgpt.model import Block
    except ImportError:
        return set()
    return {Block}


def shard_module(module: Module, shard_mesh: Any, policy: WrapPolicy | None, root_runs_forward: bool = True) -> int:
    """``fully_shard`` every module the policy picks (innermost first) on ``shard_mesh``, then the root(s).

    Args:
        module: The model, not yet sharded.
        shard_mesh: The 1-D mesh of this rank's shard group.
        policy: Block classes, or a predicate on modules; None: :func:`default_wrap_policy`.
        root_runs_forward: Whether ``module``'s forward runs the model (Fabric's module). False for a
            ``LightningModule``, whose ``training_step`` calls its submodules: they become the roots.

    Returns:
        The number of FSDP units, the roots included.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, fully_shard

    if any(isinstance(m, FullyShardedDataParallel | FSDPModule) for m in module.modules()):
        raise TypeError(
            "ScapeFSDPStrategy shards the model itself; this one is already wrapped in FSDP. Pass the plain model "
            "to fabric.setup_module / the Trainer, and choose the FSDP units with auto_wrap_policy."
        )
    wrap = _as_predicate(default_wrap_policy() if policy is None else policy)
    units = [m for m in module.modules() if m is not module and wrap(m)]
    for m in reversed(units):  # children before their parents, as fully_shard requires
        fully_shard(m, mesh=shard_mesh)
    roots = [module] if root_runs_forward else _submodule_roots(module)
    for root in roots:
        if not isinstance(root, FSDPModule):
            fully_shard(root, mesh=shard_mesh)
    return len(units) + len([r for r in roots if r not in units])


def _submodule_roots(module: Module) -> list[Module]:
    """The children of a ``LightningModule`` that hold parameters: each one an FSDP root."""
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(
            f"{type(module).__name__} registers parameters directly on itself, which ScapeFSDPStrategy cannot shard "
            "(its training_step is not a forward pass FSDP sees). Keep them in a submodule (self.model = ...)."
        )
    return [c for c in module.children() if any(True for _ in c.parameters())]


def _as_predicate(policy: WrapPolicy) -> Callable[[Module], bool]:
    if isinstance(policy, set):
        classes = tuple(policy)
        if not all(isinstance(c, type) and issubclass(c, Module) for c in classes):
            raise TypeError(f"auto_wrap_policy must be a set of nn.Module classes or a callable, got {policy!r}.")
        return lambda m: isinstance(m, classes)
    if callable(policy):
        return policy
    raise TypeError(f"auto_wrap_policy must be a set of nn.Module classes or a callable, got {policy!r}.")


@torch.no_grad()
def sync_replicas(module: Module, replicate_group: Any, replicate_src: int) -> None:
    """Give every group the first group's model: each shard from the rank of group 0 that holds it, buffers
    (not sharded) from rank 0. Called after sharding, so no process ever holds the whole model."""
    from torch.distributed.tensor import DTensor

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for p in module.parameters():
        if isinstance(p, DTensor):
            dist.broadcast(p.to_local(), src=replicate_src, group=replicate_group)
        else:
            dist.broadcast(p.data, src=0)
    for b in module.buffers():
        dist.broadcast(b.data if not isinstance(b, DTensor) else b.to_local(), src=0)


# The torch releases whose FSDP2 internals the binding below was run against (FSDPParam's padded shard, a unit's
# parameter groups): 2.11 on the GPU machines, 2.13 in CI. 2.12 (not run) lies between the two, whose internals
# the binding reads alike; outside the range they may have moved, and a binding that misread them would train wrongly.
CHECKED_TORCH = ((2, 11), (2, 13))


def require_checked_torch(version: str | None = None) -> None:
    """Refuse a torch whose FSDP2 internals the FSDP form was not checked against (:data:`CHECKED_TORCH`).

    Args:
        version: A torch version string (default: the installed torch's).

    Raises:
        RuntimeError: The version lies outside the checked range; the message names the range.
    """
    version = version or torch.__version__
    found = re.match(r"(\d+)\.(\d+)", version)
    low, high = CHECKED_TORCH
    if found is not None and low <= (int(found[1]), int(found[2])) <= high:
        return
    checked = f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
    raise RuntimeError(
        f"ScapeFSDPStrategy binds to FSDP2's internals, which it was checked against on torch {checked}; this is "
        f"torch {version}. Install a torch in that range (pip install 'torch>={low[0]}.{low[1]},<{high[0]}."
        f"{high[1] + 1}', which the package's [fsdp] extra asks for), or use ScapeStrategy, which does not shard and "
        "has no such bound."
    )


def fsdp_params(module: Module) -> list[Any]:
    """FSDP's ``FSDPParam`` objects of every unit of ``module`` (torch 2.11 and 2.13 internals)."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            for group in fsdp_param_groups(m._get_fsdp_state()):
                found.extend(group.fsdp_params)
    return found


def fsdp_param_groups(state: Any) -> list[Any]:
    """The ``FSDPParamGroup`` objects of one FSDP unit's state, wherever this torch keeps them."""
    if hasattr(state, "_fsdp_param_groups"):  # torch 2.13: a list
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):  # torch 2.11: one group, or None for a unit without parameters
        return [] if state._fsdp_param_group is None else [state._fsdp_param_group]
    raise RuntimeError(
        f"ScapeFSDPStrategy needs FSDP2's parameter groups, which this torch ({torch.__version__}) keeps "
        "elsewhere. Use a torch this package was checked with: 2.11 or 2.13."
    )


@dataclass
class _Sharded:
    """One FSDP parameter bound to an engine: its proxy is the engine's parameter, padded as FSDP pads it."""

    fsdp_param: Any
    proxy: nn.Parameter
    rows: int  # the real rows of this rank's shard (dim 0); the padded rows after them are zero

    @property
    def param(self) -> Any:
        """The sharded DTensor parameter the model holds."""
        return self.fsdp_param.sharded_param

    def real(self, padded: Tensor) -> Tensor:
        """The rows of a padded shard-shaped tensor that hold this rank's real shard."""
        return padded.narrow(0, 0, self.rows)


class ShardBinding:
    """FSDP's sharded parameters of one model as the parameters of a :class:`ScapeEngine`.

    Every trainable sharded parameter gets a proxy ``nn.Parameter`` of its padded shard's shape, which the engine
    lays out in its flat buffers; :meth:`attach` then points FSDP at those buffers, so the engine's parameter
    update is what FSDP all-gathers, and FSDP's reduce-scatter output accumulates into the engine's gradient
    buffer. Padding rows (a dimension that does not divide by S) stay exactly zero: zero gradient, zero
    momentum, zero parameter.

    Args:
        module: The sharded model.
    """

    def __init__(self, module: Module) -> None:
        self.entries: list[_Sharded] = []
        self._by_param: dict[int, _Sharded] = {}
        for fp in fsdp_params(module):
            param = fp.sharded_param
            if not param.requires_grad:
                continue
            if fp.fsdp_placement.dim != 0:
                raise ValueError(f"ScapeFSDPStrategy shards parameters on dim 0; got {fp.fsdp_placement}.")
            padded = fp._sharded_param_data.view(fp.padded_sharded_param_size)
            entry = _Sharded(fp, nn.Parameter(padded.detach(), requires_grad=True), int(fp.sharded_size[0]))
            self.entries.append(entry)
            self._by_param[id(param)] = entry
        self._hooks: list[Any] = []
        self.order = [self._by_param[id(p)].proxy for p in module.parameters() if id(p) in self._by_param]

    def proxy_groups(self, adams: AdamS) -> list[dict[str, Any]]:
        """The optimizer's param groups with each sharded parameter replaced by its proxy; every other key reads
        through to the user's group (so LR schedulers keep working)."""
        groups = []
        for i, group in enumerate(adams.param_groups):
            proxies = []
            for p in group["params"]:
                entry = self._by_param.get(id(p))
                if entry is None and p.requires_grad:
                    raise ValueError(
                        f"Param group {i} of the optimizer holds a parameter of shape {tuple(p.shape)} that FSDP does "
                        "not manage. With ScapeFSDPStrategy create the optimizer after model = "
                        "fabric.setup_module(model), from model.parameters()."
                    )
                if entry is not None:
                    proxies.append(entry.proxy)
            groups.append(cast(dict[str, Any], ChainMap({"params": proxies}, group)))
        return groups

    @torch.no_grad()
    def attach(self, engine: ScapeEngine) -> None:
        """Point FSDP's shards and gradients at the engine's buffers, and report FSDP's gradients to the engine."""
        for entry in self.entries:
            fp, proxy = entry.fsdp_param, entry.proxy
            assert proxy.grad is not None  # the engine made it a view of its gradient buffer
            fp._sharded_param_data = proxy.data.view(-1)
            fp.sharded_param._local_tensor = entry.real(proxy.data)
            fp.sharded_param.grad = fp.to_sharded_dtensor(entry.real(proxy.grad))
            self._hooks.append(entry.param.register_post_accumulate_grad_hook(_GradReady(entry, engine)))

    def detach(self) -> None:
        """Remove the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def local_numel(self) -> int:
        """Elements of the trainable parameters this rank holds, padding included."""
        return sum(e.proxy.numel() for e in self.entries)


class _GradReady:
    """FSDP wrote a sharded gradient: make sure it is in the engine's buffer, then tell the engine."""

    def __init__(self, entry: _Sharded, engine: ScapeEngine) -> None:
        self.entry = entry
        self.engine = engine

    @torch.no_grad()
    def __call__(self, param: Tensor) -> None:
        entry = self.entry
        proxy = entry.proxy
        assert proxy.grad is not None
        target = entry.real(proxy.grad)
        grad: Any = param.grad  # a DTensor
        local = grad.to_local() if grad is not None else None
        if local is not None and target.numel() and local.data_ptr() != target.data_ptr():
            # Someone set the model's .grad to None (model.zero_grad()): FSDP wrote a new tensor; adopt it.
            target.copy_(local)
            param.grad = entry.fsdp_param.to_sharded_dtensor(target)
        self.engine.grad_ready(proxy)


def replicate_communicator(mesh: Any, grid: ShardGrid, timeout_s: float) -> Communicator:
    """The engine's collectives: the replicate group of this rank (nothing when there is one group)."""
    if grid.replicas == 1:
        return SoloCommunicator()
    return FaultNamingCommunicator(timeout_s, group=mesh["replicate"].get_group())


def shard_mean(mesh: Any, grid: ShardGrid) -> Callable[[Tensor], Tensor] | None:
    """The mean of a tensor over the shard group, which joins the engines of a group's S shards: the form pilot's
    ``agree`` (:class:`~lightning_scape.planning.pilot.FormPilot`), so that every shard takes the same form at the
    same step. None with one shard per group."""
    if grid.shard_size == 1:
        return None
    group = mesh["shard"].get_group()

    def mean(values: Tensor) -> Tensor:
        dist.all_reduce(values, group=group)
        return values / grid.shard_size

    return mean


def global_clip_norm(engine: ScapeEngine, shard_group: Any, shard_size: int) -> tuple[float, float]:
    """The global L2 norm of the synchronised gradient over all shards, and this shard's.

    The engine knows the norm of its shard (over the replicate group); one scalar all-reduce over the shard group
    adds the S shards' squares.

    Returns:
        ``(global_norm, shard_norm)``.
    """
    shard_norm = engine.global_grad_norm()
    if shard_size == 1:
        return shard_norm, shard_norm
    sq = torch.tensor([shard_norm * shard_norm], dtype=torch.float64, device=engine.buckets[0].params.device)
    dist.all_reduce(sq, group=shard_group)
    return math.sqrt(float(sq.item())), shard_norm


def shard_max_norm(max_norm: float, global_norm: float, shard_norm: float) -> float:
    """The ``max_norm`` to give this shard's engine so that it scales by ``min(1, max_norm / (global + 1e-6))``.

    The engine's coefficient is ``min(1, m / (shard_norm + 1e-6))``, as ``clip_grad_norm_`` computes it.
    """
    return max_norm * (shard_norm + 1e-6) / (global_norm + 1e-6)
