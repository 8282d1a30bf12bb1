"""SCAPE checkpoints: the protocol both strategies follow, and the files it writes and reads.

A SCAPE optimizer's state is per rank (momentum shard, unsent-gradient residual, masks), so a checkpoint is
two things: the main file, written by rank 0, which holds the model (replicated) and for each SCAPE
optimizer a small stub (hyperparameters, world size, configuration, a save id), and
``<checkpoint>.scape/<save id>-rank-XXXXX.pt``, written by each rank, which holds that rank's full optimizer
states. The save id ties the rank files to their main file, and puts it in their names: every save's files
have names of their own, so loaders that cache remote files by name (``torch.hub`` for ``http://``) never
hand back another checkpoint's file. Files of format 1 (``rank-XXXXX.pt``, no id in the name) are still
read. Loading reads and checks everything before anything is loaded, and all ranks agree on the outcome
(:func:`~lightning_scape.comm.rank_failures.agree`: rank 0 reports a failure, once), so no rank goes on alone.
On another world size than the one that wrote the checkpoint, every rank reads all the rank files, one at a
time, and re-shards them into its own state
(:func:`load_rank_states`).

The Fabric and the Trainer strategies differ in where the optimizer states sit in the main file (Fabric:
under the user's keys; the Trainer: in ``optimizer_states``) and in when their optimizers exist, so both save
with :func:`save_scape_checkpoint`; Fabric loads with :func:`read_and_check`, and the Trainer, which restores
a checkpoint before its set-up as DDP does, reads and checks it in two steps: :func:`read_checkpoint` before
the set-up, :func:`complete_load` once its engine exists.
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

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.nn import Module

from lightning_scape.comm.rank_failures import agree
from lightning_scape.config import ScapeConfig
from lightning_scape.engine.state import check_config, config_changes

if TYPE_CHECKING:
    from lightning_scape.engine import ScapeEngine
    from lightning_scape.runtime.optimizer import ScapeOptimizer

# Format 2: the rank files' names hold the save id (format 1: ``rank-XXXXX.pt``, still read).
CHECKPOINT_FORMAT = 2
_READABLE_FORMATS = (1, 2)
_RANK_FILE = re.compile(r"^(?:(?P<save_id>.+)-)?rank-(?P<rank>\d{5})\.pt$")
_STUB_KEY = "scape_checkpoint"
_RANK_KEY = "scape_rank_state"
# What a torch optimizer that loads a stub says (see make_stub).
STUB_REFUSAL = (
    "This optimizer state is the stub of a lightning_scape SCAPE checkpoint: the momentum and the unsent-gradient "
    "residual are in the per-rank files of <checkpoint>.scape/, which only a SCAPE strategy reads. Resume it with "
    "strategy=ScapeStrategy(...) (or strategy='scape') and the same number of processes or any other (it is "
    "re-sharded); to continue with another strategy, load only the model weights (the Trainer checkpoint's "
    "'state_dict', or your model's key in a fabric.save) and start the optimizer fresh."
)
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
        # The files of an earlier save to the same path: every rank has written its new file (the barrier).
        for stale in _listed_rank_files(path, keep=save_id):
            with contextlib.suppress(Exception):
                io.remove_checkpoint(stale)


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
        config: The configuration the stubs' must match, checked before any rank file is read. Where it differs
            and ``resume_with_new_config`` allows it, the state is re-sharded (carried over, masks rebuilt).
        resume_with_new_config: The strategy's setting of that name.
    """

    stubs: dict[str, Any] = field(default_factory=dict)
    optimizers: dict[str, ScapeOptimizer] = field(default_factory=dict)
    modules: dict[str, tuple[Module, Any, bool]] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    name_keys: bool = False
    config: ScapeConfig | None = None
    resume_with_new_config: bool = False


@dataclass(frozen=True)
class PendingStates:
    """A checkpoint's SCAPE states as :func:`read_checkpoint` found them, for :func:`complete_load` to finish.

    Attributes:
        path: The main checkpoint file.
        stubs: Per key, the stub of a SCAPE optimizer in the main file.
        saved_world_size: The number of ranks that wrote the checkpoint.
        full: Per key, this rank's full state from its own rank file (read when the world size is the same);
            None: the rank files are re-sharded once the engines exist.
        name_keys: Whether error messages name the key (see :class:`LoadPlan`).
        weights_only: Passed on to the checkpoint IO.
    """

    path: str
    stubs: dict[str, Any]
    saved_world_size: int
    full: dict[str, dict[str, Any]] | None
    name_keys: bool = False
    weights_only: bool | None = None


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
        checkpoint, pending, expected = _read(io, path, plan, rank, world_size, weights_only)
        full = _complete(io, pending, expected.optimizers)
    except Exception as exc:
        error = exc
    agree(error, f"Loading checkpoint {os.fspath(path)!r}")
    return checkpoint, full


def read_checkpoint(
    io: CheckpointIO,
    path: _PATH,
    plan: Callable[[dict[str, Any]], LoadPlan],
    *,
    rank: int,
    world_size: int,
    weights_only: bool | None,
) -> tuple[dict[str, Any], PendingStates]:
    """The first half of :func:`read_and_check`, for a strategy whose optimizers do not exist yet; loads nothing.

    Called on every rank. Each reads the main file, checks the stubs (format, configuration against the
    plan's), reads its own rank file when the world size is the one that wrote the checkpoint, and checks the
    module states; then all ranks agree (:func:`agree`). :func:`complete_load` finishes once the engines exist.

    Args:
        io: The strategy's checkpoint IO.
        path: The main checkpoint file.
        plan: Given the main file's contents, what the strategy will load from it (no optimizers yet).
        rank: This rank (its global rank).
        world_size: The current number of ranks.
        weights_only: Passed on to the checkpoint IO.

    Returns:
        The main file's contents, and what :func:`complete_load` needs.
    """
    error: BaseException | None = None
    checkpoint: dict[str, Any] = {}
    pending = PendingStates(os.fspath(path), {}, world_size, {})
    try:
        checkpoint, pending, _ = _read(io, path, plan, rank, world_size, weights_only)
    except Exception as exc:
        error = exc
    agree(error, f"Loading checkpoint {os.fspath(path)!r}")
    return checkpoint, pending


def complete_load(
    io: CheckpointIO, pending: PendingStates, optimizers: dict[str, ScapeOptimizer]
) -> dict[str, dict[str, Any]]:
    """The second half of :func:`read_and_check`: the full states checked against the optimizers that load them.

    Called on every rank, at the same point: on another world size it reads every rank file and re-shards them.
    Then all ranks agree (:func:`agree`).

    Args:
        io: The strategy's checkpoint IO.
        pending: What :func:`read_checkpoint` read.
        optimizers: Per key of ``pending.stubs``, the SCAPE optimizer that will load the state.

    Returns:
        Per key, the full optimizer state to load.
    """
    error: BaseException | None = None
    full: dict[str, dict[str, Any]] = {}
    try:
        full = _complete(io, pending, optimizers)
    except Exception as exc:
        error = exc
    agree(error, f"Loading checkpoint {pending.path!r}")
    return full


def _read(
    io: CheckpointIO,
    path: _PATH,
    plan: Callable[[dict[str, Any]], LoadPlan],
    rank: int,
    world_size: int,
    weights_only: bool | None,
) -> tuple[dict[str, Any], PendingStates, LoadPlan]:
    """One rank's part of :func:`read_checkpoint`: raises on the first problem."""
    checkpoint = load_main_checkpoint(io, path, weights_only)
    expected = plan(checkpoint)
    saved_world_size = check_stubs(path, expected.stubs, expected.config, expected.resume_with_new_config)
    full: dict[str, dict[str, Any]] | None = {}
    if expected.stubs and saved_world_size == world_size and not _reconfigured(expected):
        full = _read_rank_file(io, path, rank, expected.stubs, weights_only)
    elif expected.stubs:
        # Another world size, or other settings (resume_with_new_config): re-sharded once the engines exist
        # (complete_load), which carries the state over and rebuilds the masks.
        full = None
    for k, (module, state, strict) in expected.modules.items():
        check_module_state(module, state, strict, _label(path, k, expected.name_keys))
    missing = [k for k in expected.required if k not in checkpoint]
    if missing:
        raise KeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the loaded checkpoint. "
            "To disable strict loading, set `strict=False`."
        )
    pending = PendingStates(os.fspath(path), expected.stubs, saved_world_size, full, expected.name_keys, weights_only)
    return checkpoint, pending, expected


def _reconfigured(plan: LoadPlan) -> bool:
    """Whether the (checked) stubs were saved with other settings than the plan's (``resume_with_new_config``)."""
    config = plan.config
    return config is not None and any(config_changes(config, s[_STUB_KEY]["config"]) for s in plan.stubs.values())


def _complete(
    io: CheckpointIO, pending: PendingStates, optimizers: dict[str, ScapeOptimizer]
) -> dict[str, dict[str, Any]]:
    """One rank's part of :func:`complete_load`: raises on the first problem."""
    full = pending.full
    if full is None:  # another world size: every rank file, re-sharded into this rank's engines
        engines = {k: opt.engine for k, opt in optimizers.items()}
        full = _reshard_rank_files(io, pending.path, pending.stubs, engines, pending.weights_only)
    for k, opt in optimizers.items():
        try:
            opt.check_state_dict(full[k])
        except ValueError as exc:
            raise ValueError(f"{_label(pending.path, k, pending.name_keys)}: {exc} Nothing was loaded.") from exc
    return full


def _label(path: _PATH, key: str, name_keys: bool) -> str:
    where = f"Checkpoint {os.fspath(path)!r}"
    return f"{where}, {key!r}" if name_keys else where


# ---------------------------------------------------------------------------------------------- the files


def rank_state_dir(path: str | os.PathLike[str]) -> str:
    """The directory beside checkpoint ``path`` that holds the per-rank SCAPE files."""
    p = os.fspath(path)
    if "://" not in p and os.path.islink(p):  # e.g. ModelCheckpoint(save_last="link"): follow to the real file
        p = os.path.realpath(p)
    return p.rstrip("/") + ".scape"


def rank_state_path(path: str | os.PathLike[str], rank: int, save_id: str | None) -> str:
    """Rank ``rank``'s SCAPE file of checkpoint ``path``, written by the save ``save_id`` (None: format 1's name)."""
    name = f"rank-{rank:05d}.pt" if save_id is None else f"{save_id}-rank-{rank:05d}.pt"
    return f"{rank_state_dir(path)}/{name}"


def _listed_rank_files(path: str | os.PathLike[str], rank: int | None = None, keep: str | None = None) -> list[str]:
    """The rank files in the directory beside ``path`` (of ``rank``, or all; not those of the save ``keep``).

    As the checkpoint's filesystem lists them; none where it cannot list (an ``http://`` checkpoint).
    """
    directory = rank_state_dir(path)
    try:
        listed = get_filesystem(directory).ls(directory, detail=False)
    except Exception:  # no directory, or a filesystem that cannot list
        return []
    files = []
    for entry in listed:
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        found = _RANK_FILE.match(name)
        if found and (rank is None or int(found["rank"]) == rank) and (keep is None or found["save_id"] != keep):
            files.append(f"{directory}/{name}")
    return files


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
    first = next((pid for group in state["param_groups"] for pid in group["params"]), None)
    return {
        _STUB_KEY: {
            "format": CHECKPOINT_FORMAT,
            "save_id": save_id,
            "world_size": scape["world_size"],
            "config": scape["config"],
            "step_count": scape["step_count"],
            "rank_files": f"<checkpoint>.scape/{save_id}-rank-XXXXX.pt",
        },
        # A torch optimizer that loads this stub (a resume under strategy="ddp") must not restart from empty
        # moments: Adam / AdamW turn every "step" into a float and fail on this one, with this message in the error.
        "state": {} if first is None else {first: {"step": STUB_REFUSAL.encode()}},
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
    io.save_checkpoint(payload, rank_state_path(path, rank, save_id), storage_options=storage_options)


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
    saved_world_size = check_stubs(path, stubs)
    if not stubs:
        return {}
    if saved_world_size == world_size:
        return _read_rank_file(io, path, rank, stubs, weights_only)
    if engines is None:
        raise ValueError(
            f"Checkpoint {os.fspath(path)!r} was written by {saved_world_size} ranks, but this run has {world_size}, "
            "and no engine was given to re-shard its SCAPE state. Nothing was loaded."
        )
    return _reshard_rank_files(io, path, stubs, engines, weights_only)


def check_stubs(
    path: str | os.PathLike[str],
    stubs: Mapping[str, Any],
    config: ScapeConfig | None = None,
    resume_with_new_config: bool = False,
) -> int:
    """Raise ``ValueError`` unless ``stubs`` are SCAPE stubs of one save in a format this version reads.

    Args:
        path: The main checkpoint file (for the messages).
        stubs: Per key, what the main file holds where a SCAPE optimizer's stub should be.
        config: When given, the configuration the stubs must have been saved with
            (:func:`~lightning_scape.engine.state.check_config`).
        resume_with_new_config: Whether the stubs may have been saved with other settings (not the layout's).

    Returns:
        The number of ranks that wrote the checkpoint (0 without stubs).
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
        if meta.get("format") not in _READABLE_FORMATS:
            raise ValueError(
                f"Checkpoint {where!r} uses SCAPE checkpoint format {meta.get('format')!r}; this version reads "
                f"formats {list(_READABLE_FORMATS)}: resume it with the lightning_scape version that wrote it, or "
                "start a new run from its model weights. Nothing was loaded."
            )
        if config is not None:
            try:
                check_config(config, meta["config"], resume_with_new_config)
            except ValueError as exc:
                raise ValueError(f"Checkpoint {where!r}: {exc} Nothing was loaded.") from exc
    if not stubs:
        return 0
    if len({stub[_STUB_KEY]["save_id"] for stub in stubs.values()}) != 1:
        raise ValueError(f"Checkpoint {where!r} holds SCAPE stubs of different saves. Nothing was loaded.")
    saved_world = {stub_world_size(stub) for stub in stubs.values()}
    if len(saved_world) != 1:
        raise ValueError(f"Checkpoint {where!r} has SCAPE optimizers written by {sorted(saved_world)} ranks.")
    return saved_world.pop()


def stub_world_size(stub: Mapping[str, Any]) -> int:
    """The number of ranks that wrote the checkpoint a SCAPE stub belongs to."""
    return int(stub[_STUB_KEY]["world_size"])


def _rank_file(path: str | os.PathLike[str], rank: int, stubs: Mapping[str, Any]) -> str:
    """Rank ``rank``'s file of the save the (checked) ``stubs`` belong to."""
    meta = next(iter(stubs.values()))[_STUB_KEY]
    return rank_state_path(path, rank, None if meta["format"] == 1 else meta["save_id"])


def _reshard_rank_files(
    io: CheckpointIO,
    path: str | os.PathLike[str],
    stubs: dict[str, Any],
    engines: Mapping[str, ScapeEngine],
    weights_only: bool | None,
) -> dict[str, dict[str, Any]]:
    """Every saved rank's file, one at a time, folded into this rank's re-sharded states."""
    from lightning_scape.engine.state import StateResharder

    missing = sorted(set(stubs) - set(engines))
    if missing:
        raise ValueError(f"No engine to re-shard the SCAPE state of {missing} into. Nothing was loaded.")
    saved_world_size = stub_world_size(next(iter(stubs.values())))
    resharders = {k: StateResharder(engines[k], saved_world_size) for k in stubs}
    param_groups: dict[str, Any] = {}
    for old_rank in range(saved_world_size):
        states = _read_rank_file(io, path, old_rank, stubs, weights_only, saved_world_size)
        file = _rank_file(path, old_rank, stubs)
        for k, full in states.items():
            if not is_scape_state(full):
                raise ValueError(f"{file!r} holds no SCAPE state for {k!r}. Nothing was loaded.")
            try:
                resharders[k].add(full["scape"])
            except ValueError as exc:
                raise ValueError(
                    f"{file!r} cannot be re-sharded from {saved_world_size} to {engines[k].world_size} ranks: "
                    f"{exc} Nothing was loaded."
                ) from exc
            param_groups.setdefault(k, full["param_groups"])
        del states  # keep at most one saved rank's state in memory
    return {k: {"state": {}, "param_groups": param_groups[k], "scape": r.result()} for k, r in resharders.items()}


def _read_rank_file(
    io: CheckpointIO,
    path: str | os.PathLike[str],
    rank: int,
    stubs: dict[str, Any],
    weights_only: bool | None,
    saved_world_size: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Rank ``rank``'s file of checkpoint ``path``, checked to belong to it; its states for the stubs' keys."""
    where = os.fspath(path)
    file = _rank_file(path, rank, stubs)
    of = "" if saved_world_size is None else f" (of {saved_world_size}: re-sharding reads every rank's file)"
    try:
        payload = io.load_checkpoint(file, weights_only=weights_only)
    except FileNotFoundError:
        others = [name.rsplit("/", 1)[-1] for name in _listed_rank_files(path, rank)]
        if others:
            raise ValueError(
                f"SCAPE state of rank {rank}{of} is missing: expected {file!r}; the directory holds {others}, which "
                f"does not belong to checkpoint {where!r} (written by another save). Copy the checkpoint file "
                "and its '.scape' directory together. Nothing was loaded."
            ) from None  # the message names the file
        raise FileNotFoundError(
            f"SCAPE state of rank {rank}{of} is missing: expected {file!r}. A SCAPE checkpoint is the file {where!r} "
            "plus the directory beside it ending in '.scape'; copy both. Nothing was loaded."
        ) from None  # the message names the file
    except Exception as exc:
        raise RuntimeError(
            f"SCAPE state of rank {rank}{of} ({file!r}) cannot be read ({type(exc).__name__}: {exc}). It is "
            "probably truncated or corrupt; resume from an earlier checkpoint. Nothing was loaded."
        ) from exc
    meta = payload.get(_RANK_KEY) if isinstance(payload, dict) else None
    save_id = next(iter(stubs.values()))[_STUB_KEY]["save_id"]
    if not isinstance(meta, dict) or meta.get("save_id") != save_id or meta.get("rank") != rank:
        raise ValueError(
            f"{file!r} does not belong to checkpoint {where!r} (it was written by another save or another rank). "
            "Copy the checkpoint file and its '.scape' directory together. Nothing was loaded."
        )
    missing = sorted(set(stubs) - set(meta["optimizers"]))
    if missing:
        raise ValueError(f"{file!r} has no SCAPE state for {missing}. Nothing was loaded.")
    return {k: meta["optimizers"][k] for k in stubs}


def remove_rank_states(io: CheckpointIO, path: str | os.PathLike[str], rank: int, is_global_zero: bool) -> None:
    """Delete this rank's SCAPE files of checkpoint ``path`` (rank 0 also removes the directory)."""
    for target in _listed_rank_files(path, rank):
        # Another rank may have removed it first (rank 0's removal of the directory), or it was never written.
        with contextlib.suppress(FileNotFoundError, OSError):
            io.remove_checkpoint(target)
    if is_global_zero:
        _remove_rank_state_dir(io, rank_state_dir(path))


def _remove_rank_state_dir(io: CheckpointIO, directory: str, attempts: int = 3) -> None:
    """Remove ``directory`` and what is left in it.

    The other ranks remove their own files meanwhile, with no barrier (Lightning removes a checkpoint from every
    rank at once): a file gone between the recursive removal's listing and its deletion stops that removal
    midway, and the directory stayed behind. So it is tried again while the directory is there.
    """
    fs = get_filesystem(directory)
    for _ in range(attempts):
        with contextlib.suppress(FileNotFoundError, OSError):
            io.remove_checkpoint(directory)
        if not _exists(fs, directory):
            return


def _exists(fs: Any, path: str) -> bool:
    """Whether ``path`` exists; False where the filesystem cannot tell (then nothing more can be done there)."""
    try:
        return bool(fs.exists(path))
    except Exception:
        return False


def check_module_state(
    module: Module, state: Any, strict: bool, where: str, own_shapes: Mapping[str, Any] | None = None
) -> None:
    """Raise before anything is loaded when ``state`` does not fit ``module`` (keys or shapes).

    ``own_shapes``: the shapes the module's state is saved with, where they are not its ``state_dict``'s (this
    rank's shards under FSDP: ``fsdp_checkpoint.local_module_state_shapes``).
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"{where}: expected a model state dict, found {type(state).__name__}.")
    own = own_shapes or {k: getattr(v, "shape", None) for k, v in module.state_dict().items()}
    wrong = [
        f"{k}: saved {tuple(v.shape)}, model {tuple(own[k])}"
        for k, v in state.items()
        if k in own and own[k] is not None and isinstance(v, Tensor) and v.shape != own[k]
    ]
    missing = [k for k in own if k not in state] if strict else []
    unexpected = [k for k in state if k not in own] if strict else []
    if wrong or missing or unexpected:
        raise ValueError(
            f"{where} does not fit the model (shape mismatch {wrong[:5]}, missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}): it comes from another model configuration. Nothing was loaded."
        )
