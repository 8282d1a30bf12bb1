"""SCAPE checkpoints: the protocol both strategies follow, and the files it writes and reads.

A SCAPE optimizer's state is per rank (momentum shard, unsent-gradient residual, masks), so a checkpoint is
two things: the main file, written by rank 0, which holds the model (replicated) and for each SCAPE
optimizer a small stub (hyperparameters, world size, configuration, a save id), and
``<checkpoint>.scape/rank-XXXXX.pt``, written by each rank, which holds that rank's full optimizer states.
The save id ties the rank files to their main file. Loading reads and checks everything before anything
is loaded, and all ranks agree on the outcome (:func:`agree`), so no rank goes on alone. On another world
size than the one that wrote the checkpoint, every rank reads all the rank files, one at a time, and
re-shards them into its own state (:func:`load_rank_states`).

The Fabric and the Trainer strategies differ only in where the optimizer states sit in the main file
(Fabric: under the user's keys; the Trainer: in ``optimizer_states``), so both call the same two steps:
:func:`save_scape_checkpoint` and :func:`read_and_check`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.nn import Module

if TYPE_CHECKING:
    from lightning_scape.engine import ScapeEngine
    from lightning_scape.wiring.optimizer import ScapeOptimizer

CHECKPOINT_FORMAT = 1
_STUB_KEY = "scape_checkpoint"
_RANK_KEY = "scape_rank_state"
# What both strategies name the barrier between the rank files and the main file (Lightning ignores the name).
_SAVE_BARRIER = "scape_save_checkpoint"


# ------------------------------------------------------------------------------------------- the protocol


def save_scape_checkpoint(
    io: CheckpointIO,
    path: _PATH,
    full_states: dict[str, dict[str, Any]],
    with_stubs: Callable[[dict[str, dict[str, Any]]], dict[str, Any]],
    *,
    rank: int,
    world_size: int,
    broadcast: Callable[[str], str],
    barrier: Callable[[str], None],
    storage_options: Any = None,
) -> None:
    """Save a checkpoint that holds SCAPE optimizers: every rank writes its rank file, then rank 0 the main file.

    Called on every rank. The ranks share a save id (rank 0's), each writes its full states to its own file
    (:func:`rank_state_path`), and rank 0 writes the main file, with a stub in place of each full state, only
    after a barrier: a main file on disk thus always has all its rank files.

    Args:
        io: The strategy's checkpoint IO; it writes the rank files too.
        path: The main checkpoint file.
        full_states: Per key, this rank's full state of a SCAPE optimizer (``ScapeOptimizer.state_dict()``).
        with_stubs: The main file's contents, given per key of ``full_states`` the stub to put in place of the
            full state (where it sits is the strategy's layout).
        rank: This rank (its global rank).
        world_size: The number of ranks.
        broadcast: The strategy's broadcast (every rank gets rank 0's value).
        barrier: The strategy's barrier; called with a name, which Lightning's barriers ignore.
        storage_options: Passed on to the checkpoint IO.
    """
    save_id = new_save_id(broadcast)
    main = with_stubs({k: make_stub(state, save_id) for k, state in full_states.items()})
    save_rank_states(io, path, rank, world_size, full_states, save_id, storage_options)
    barrier(_SAVE_BARRIER)
    if rank == 0:
        io.save_checkpoint(main, path, storage_options=storage_options)


@dataclass(frozen=True)
class LoadPlan:
    """What a strategy is about to load from a checkpoint, as found in its main file: what gets checked.

    Attributes:
        stubs: Per key, what the main file holds where a SCAPE optimizer's stub should be (None: nothing).
        optimizers: Per key of ``stubs``, the SCAPE optimizer that will load the full state.
        modules: Per key, a module that will load a state from the main file: the module, that state, and
            whether loading it is strict.
        required: Keys the main file must hold (else ``KeyError``).
        name_keys: Whether error messages name the key: Fabric's keys are the user's names, the Trainer's are
            its own.
    """

    stubs: dict[str, Any] = field(default_factory=dict)
    optimizers: dict[str, ScapeOptimizer] = field(default_factory=dict)
    modules: dict[str, tuple[Module, Any, bool]] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    name_keys: bool = False


def read_and_check(
    io: CheckpointIO,
    path: _PATH,
    plan: Callable[[dict[str, Any]], LoadPlan],
    *,
    rank: int,
    world_size: int,
    weights_only: bool | None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Read a checkpoint and this rank's SCAPE state, and check that everything fits; loads nothing.

    Called on every rank. Each reads the main file and its rank file (on another world size: every rank file,
    re-sharded), checks the SCAPE states against their optimizers and the module states against their
    modules, and then all ranks agree (:func:`agree`): if any rank failed, every rank raises, so none loads
    alone.

    Args:
        io: The strategy's checkpoint IO.
        path: The main checkpoint file.
        plan: Given the main file's contents, what the strategy will load from it (may raise: the error is
            agreed on like any other).
        rank: This rank (its global rank).
        world_size: The current number of ranks.
        weights_only: Passed on to the checkpoint IO.

    Returns:
        The main file's contents, and per key of the plan's stubs the full optimizer state to load.
    """
    error: BaseException | None = None
    checkpoint: dict[str, Any] = {}
    full: dict[str, dict[str, Any]] = {}
    try:
        checkpoint, full = _read_and_check(io, path, plan, rank, world_size, weights_only)
    except Exception as exc:
        error = exc
    agree(error, f"Loading checkpoint {os.fspath(path)!r}")
    return checkpoint, full


def _read_and_check(
    io: CheckpointIO,
    path: _PATH,
    plan: Callable[[dict[str, Any]], LoadPlan],
    rank: int,
    world_size: int,
    weights_only: bool | None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """One rank's part of :func:`read_and_check`: raises on the first problem."""
    checkpoint = load_main_checkpoint(io, path, weights_only)
    expected = plan(checkpoint)
    engines = {k: opt.engine for k, opt in expected.optimizers.items()}
    full = load_rank_states(io, path, expected.stubs, rank, world_size, weights_only, engines=engines)
    where = f"Checkpoint {os.fspath(path)!r}"

    def label(key: str) -> str:
        return f"{where}, {key!r}" if expected.name_keys else where

    for k, opt in expected.optimizers.items():
        try:
            opt.check_state_dict(full[k])
        except ValueError as exc:
            raise ValueError(f"{label(k)}: {exc} Nothing was loaded.") from exc
    for k, (module, state, strict) in expected.modules.items():
        check_module_state(module, state, strict, label(k))
    missing = [k for k in expected.required if k not in checkpoint]
    if missing:
        raise KeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the loaded checkpoint. "
            "To disable strict loading, set `strict=False`."
        )
    return checkpoint, full


# ---------------------------------------------------------------------------------------------- the files


def rank_state_dir(path: str | os.PathLike[str]) -> str:
    """The directory beside checkpoint ``path`` that holds the per-rank SCAPE files."""
    p = os.fspath(path)
    if "://" not in p and os.path.islink(p):  # e.g. ModelCheckpoint(save_last="link"): follow to the real file
        p = os.path.realpath(p)
    return p.rstrip("/") + ".scape"


def rank_state_path(path: str | os.PathLike[str], rank: int) -> str:
    """This rank's SCAPE file of checkpoint ``path``."""
    return f"{rank_state_dir(path)}/rank-{rank:05d}.pt"


def is_scape_state(obj: Any) -> bool:
    """Whether ``obj`` is a full :meth:`ScapeOptimizer.state_dict`."""
    return isinstance(obj, dict) and "scape" in obj and "param_groups" in obj


def is_scape_stub(obj: Any) -> bool:
    """Whether ``obj`` is the stub a SCAPE strategy writes into the main checkpoint file."""
    return isinstance(obj, dict) and _STUB_KEY in obj


def new_save_id(broadcast: Callable[[str], str]) -> str:
    """An id shared by all ranks that ties a main checkpoint file to its rank files."""
    return broadcast(uuid.uuid4().hex)


def make_stub(state: dict[str, Any], save_id: str) -> dict[str, Any]:
    """What the main file keeps of a full optimizer state: hyperparameters and where the rest lives."""
    scape = state["scape"]
    return {
        _STUB_KEY: {
            "format": CHECKPOINT_FORMAT,
            "save_id": save_id,
            "world_size": scape["world_size"],
            "config": scape["config"],
            "step_count": scape["step_count"],
            "rank_files": "<checkpoint>.scape/rank-XXXXX.pt",
        },
        "state": {},
        "param_groups": state["param_groups"],
    }


def save_rank_states(
    io: CheckpointIO,
    path: str | os.PathLike[str],
    rank: int,
    world_size: int,
    states: dict[str, dict[str, Any]],
    save_id: str,
    storage_options: Any = None,
) -> None:
    """Write this rank's full optimizer states (keyed by where their stubs sit in the main file)."""
    payload = {
        _RANK_KEY: {
            "format": CHECKPOINT_FORMAT,
            "save_id": save_id,
            "rank": rank,
            "world_size": world_size,
            "optimizers": states,
        }
    }
    io.save_checkpoint(payload, rank_state_path(path, rank), storage_options=storage_options)


def load_main_checkpoint(io: CheckpointIO, path: str | os.PathLike[str], weights_only: bool | None) -> dict[str, Any]:
    """Read a checkpoint file, turning a truncated or corrupt file into an error that says so."""
    try:
        checkpoint = io.load_checkpoint(os.fspath(path), weights_only=weights_only)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as exc:
        if "weights only" not in str(exc).lower():
            raise RuntimeError(
                f"Checkpoint {os.fspath(path)!r} cannot be read ({exc}). It is probably truncated or corrupt (a run "
                "killed while saving?); resume from an earlier checkpoint. Nothing was loaded."
            ) from exc
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = found.group(1) if found else "not a tensor or a plain container"
        raise RuntimeError(
            f"Checkpoint {os.fspath(path)!r} holds a pickled Python object that torch.load(weights_only=True) "
            f"refuses ({what}). Save only tensors and state dicts (an "
            "object with state_dict()/load_state_dict() is stored as its state dict), or, if you trust the file, "
            "load it with weights_only=False. Nothing was loaded."
        ) from exc
    except Exception as exc:
        raise RuntimeError(
            f"Checkpoint {os.fspath(path)!r} cannot be read ({type(exc).__name__}: {exc}). It is probably truncated "
            "or corrupt (a run killed while saving?); resume from an earlier checkpoint. Nothing was loaded."
        ) from exc
    if not isinstance(checkpoint, dict):
        raise RuntimeError(f"Checkpoint {os.fspath(path)!r} holds a {type(checkpoint).__name__}, not a dict.")
    return checkpoint


def load_rank_states(
    io: CheckpointIO,
    path: str | os.PathLike[str],
    stubs: dict[str, Any],
    rank: int,
    world_size: int,
    weights_only: bool | None = None,
    engines: Mapping[str, ScapeEngine] | None = None,
) -> dict[str, dict[str, Any]]:
    """This rank's full optimizer states for the given stubs, checked to belong to the same checkpoint.

    On the world size that wrote the checkpoint, this rank's own file is read. On another one (and with
    ``engines`` given) every saved rank's file is read, one at a time and in rank order, and re-sharded into
    this rank's state (:class:`~lightning_scape.engine.state.StateResharder`); its masks are rebuilt when it is
    loaded.

    Args:
        io: The strategy's checkpoint IO.
        path: The main checkpoint file.
        stubs: Per key, what the main file holds for a SCAPE optimizer (its stub).
        rank: This rank.
        world_size: The current world size.
        weights_only: Passed on to the checkpoint IO.
        engines: Per key, the engine that will load the state: needed to re-shard a checkpoint written by
            another number of ranks (without it such a checkpoint is refused).

    Returns:
        Per key, the full optimizer state to load.
    """
    where = os.fspath(path)
    for key, stub in stubs.items():
        if not is_scape_stub(stub):
            found = "nothing" if stub is None else f"a {type(stub).__name__} without SCAPE state"
            raise ValueError(
                f"Checkpoint {where!r} holds {found} for {key!r}: it was not written by a SCAPE strategy, so it "
                "has no momentum, residual or masks to resume from. To start SCAPE from its weights, load only "
                "the model weights (e.g. model.load_state_dict(...)) and train without ckpt_path."
            )
        meta = stub[_STUB_KEY]
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                f"Checkpoint {where!r} uses SCAPE checkpoint format {meta.get('format')!r}; this "
                f"version reads {CHECKPOINT_FORMAT}."
            )
    if not stubs:
        return {}
    ids = {stub[_STUB_KEY]["save_id"] for stub in stubs.values()}
    saved_world = {stub_world_size(stub) for stub in stubs.values()}
    if len(saved_world) != 1:
        raise ValueError(f"Checkpoint {where!r} has SCAPE optimizers written by {sorted(saved_world)} ranks.")
    (saved_world_size,) = saved_world
    if saved_world_size == world_size:
        return _read_rank_file(io, path, rank, stubs, ids, weights_only)
    if engines is None:
        raise ValueError(
            f"Checkpoint {where!r} was written by {saved_world_size} ranks, but this run has {world_size}, and no "
            "engine was given to re-shard its SCAPE state. Nothing was loaded."
        )
    return _reshard_rank_files(io, path, stubs, ids, saved_world_size, engines, weights_only)


def stub_world_size(stub: Mapping[str, Any]) -> int:
    """The number of ranks that wrote the checkpoint a SCAPE stub belongs to."""
    return int(stub[_STUB_KEY]["world_size"])


def _reshard_rank_files(
    io: CheckpointIO,
    path: str | os.PathLike[str],
    stubs: dict[str, Any],
    ids: set[str],
    saved_world_size: int,
    engines: Mapping[str, ScapeEngine],
    weights_only: bool | None,
) -> dict[str, dict[str, Any]]:
    """Every saved rank's file, one at a time, folded into this rank's re-sharded states."""
    from lightning_scape.engine.state import StateResharder

    missing = sorted(set(stubs) - set(engines))
    if missing:
        raise ValueError(f"No engine to re-shard the SCAPE state of {missing} into. Nothing was loaded.")
    resharders = {k: StateResharder(engines[k], saved_world_size) for k in stubs}
    param_groups: dict[str, Any] = {}
    for old_rank in range(saved_world_size):
        states = _read_rank_file(io, path, old_rank, stubs, ids, weights_only, saved_world_size)
        for k, full in states.items():
            if not is_scape_state(full):
                raise ValueError(
                    f"{rank_state_path(path, old_rank)!r} holds no SCAPE state for {k!r}. Nothing was loaded."
                )
            try:
                resharders[k].add(full["scape"])
            except ValueError as exc:
                raise ValueError(
                    f"{rank_state_path(path, old_rank)!r} cannot be re-sharded from {saved_world_size} to "
                    f"{engines[k].world_size} ranks: {exc} Nothing was loaded."
                ) from exc
            param_groups.setdefault(k, full["param_groups"])
        del states  # keep at most one saved rank's state in memory
    return {k: {"state": {}, "param_groups": param_groups[k], "scape": r.result()} for k, r in resharders.items()}


def _read_rank_file(
    io: CheckpointIO,
    path: str | os.PathLike[str],
    rank: int,
    stubs: dict[str, Any],
    ids: set[str],
    weights_only: bool | None,
    saved_world_size: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Rank ``rank``'s file of checkpoint ``path``, checked to belong to it; its states for the stubs' keys."""
    where = os.fspath(path)
    file = rank_state_path(path, rank)
    of = "" if saved_world_size is None else f" (of {saved_world_size}: re-sharding reads every rank's file)"
    try:
        payload = io.load_checkpoint(file, weights_only=weights_only)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"SCAPE state of rank {rank}{of} is missing: expected {file!r}. A SCAPE checkpoint is the file {where!r} "
            "plus the directory beside it ending in '.scape'; copy both. Nothing was loaded."
        ) from exc
    except Exception as exc:
        raise RuntimeError(
            f"SCAPE state of rank {rank}{of} ({file!r}) cannot be read ({type(exc).__name__}: {exc}). It is "
            "probably truncated or corrupt; resume from an earlier checkpoint. Nothing was loaded."
        ) from exc
    meta = payload.get(_RANK_KEY) if isinstance(payload, dict) else None
    if not isinstance(meta, dict) or meta.get("save_id") not in ids or meta.get("rank") != rank:
        raise ValueError(
            f"{file!r} does not belong to checkpoint {where!r} (it was written by another save or another rank). "
            "Copy the checkpoint file and its '.scape' directory together. Nothing was loaded."
        )
    missing = sorted(set(stubs) - set(meta["optimizers"]))
    if missing:
        raise ValueError(f"{file!r} has no SCAPE state for {missing}. Nothing was loaded.")
    return {k: meta["optimizers"][k] for k in stubs}


def agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank if ``what`` failed on any rank, so that no rank goes on alone (and hangs).

    Args:
        error: This rank's failure, or None.
        what: The operation, for the message of the ranks that did not fail themselves.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [r for r, m in enumerate(messages) if m is not None]
    if failed:
        raise RuntimeError(
            f"{what} failed on rank {', '.join(map(str, failed))}: {messages[failed[0]]}\nThis rank stops too; "
            "nothing was loaded."
        )


def remove_rank_states(io: CheckpointIO, path: str | os.PathLike[str], rank: int, is_global_zero: bool) -> None:
    """Delete this rank's SCAPE file of checkpoint ``path`` (rank 0 also removes the directory)."""
    targets = [rank_state_path(path, rank)] + ([rank_state_dir(path)] if is_global_zero else [])
    for target in targets:
        # Another rank may have removed it first, or it was never written.
        with contextlib.suppress(FileNotFoundError, OSError):
            io.remove_checkpoint(target)


def check_module_state(module: Module, state: Any, strict: bool, where: str) -> None:
    """Raise before anything is loaded when ``state`` does not fit ``module`` (keys or shapes)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{where}: expected a model state dict, found {type(state).__name__}.")
    own = module.state_dict()
    wrong = [
        f"{k}: saved {tuple(v.shape)}, model {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and isinstance(v, Tensor) and v.shape != own[k].shape
    ]
    missing = [k for k in own if k not in state] if strict else []
    unexpected = [k for k in state if k not in own] if strict else []
    if wrong or missing or unexpected:
        raise ValueError(
            f"{where} does not fit the model (shape mismatch {wrong[:5]}, missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}): it comes from another model configuration. Nothing was loaded."
        )
