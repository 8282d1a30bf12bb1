"""What the Fabric and Trainer strategies share: everything between Lightning and the one engine.

The two adapters (``lightning_scape/strategy.py`` for Fabric, ``lightning_scape/pytorch/strategy.py`` for
the Trainer) only route Lightning's calls here. This module holds no algorithm (that is
:class:`~lightning_scape.engine.ScapeEngine`); it holds:

* the SCAPE options a strategy accepts, and how they become a :class:`ScapeConfig`;
* the conversion of the user's optimizer to :class:`AdamS` and :class:`ScapeOptimizer`, the optimizer the
  strategies hand back (its ``step`` is the engine's step);
* the communicator: ``torch.distributed`` collectives whose failures name the rank that stopped answering;
* fp16 loss scaling: telling the engine the scale, and the ``GradScaler`` whether the step was skipped;
* per-rank checkpoints: the main file holds the model (replicated) and a small stub per optimizer, and
  ``<checkpoint>.scape/rank-XXXXX.pt`` holds each rank's own SCAPE state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_scape.adams import AdamS
from lightning_scape.comm import Communicator, Pending, ProcessGroupCommunicator, SoloCommunicator
from lightning_scape.config import MaskStatistic, ScapeConfig, UnmaskedUpdate
from lightning_scape.engine import ScapeEngine

if TYPE_CHECKING:
    from torch.amp import GradScaler

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
_STUB_KEY = "scape_checkpoint"
_RANK_KEY = "scape_rank_state"


# ---------------------------------------------------------------------------------------------- options


class ScapeOptions(TypedDict, total=False):
    """The :class:`ScapeConfig` fields, accepted as keyword arguments by both strategies."""

    density: float
    chunk_size: int
    sharded: bool
    dense_warmup_steps: int
    mask_delay: int
    mask_refresh_interval: int
    mask_statistic: MaskStatistic
    exploration: float
    unmasked_update: UnmaskedUpdate
    staleness_correction: bool
    catch_up: bool
    catch_up_cap: float
    sparse_lr_scale: float
    bucket_cap_mb: float
    seed: int
    collective_timeout_s: float


SCAPE_OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(ScapeConfig))

OPTIONS_DOC = """
    SCAPE options (keyword arguments, or a whole ``config=ScapeConfig(...)`` that they override):

    * ``density``: fraction of gradient values sent per step. 0.01 (default) sends 1% (about 67x fewer
      bytes than ZeRO-1); use 0.05-0.1 for short runs or small models, where 1% of the coordinates is
      too few to follow the gradient.
    * ``chunk_size``: coordinates per mask chunk (power of two <= 32768, default 4096). Keep
      ``density * chunk_size >= 8``; tiny models want 64-512 so that padding stays small.
    * ``sharded``: True (default) keeps momentum only for this rank's shard (ZeRO-1 memory) and sends
      values + parameters + mask indices; False keeps full momentum and sends one all-reduce.
    * ``dense_warmup_steps``: dense data-parallel AdamS steps before the first mask (default 100); about
      1% of the run seeds the momentum that the masks are built from.
    * ``mask_delay``: steps between building a mask and using it; 1 (default) hides the mask all-gather
      under the next forward pass, 0 uses the freshest mask but waits for it.
    * ``mask_refresh_interval``: reuse each mask this many steps (default 1); raise only on slow links.
    * ``mask_statistic``: ``"momentum"`` (default, the paper's mask), ``"gradient"`` or ``"random"``.
    * ``exploration``: fraction of each chunk's slots given to round-robin exploration (default 0.1),
      which bounds how long any coordinate waits in the residual.
    * ``unmasked_update``: ``"frozen"`` (default) or ``"momentum"`` (replicated mode only).
    * ``staleness_correction``, ``catch_up``, ``catch_up_cap``: corrections for coordinates sent after a
      long wait (off by default; see docs/algorithm.md before turning them on).
    * ``sparse_lr_scale``: learning-rate multiplier for sparse steps (default 1.0).
    * ``bucket_cap_mb``: communication bucket size in MiB (default 25): smaller buckets start sending
      earlier in the backward pass but cost more launches.
    * ``seed``: seed shared by all ranks for ``mask_statistic="random"``.
    * ``collective_timeout_s``: seconds a rank waits on a SCAPE collective before it stops with an error
      naming the rank that stopped answering (default 1800). Also the default process-group ``timeout``.
"""


def resolve_config(config: ScapeConfig | None, options: Mapping[str, Any]) -> ScapeConfig:
    """``config`` (default: :class:`ScapeConfig`) with ``options`` applied; unknown names raise ``TypeError``.

    Args:
        config: A base configuration, or None for the defaults.
        options: :class:`ScapeConfig` field names and values.

    Returns:
        The validated configuration.
    """
    unknown = sorted(set(options) - set(SCAPE_OPTION_NAMES))
    if unknown:
        raise TypeError(
            f"ScapeStrategy got unexpected argument(s) {unknown}. SCAPE does not wrap the model in "
            "DistributedDataParallel, so DDP options (find_unused_parameters, static_graph, ...) do not apply. "
            f"Valid SCAPE options are {list(SCAPE_OPTION_NAMES)}, or pass config=ScapeConfig(...)."
        )
    base = config if config is not None else ScapeConfig()
    if not isinstance(base, ScapeConfig):
        raise TypeError(f"config must be a lightning_scape.ScapeConfig, got {type(base).__name__}.")
    return base.replace(**options) if options else base


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between two heartbeats of a rank: a thirtieth of the collective timeout, within [0.1, 2]."""
    return min(2.0, max(0.1, timeout_s / 30))


def diagnosis_seconds(timeout_s: float) -> float:
    """How long a rank watches the others' heartbeats after a failed collective: three intervals."""
    return 3 * heartbeat_interval(timeout_s)


def process_group_timeout(timeout: timedelta | None, config: ScapeConfig) -> timedelta:
    """The process-group timeout: the one given, else ``collective_timeout_s`` less the diagnosis time.

    The two should agree: a gloo or NCCL operation that outlives the engine's wait would keep a failed
    process from exiting, and one that fails first decides when the error comes.
    """
    if timeout is not None:
        return timeout
    t = config.collective_timeout_s
    return timedelta(seconds=max(t - diagnosis_seconds(t), 0.5 * t))


# ------------------------------------------------------------------------------------------ optimizers


_CONVERTIBLE = (torch.optim.AdamW, torch.optim.Adam)


def to_adams(optimizer: Optimizer) -> AdamS:
    """The user's optimizer as :class:`AdamS`, sharing its param-group dicts (so LR schedulers keep working).

    Args:
        optimizer: An :class:`AdamS`, or a ``torch.optim.AdamW`` / ``torch.optim.Adam`` (converted with the
            same hyperparameters and param groups, said once in the log).

    Returns:
        The AdamS whose param groups the engine reads.
    """
    if isinstance(optimizer, ScapeOptimizer):
        return optimizer.adams
    if isinstance(optimizer, AdamS):
        return optimizer
    if not isinstance(optimizer, _CONVERTIBLE):
        raise TypeError(
            f"ScapeStrategy steps the optimizer itself and supports lightning_scape.AdamS, or torch.optim.AdamW "
            f"and torch.optim.Adam (converted to AdamS with the same hyperparameters); got "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}. Return one of these from "
            "configure_optimizers / pass one to fabric.setup."
        )
    name = type(optimizer).__name__
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(flag):
                raise ValueError(
                    f"{name} param group {i} sets {flag}=True, which AdamS cannot honour (it keeps no second "
                    f"moment and steps through the SCAPE engine). Create the {name} with {flag}=False, or use "
                    "lightning_scape.AdamS directly."
                )
    if any(optimizer.state.values()):
        raise ValueError(
            f"The {name} already holds optimizer state (it has stepped). Convert it before training: pass a "
            "fresh optimizer to fabric.setup / return it from configure_optimizers, or use AdamS."
        )
    # AdamS shares the dicts: its add_param_group only adds the missing "bias_correction" key.
    adams = AdamS(optimizer.param_groups, **_adams_defaults(optimizer.defaults))
    coupled = type(optimizer) is torch.optim.Adam and not optimizer.defaults.get("decoupled_weight_decay", False)
    if coupled and any(g.get("weight_decay", 0.0) for g in optimizer.param_groups):
        rank_zero_warn(
            "lightning_scape: torch.optim.Adam applies weight decay as an L2 term in the gradient; AdamS "
            "decays the weights directly (like AdamW) with the same weight_decay value."
        )
    summary = ", ".join(
        f"group {i}: lr={g['lr']}, betas={tuple(g['betas'])}, eps={g['eps']}, weight_decay={g['weight_decay']}"
        for i, g in enumerate(adams.param_groups)
    )
    rank_zero_info(f"lightning_scape: converted {name} to AdamS with the same hyperparameters ({summary}).")
    return adams


def _adams_defaults(defaults: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("lr", "betas", "eps", "weight_decay")
    return {k: defaults[k] for k in keys if k in defaults}


@dataclass
class _StepRequest:
    """What the strategy asked for this step (clipping), consumed by :meth:`ScapeOptimizer.step`."""

    max_norm: float | None = None
    clip_value: float | None = None


class ScapeOptimizer(Optimizer):
    """The optimizer a SCAPE strategy hands back: AdamS, stepped by a :class:`ScapeEngine`.

    Its ``param_groups`` are the AdamS groups (the same dicts as the user's optimizer), so LR schedulers and
    code that reads or writes ``param_group["lr"]`` keep working. ``step`` runs the engine's step,
    ``zero_grad`` zeroes the engine's gradient buffers in place, and ``state_dict`` is this rank's SCAPE
    state (every rank saves its own; the strategies do that in their checkpoints).

    Args:
        adams: The AdamS whose param groups hold the hyperparameters.
        engine: The engine that owns the parameters' flat buffers.
        source: The optimizer the user created (AdamW, Adam or the AdamS itself).
    """

    def __init__(self, adams: AdamS, engine: ScapeEngine, source: Optimizer | None = None) -> None:
        super().__init__(adams.param_groups, adams.defaults)
        self.param_groups = adams.param_groups  # the same list and dicts, not copies
        self.adams = adams
        self.engine = engine
        self.source = source if source is not None else adams
        self._request = _StepRequest()
        self._param_ids = frozenset(id(p) for g in self.param_groups for p in g["params"])

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (forward and backward) if given, then the SCAPE step.

        Args:
            closure: Re-evaluates the model and returns the loss.

        Returns:
            The closure's return value.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        req = self._request
        max_norm, clip_value = req.max_norm, req.clip_value
        req.max_norm = req.clip_value = None
        self.engine.step(max_grad_norm=max_norm, clip_value=clip_value)
        for opt in {id(self.source): self.source, id(self.adams): self.adams}.values():
            setattr(opt, "_opt_called", True)  # noqa: B010  (LR schedulers check that step ran)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place (they stay views into the engine's buffers; ``set_to_none`` is moot)."""
        self.engine.zero_grad()

    def request_clip(self, max_norm: float | None = None, clip_value: float | None = None) -> None:
        """Clip this step's synchronised gradient (global L2 norm, or each value) when it is applied."""
        if max_norm is not None:
            self._request.max_norm = float(max_norm)
        if clip_value is not None:
            self._request.clip_value = float(clip_value)

    def owns(self, module: Module) -> bool:
        """Whether ``module``'s trainable parameters are stepped by this optimizer."""
        return any(id(p) in self._param_ids for p in module.parameters())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported after set-up: the engine lays the parameters out once."""
        if not hasattr(self, "engine"):  # Optimizer.__init__ adds the initial groups
            super().add_param_group(param_group)
            return
        raise RuntimeError(
            "SCAPE lays out the parameters once, when the strategy sets the optimizer up; put every param group "
            "in the optimizer before fabric.setup / returning it from configure_optimizers."
        )

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the param groups' hyperparameters and the engine's SCAPE state."""
        groups = []
        index = 0
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(entry)
        return {"state": {}, "param_groups": groups, "scape": self.engine.state_dict()}

    def check_state_dict(self, state: Any) -> None:
        """Raise ``ValueError`` unless ``state`` (from :meth:`state_dict`) can be loaded; changes nothing."""
        if not isinstance(state, dict) or "scape" not in state or "param_groups" not in state:
            raise ValueError(
                "This optimizer state was not written by a SCAPE strategy (no 'scape' entry); it cannot restore "
                "SCAPE's momentum, residual and masks."
            )
        saved = state["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                f"The checkpoint's optimizer has param groups of sizes {[len(g['params']) for g in saved]}, this "
                f"one {[len(g['params']) for g in self.param_groups]}: the model or its param groups changed."
            )
        self.engine.check_state_dict(state["scape"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (hyperparameters and SCAPE state); a state that does not fit changes nothing."""
        self.check_state_dict(state_dict)
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            for k, v in saved.items():
                if k != "params":
                    group[k] = v
        self.engine.load_state_dict(state_dict["scape"])


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Lightning's ``LightningOptimizer`` / Fabric's ``_FabricOptimizer`` wrappers."""
    seen = 0
    while seen < 4 and type(optimizer) is not ScapeOptimizer:
        inner = optimizer.__dict__.get("_optimizer") if hasattr(optimizer, "__dict__") else None
        if inner is None:
            break
        optimizer, seen = inner, seen + 1
    return optimizer


def build_scape_optimizer(
    optimizer: Optimizer,
    config: ScapeConfig,
    module: Module | None,
    check_finite: bool,
) -> ScapeOptimizer:
    """Convert ``optimizer``, build the engine on this process's group, and wrap both.

    Args:
        optimizer: The user's optimizer (AdamS, AdamW or Adam).
        config: The SCAPE configuration.
        module: The model, for the order its gradients arrive in (None: param-group order).
        check_finite: Let the engine skip non-finite steps (fp16 loss scaling).

    Returns:
        The optimizer to hand back to Lightning.
    """
    if isinstance(optimizer, ScapeOptimizer):
        raise ValueError("This optimizer was already set up by a SCAPE strategy; set up the original once.")
    adams = to_adams(optimizer)
    order = list(module.parameters()) if module is not None else None
    # The strategies broadcast rank 0's parameters and buffers at module set-up (broadcast_module_states).
    engine = ScapeEngine(adams, config, make_communicator(config), param_order=order, sync_params=False)
    engine.check_finite = check_finite
    return ScapeOptimizer(adams, engine, source=optimizer)


def broadcast_module_states(module: Module) -> None:
    """Give every rank rank 0's parameters and buffers (what DDP's constructor does), once at set-up."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from torch.distributed.utils import _sync_module_states

    group = dist.group.WORLD
    assert group is not None
    _sync_module_states(module, group, 250 * 1024 * 1024, 0, set(), True)


# --------------------------------------------------------------------------------------- communicator


class _Heartbeat:
    """This process's liveness and collective progress, published in the c10d store by a daemon thread.

    When a collective fails, :meth:`diagnose` reads every rank's entry twice: a rank whose heartbeat does
    not move died or froze; a rank that is alive but has not issued the collective is stuck elsewhere.
    """

    _lock = threading.Lock()
    _current: _Heartbeat | None = None

    def __init__(self, store: Any, rank: int, world_size: int, interval_s: float) -> None:
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self.issued = 0  # SCAPE collectives this process has launched
        self._beats = 0
        self._store = store.clone()
        self._store.set_timeout(timedelta(seconds=max(2.0, 4 * interval_s)))
        self._thread = threading.Thread(target=self._run, name="scape-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def for_process(cls, timeout_s: float) -> _Heartbeat | None:
        """The process-wide heartbeat (started on first use); None when the store is unavailable."""
        rank, world = dist.get_rank(), dist.get_world_size()
        with cls._lock:
            hb = cls._current
            if hb is None or (hb.rank, hb.world_size) != (rank, world):
                try:
                    store = dist.distributed_c10d._get_default_store()
                    hb = cls(store, rank, world, interval_s=heartbeat_interval(timeout_s))
                except Exception as exc:  # no store, no diagnosis: the collective errors still name themselves
                    log.debug("lightning_scape: no heartbeat (%s)", exc)
                    return None
                cls._current = hb
            return hb

    @staticmethod
    def _key(rank: int) -> str:
        return f"lightning_scape/heartbeat/{rank}"

    def _run(self) -> None:
        while True:
            self._beats += 1
            try:
                self._store.set(self._key(self.rank), f"{self._beats} {self.issued}")
            except Exception:  # the store went away (rank 0 died); the failing collective will say so
                return
            time.sleep(self.interval_s)

    def _read(self, store: Any) -> dict[int, tuple[int, int] | None]:
        out: dict[int, tuple[int, int] | None] = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = self._key(r)
            if not store.check([key]):
                out[r] = None
                continue
            beats, issued = store.get(key).decode().split()
            out[r] = (int(beats), int(issued))
        return out

    @property
    def diagnosis_s(self) -> float:
        """How long :meth:`diagnose` watches the heartbeats."""
        return 3 * self.interval_s

    def diagnose(self, seq: int) -> str:
        """Which ranks stopped answering before collective number ``seq`` of this rank, in words."""
        wait = self.diagnosis_s
        try:
            store = self._store.clone()
            store.set_timeout(timedelta(seconds=max(2.0, 4 * self.interval_s)))
            first = self._read(store)
            time.sleep(wait)
            second = self._read(store)
        except Exception as exc:
            return (
                f"the rendezvous store is unreachable ({type(exc).__name__}), so the process hosting it (rank 0, "
                "or the launcher) has probably died."
            )
        stopped = [r for r in second if second[r] is None or first[r] == second[r]]
        behind = [r for r in second if r not in stopped and (s := second[r]) is not None and s[1] < seq]
        parts = []
        if stopped:
            parts.append(
                f"rank {', '.join(map(str, stopped))} stopped answering: no heartbeat for {wait:.1f}s (the process "
                "died, was killed, or is frozen)"
            )
        if behind:
            where = ", ".join(f"rank {r} at #{s[1]}" for r in behind if (s := second[r]) is not None)
            parts.append(
                f"{where} never issued this collective (#{seq} here): alive but stuck elsewhere or running "
                "different code"
            )
        if not parts:
            return "every rank is alive and issued this collective: the transport itself failed (network?)."
        return "; ".join(parts) + "."


class _NamedPending:
    def __init__(self, inner: Pending, seq: int, heartbeat: _Heartbeat | None) -> None:
        self._inner = inner
        self._seq = seq
        self._heartbeat = heartbeat

    def wait(self) -> None:
        try:
            self._inner.wait()
        except RuntimeError as exc:
            if self._heartbeat is None:
                raise
            raise RuntimeError(f"{exc}\nSCAPE diagnosis: {self._heartbeat.diagnose(self._seq)}") from exc


class FaultNamingCommunicator:
    """The default process group's collectives, with failures that name the rank that stopped answering.

    A wait gives up after ``timeout_s`` minus the diagnosis time (three heartbeat intervals, a tenth of
    the timeout), so the error, diagnosis included, comes within ``timeout_s``.

    Args:
        timeout_s: The engine's collective timeout (``collective_timeout_s``).
    """

    def __init__(self, timeout_s: float) -> None:
        self.heartbeat = _Heartbeat.for_process(timeout_s)
        diagnosis_s = 0.0 if self.heartbeat is None else self.heartbeat.diagnosis_s
        self.inner = ProcessGroupCommunicator(None, timeout_s=max(timeout_s - diagnosis_s, 0.5 * timeout_s))
        self.rank = self.inner.rank
        self.world_size = self.inner.world_size

    def _track(self, launch: Callable[[], Pending]) -> Pending:
        hb = self.heartbeat
        seq = 0
        if hb is not None:
            hb.issued += 1
            seq = hb.issued
        return _NamedPending(launch(), seq, hb)

    def all_reduce_sum(self, tensor: Tensor) -> Pending:
        """Async all-reduce (sum), in place."""
        return self._track(lambda: self.inner.all_reduce_sum(tensor))

    def reduce_scatter_sum(self, output: Tensor, input: Tensor) -> Pending:
        """Async reduce-scatter (sum)."""
        return self._track(lambda: self.inner.reduce_scatter_sum(output, input))

    def all_gather(self, output: Tensor, input: Tensor) -> Pending:
        """Async all-gather."""
        return self._track(lambda: self.inner.all_gather(output, input))


def make_communicator(config: ScapeConfig) -> Communicator:
    """This process's collectives: nothing for one process, else the default group with named failures."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return SoloCommunicator()
    return FaultNamingCommunicator(config.collective_timeout_s)


# --------------------------------------------------------------------------------- fp16 loss scaling


def grad_scaler_of(precision: Any) -> GradScaler | None:
    """The precision plugin's enabled ``GradScaler`` (fp16 mixed precision), if any."""
    scaler = getattr(precision, "scaler", None)
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return None
    return scaler


def set_grad_scale(optimizers: Iterable[ScapeOptimizer], scaler: GradScaler | None) -> None:
    """Tell the engines the loss scale of the coming backward pass (they divide it out in the hooks)."""
    scale = None if scaler is None else float(scaler.get_scale())
    for opt in optimizers:
        opt.engine.grad_scale = scale


class _FoundInf:
    """A stand-in "optimizer" whose one gradient tells ``GradScaler.unscale_`` whether the step was skipped."""

    def __init__(self, skipped: bool, device: torch.device) -> None:
        p = torch.zeros(1, device=device)
        p.grad = torch.full((1,), float("inf") if skipped else 0.0, device=device)
        self.param_groups = [{"params": [p]}]


def report_step_to_scaler(scaler: GradScaler, optimizer: ScapeOptimizer) -> None:
    """Update ``scaler`` as if it had stepped ``optimizer``: back off when the engine skipped the step.

    The engine already unscaled the gradients and agreed across ranks on skipping; the scaler's own
    ``unscale_``/``step`` would touch gradients that were sent already, so it only sees the verdict.
    """
    device = optimizer.engine.buckets[0].params.device
    scaler.unscale_(_FoundInf(optimizer.engine.last_step_skipped, device))  # type: ignore[arg-type,unused-ignore]
    scaler.update()


# ------------------------------------------------------------------------------------- checkpoints


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
) -> dict[str, dict[str, Any]]:
    """This rank's full optimizer states for the given stubs, checked to belong to the same checkpoint.

    Args:
        io: The strategy's checkpoint IO.
        path: The main checkpoint file.
        stubs: Per key, what the main file holds for a SCAPE optimizer (its stub).
        rank: This rank.
        world_size: The current world size.
        weights_only: Passed on to the checkpoint IO.

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
            raise ValueError(f"Checkpoint {where!r} uses SCAPE checkpoint format {meta.get('format')!r}; this "
                             f"version reads {CHECKPOINT_FORMAT}.")
        if meta["world_size"] != world_size:
            raise ValueError(
                f"Checkpoint {where!r} was written by {meta['world_size']} ranks, but this run has {world_size}. "
                "SCAPE's state is per rank (momentum shards, each rank's unsent-gradient residual) and is not "
                f"re-sharded: resume with {meta['world_size']} processes in total (devices x num_nodes). "
                "Nothing was loaded."
            )
    if not stubs:
        return {}
    ids = {stub[_STUB_KEY]["save_id"] for stub in stubs.values()}
    file = rank_state_path(path, rank)
    try:
        payload = io.load_checkpoint(file, weights_only=weights_only)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"SCAPE state of rank {rank} is missing: expected {file!r}. A SCAPE checkpoint is the file {where!r} plus "
            "the directory beside it ending in '.scape'; copy both. Nothing was loaded."
        ) from exc
    except Exception as exc:
        raise RuntimeError(
            f"SCAPE state of rank {rank} ({file!r}) cannot be read ({type(exc).__name__}: {exc}). It is probably "
            "truncated or corrupt; resume from an earlier checkpoint. Nothing was loaded."
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


def scape_optimizers(objects: Iterable[Any]) -> Iterator[ScapeOptimizer]:
    """The :class:`ScapeOptimizer` objects among ``objects`` (unwrapping Lightning's optimizer wrappers)."""
    for obj in objects:
        inner = unwrap_optimizer(obj)
        if isinstance(inner, ScapeOptimizer):
            yield inner


# ----------------------------------------------------------------------------------------- registry


def register(registry: Any, name: str, cls: type, description: str, **init_params: Any) -> None:
    """Register ``cls`` under ``name`` unless this very class is there already (spawned workers import again)."""
    entry = dict.get(registry, name)  # the registry's own get() would instantiate the strategy
    if entry is not None and entry.get("strategy") is cls and entry.get("init_params") == init_params:
        return
    registry.register(name, cls, description=description, override=True, **init_params)
