"""Checkpoints of the FSDP form: a folder with one file per rank (its model shard and SCAPE state) and ``meta.pt``.

``<path>/shard-XXXXX.pt`` holds, per key of the saved state, rank XXXXX's local shard of each model (the local
tensors of its sharded parameters, its buffers) and its SCAPE optimizer state (momentum, residual, masks of its
shard). ``<path>/meta.pt``, written by rank 0, holds the layout that wrote it (world size, ``shard_size``) and
everything else the user saved. Loading reads and checks everything on every rank, and the ranks agree on the
outcome (:func:`~lightning_scape.comm.rank_failures.agree`), before anything is loaded: a checkpoint from
another layout is refused with the way to resume it.

A plain, whole-model state dict in one file (``torch.save(model.state_dict(), path)``, a model written by another
strategy) loads into the sharded model with :func:`load_full_state`, what ``fabric.load_raw(path, model)`` does
under Lightning's ``ModelParallelStrategy``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

from lightning_scape.comm.rank_failures import agree, agreed
from lightning_scape.engine.fsdp_binding import ShardGrid
from lightning_scape.runtime.checkpoint_protocol import check_module_state
from lightning_scape.runtime.optimizer import ScapeOptimizer

FORMAT = "scape_fsdp"
VERSION = 1
META_FILE = "meta.pt"


def shard_file(path: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its part of checkpoint ``path``."""
    return path / f"shard-{rank:05d}.pt"


def local_module_state(module: Module) -> dict[str, Tensor]:
    """This rank's part of ``module``'s state dict: local shards of sharded tensors, buffers as they are; cloned."""
    from torch.distributed.tensor import DTensor

    return {
        name: (t.to_local() if isinstance(t, DTensor) else t).detach().clone()
        for name, t in module.state_dict().items()
    }


def save(
    path: Path,
    grid: ShardGrid,
    module_states: Mapping[str, dict[str, Tensor]],
    optimizer_states: Mapping[str, dict[str, Any]],
    metadata: dict[str, Any],
) -> None:
    """Write this rank's file (and, on rank 0, ``meta.pt``) of checkpoint folder ``path``.

    Args:
        path: The checkpoint folder (the same on every rank: broadcast it first).
        grid: The layout.
        module_states: This rank's :func:`local_module_state` of each model, by key.
        optimizer_states: This rank's state of each SCAPE optimizer, by key.
        metadata: Everything else to save (rank 0's values are kept).
    """
    path.mkdir(parents=True, exist_ok=True)
    shard = {"format": FORMAT, "rank": grid.rank, "modules": dict(module_states), "optimizers": dict(optimizer_states)}
    torch.save(shard, shard_file(path, grid.rank))
    if grid.rank == 0:
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "world_size": grid.world_size,
            "shard_size": grid.shard_size,
            "modules": sorted(module_states),
            "optimizers": sorted(optimizer_states),
            "metadata": metadata,
        }
        torch.save(meta, path / META_FILE)


@dataclass
class Checked:
    """A checkpoint read and checked on this rank: rank 0's ``meta.pt`` and this rank's file."""

    meta: dict[str, Any]
    shard: dict[str, Any]


def read_and_check(
    path: Path,
    grid: ShardGrid,
    modules: Mapping[str, Module],
    optimizers: Mapping[str, ScapeOptimizer],
    strict: bool,
) -> Checked:
    """Read this rank's part of checkpoint ``path`` and check that it loads here; every rank agrees first.

    Raises:
        ValueError: On every rank, if any rank's part does not fit (layout, model, SCAPE state); nothing is loaded.
    """
    error: BaseException | None = None
    checked = None
    try:
        checked = _read_and_check(path, grid, modules, optimizers, strict)
    except (ValueError, OSError, RuntimeError, KeyError) as exc:
        error = exc
    agree(error, f"Loading the ScapeFSDPStrategy checkpoint {path}")
    assert checked is not None
    return checked


def _read_and_check(
    path: Path,
    grid: ShardGrid,
    modules: Mapping[str, Module],
    optimizers: Mapping[str, ScapeOptimizer],
    strict: bool,
) -> Checked:
    meta_path = path / META_FILE
    if not meta_path.is_file():
        whole = " A plain, whole-model state dict file loads with fabric.load_raw(path, model)." * path.is_file()
        raise ValueError(
            f"{path} is not a ScapeFSDPStrategy checkpoint (no {META_FILE}); it was written by another strategy. "
            f"Load it with that strategy, or start from its model weights.{whole}"
        )
    meta = torch.load(meta_path, weights_only=False)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(
            f"{meta_path} has format {meta.get('format')!r} v{meta.get('version')}, not {FORMAT} v{VERSION}."
        )
    _check_layout(meta, grid, path)
    shard = torch.load(shard_file(path, grid.rank), weights_only=False)
    missing = [k for k in [*modules, *optimizers] if k not in shard["modules"] and k not in shard["optimizers"]]
    if missing and strict:
        raise ValueError(f"The checkpoint {path} holds no {missing}; it has {meta['modules'] + meta['optimizers']}.")
    for key, module in modules.items():
        if key in shard["modules"]:
            where = f"{path} [{key}]"
            check_module_state(module, shard["modules"][key], strict, where, local_module_state_shapes(module))
    for key, opt in optimizers.items():
        if key in shard["optimizers"]:
            opt.check_state_dict(shard["optimizers"][key])
    return Checked(meta=meta, shard=shard)


def _check_layout(meta: Mapping[str, Any], grid: ShardGrid, path: Path) -> None:
    """Refuse a checkpoint written by another world size or ``shard_size``, with the way to resume it."""
    W, S = meta["world_size"], meta["shard_size"]
    if (grid.world_size, grid.shard_size) == (W, S):
        return
    raise ValueError(
        f"The checkpoint {path} was written by {W} processes in {W // S} groups of shard_size={S}; this run has "
        f"{grid.world_size} processes with shard_size={grid.shard_size}. Each rank's file holds its model shard and "
        "its SCAPE state (momentum, residual, masks) for that layout, so it loads only onto the same one: resume "
        f"with ScapeFSDPStrategy(shard_size={S}) on {W} processes ({W // S} nodes of {S}, for example). Nothing "
        "was loaded."
    )


def local_module_state_shapes(module: Module) -> dict[str, torch.Size]:
    """The shapes :func:`local_module_state` would save."""
    from torch.distributed.tensor import DTensor

    return {name: (t.to_local() if isinstance(t, DTensor) else t).shape for name, t in module.state_dict().items()}


def load(checked: Checked, modules: Mapping[str, Module], optimizers: Mapping[str, ScapeOptimizer]) -> None:
    """Load what :func:`read_and_check` read into the models and optimizers it checked."""
    for key, module in modules.items():
        if key in checked.shard["modules"]:
            load_module(module, checked.shard["modules"][key])
    for key, opt in optimizers.items():
        if key in checked.shard["optimizers"]:
            opt.load_state_dict(checked.shard["optimizers"][key])


@torch.no_grad()
def load_module(module: Module, saved: Mapping[str, Tensor]) -> None:
    """Copy a saved local state into ``module``'s tensors in place (the shards stay views of the engine's buffers)."""
    from torch.distributed.tensor import DTensor

    own = module.state_dict(keep_vars=True)
    for name, value in saved.items():
        if name not in own:
            continue
        target = own[name]
        (target.to_local() if isinstance(target, DTensor) else target).copy_(value)


def load_full_state(path: Path, module: Module, strict: bool = True, weights_only: bool | None = None) -> None:
    """Load a plain, whole-model state dict file into the sharded ``module``, as Lightning's ``ModelParallelStrategy``
    does for ``fabric.load_raw(path, model)``: each rank copies its shard of every tensor in place, so the shards
    stay views of the engine's buffers (set up or not, the next step starts from the loaded weights).

    Every rank reads the file (memory-mapped) and checks it before any rank loads, and the ranks agree on the
    outcome. As Lightning's: with ``strict``, every parameter and persistent buffer of the model must be in the
    file; keys of the file that the model does not have are left alone.

    Args:
        path: The file.
        module: The model set up by the strategy (sharded).
        strict: Refuse a file that lacks a key of the model (``KeyError``); False: those keep their values.
        weights_only: Passed on to ``torch.load``.

    Raises:
        ValueError: ``path`` is not a file (a checkpoint folder loads with ``fabric.load``), or a tensor's shape
            is not the model's.
        KeyError: ``strict``, and the file lacks a key of the model.
    """
    parts: dict[str, Tensor] = {}
    with agreed(f"Loading {path} into the model (fabric.load_raw)"):
        parts = _local_parts(path, module, strict, weights_only)
    load_module(module, parts)


def _local_parts(path: Path, module: Module, strict: bool, weights_only: bool | None) -> dict[str, Tensor]:
    """This rank's part of each tensor of the file that the model holds, checked."""
    if not path.is_file():
        raise ValueError(
            "Failed to load checkpoint directly into the model. The given path must be a single file containing the "
            f"full state dict: {path}. (A ScapeFSDPStrategy checkpoint folder loads with fabric.load(path, state).)"
        )
    full = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    if not isinstance(full, Mapping):
        raise ValueError(
            f"{path} holds a {type(full).__name__}, not a state dict (parameter name -> tensor): save one with "
            "torch.save(model.state_dict(), path)."
        )
    parts = {}
    for name, target in module.state_dict(keep_vars=True).items():
        if name in full:
            parts[name] = _local_part(name, target, full[name])
        elif strict:
            raise KeyError(
                f"The model contains a key '{name}' that does not exist in the loaded checkpoint. To disable strict "
                "loading, set `strict=False`."
            )
    return parts


def _local_part(name: str, target: Tensor, value: Any) -> Tensor:
    """The rows of the whole tensor ``value`` that this rank's shard of ``target`` holds (all of it if unsharded)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(value, Tensor) or value.shape != target.shape:
        found = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"{name}: the file holds {found}, the model {tuple(target.shape)}: it comes from another model "
            "configuration. Nothing was loaded."
        )
    if not isinstance(target, DTensor):
        return value
    mesh = target.device_mesh
    if mesh.ndim != 1 or tuple(target.placements) != (Shard(0),):
        raise ValueError(
            f"{name} is sharded as {target.placements} over a mesh of shape {tuple(mesh.shape)}, not as "
            "ScapeFSDPStrategy shards (Shard(0) inside a group): it was not set up by this strategy."
        )
    # FSDP2 cuts dim 0 as torch.chunk does: rank s holds chunk s, the last ranks possibly an empty one.
    chunks = torch.chunk(value, mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    return chunks[rank] if rank < len(chunks) else value[:0]
