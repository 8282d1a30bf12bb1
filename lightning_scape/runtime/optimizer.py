"""The optimizer a SCAPE strategy hands back (:class:`ScapeOptimizer`), and the conversion to AdamS.

Lightning and Fabric call ``optimizer.step()``, ``zero_grad()``, ``state_dict()`` and read
``param_groups``; :class:`ScapeOptimizer` answers them with the engine's step, its gradient buffers and
this rank's SCAPE state, while its param groups stay the user's dicts (so LR schedulers keep working).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer

from lightning_scape.adams import AdamS
from lightning_scape.engine import ScapeEngine
from lightning_scape.runtime.local_grads import GRADS_WRITTEN_AFTER_SEND
from lightning_scape.runtime.lr_notices import ConvertedLrNotices

_CONVERTIBLE = (torch.optim.AdamW, torch.optim.Adam)


def to_adams(optimizer: Optimizer) -> AdamS:
    """The user's optimizer as :class:`AdamS`, sharing its param-group dicts (so LR schedulers keep working).

    Args:
        optimizer: An :class:`AdamS`, or a ``torch.optim.AdamW`` / ``torch.optim.Adam`` (converted with the
            same hyperparameters and param groups, said once in the log). Subclasses of AdamW and Adam are
            refused (their own code would never run), and so are subclasses of AdamS that override ``step``.

    Returns:
        The AdamS whose param groups the engine reads.
    """
    if isinstance(optimizer, ScapeOptimizer):
        return optimizer.adams
    _check_type(optimizer)
    if isinstance(optimizer, AdamS):
        return optimizer
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
    rank_zero_info(
        f"lightning_scape: converted {name} to AdamS, which normalises by its momentum instead of a second moment "
        f"(docs/algorithm.md section 2); kept each group's lr, betas, eps and weight_decay ({summary})."
    )
    return adams


def _check_type(optimizer: Optimizer) -> None:
    """Refuse an optimizer that the engine cannot step as its author meant: another kind, or a subclass whose own
    code would never run (the engine runs AdamS's update itself; nothing calls the optimizer's ``step``)."""
    cls = type(optimizer)
    user = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(optimizer, AdamS):
        if _overrides_step(cls):
            raise TypeError(
                f"{user} overrides step(), which SCAPE never calls: the engine runs AdamS's update itself on the "
                "synchronised gradient. Move that code out of step() (into an LR scheduler, a callback or the "
                "training loop), or use lightning_scape.AdamS."
            )
        return
    if cls in _CONVERTIBLE:
        return
    base = next((b for b in _CONVERTIBLE if isinstance(optimizer, b)), None)
    if base is not None:
        hyper = ", ".join(f"{k}={v!r}" for k, v in _adams_defaults(optimizer.defaults).items())
        raise TypeError(
            f"{user} subclasses torch.optim.{base.__name__}: SCAPE would replace it by AdamS, and its own code "
            f"(step() among it) would never run. Create lightning_scape.AdamS(params, {hyper}) with the same "
            "hyperparameters instead, or derive your class from lightning_scape.AdamS without overriding step() "
            "(the SCAPE engine runs AdamS's update itself)."
        )
    raise TypeError(
        f"ScapeStrategy steps the optimizer itself and supports lightning_scape.AdamS, or torch.optim.AdamW "
        f"and torch.optim.Adam (converted to AdamS with the same hyperparameters); got {user}. Return one of these "
        "from configure_optimizers / pass one to fabric.setup."
    )


def _overrides_step(cls: type) -> bool:
    """Whether a subclass of AdamS defines its own ``step``.

    Not ``cls.step is AdamS.step``: torch's ``Optimizer.__init__`` wraps a class's ``step`` in a profiling hook
    and assigns the wrapper to that class, so the comparison would depend on which optimizer was built first.
    """
    adams_step = inspect.unwrap(AdamS.step)
    for klass in cls.__mro__:
        if klass is AdamS:
            return False
        step = vars(klass).get("step")
        if step is not None and inspect.unwrap(step) is not adams_step:
            return True
    return False


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

    Its ``param_groups`` are one list shared with the AdamS and the optimizer the user created (the same list
    and dicts), so LR schedulers on either and code that reads or writes ``param_group["lr"]`` change what the
    engine uses. Like DeepSpeed's optimizer wrappers it exposes the user's optimizer as :attr:`optimizer`:
    Lightning's ``LearningRateMonitor`` names the learning rates after its class (``lr-AdamW``), as under DDP.
    ``step`` runs the engine's step, ``zero_grad`` zeroes the engine's gradient buffers in place, and
    ``state_dict`` is this rank's SCAPE state (every rank saves its own; the strategies do that in their
    checkpoints). A param group added with :meth:`add_param_group`, or parameters unfrozen after set-up, join
    the engine (Lightning's ``BaseFinetuning``).

    Args:
        adams: The AdamS whose param groups hold the hyperparameters.
        engine: The engine that owns the parameters' flat buffers.
        source: The optimizer the user created (AdamW, Adam or the AdamS itself).
    """

    def __init__(self, adams: AdamS, engine: ScapeEngine, source: Optimizer | None = None) -> None:
        self.adams = adams
        self.source = source if source is not None else adams
        if [id(g) for g in self.source.param_groups] == [id(g) for g in adams.param_groups]:
            adams.param_groups = self.source.param_groups  # one list: a group added or replaced is seen by all
        super().__init__(adams.param_groups, adams.defaults)  # the groups stay the AdamS's (see param_groups)
        self.engine = engine
        self._request = _StepRequest()
        self._told_grads_written = False
        # The AdamS the user chose is stepped as chosen; a converted AdamW or Adam is told about its learning rate.
        self._lr_notices = ConvertedLrNotices(type(self.source).__name__, converted=self.source is not adams)

    def tell_no_lr_scheduler(self) -> None:
        """The loop has no learning-rate scheduler (known before the first step): a converted optimizer is told
        once, now, what a constant rate does to it."""
        self._lr_notices.no_scheduler()

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer the user created (AdamW, Adam or the AdamS), whose param groups these are."""
        return self.source

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The param groups: the AdamS's list, which is also the user's optimizer's."""
        return self.adams.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        if hasattr(self, "engine"):  # Optimizer.__init__ resets them; they are the AdamS's already
            self._replace_param_groups(list(groups))

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
        self._lr_notices.before_step(self.param_groups)
        self.engine.step(max_grad_norm=max_norm, clip_value=clip_value)
        if self.engine.grads_written_after_send and not self._told_grads_written:
            self._told_grads_written = True
            rank_zero_warn(GRADS_WRITTEN_AFTER_SEND)
        for opt in {id(self.source): self.source, id(self.adams): self.adams}.values():
            setattr(opt, "_opt_called", True)  # noqa: B010  (LR schedulers check that step ran)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place (they stay views into the engine's buffers; ``set_to_none`` is moot).

        Parameters unfrozen since the last call join the engine first (the Trainer calls this before every
        backward pass that starts a step, and training loops call it between steps on every rank).
        """
        self._join()
        self.engine.zero_grad()

    def request_clip(self, max_norm: float | None = None, clip_value: float | None = None) -> None:
        """Clip this step's synchronised gradient (global L2 norm, or each value) when it is applied."""
        if max_norm is not None:
            self._request.max_norm = float(max_norm)
        if clip_value is not None:
            self._request.clip_value = float(clip_value)

    def owns(self, module: Module) -> bool:
        """Whether ``module``'s parameters are in this optimizer's param groups."""
        ids = {id(p) for g in self.param_groups for p in g["params"]}
        return any(id(p) in ids for p in module.parameters())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as ``torch.optim.Optimizer`` does; its trainable parameters join the engine.

        Lightning's ``BaseFinetuning`` calls this when it unfreezes a backbone. Every rank must add it at the
        same point, between two steps: the new parameters get buckets of their own (after the dense warm-up
        with a mask built at once, a collective; ``docs/lightning.md``).

        Args:
            param_group: ``{"params": [...], ...}``; hyperparameters it does not set are the optimizer's defaults.
        """
        if not hasattr(self, "engine"):  # Optimizer.__init__: the groups are the AdamS's already
            return
        self.adams.add_param_group(param_group)  # AdamS's checks and defaults; appended to the shared list
        if self.source is not self.adams:
            for key, value in self.source.defaults.items():  # the keys a group of the user's optimizer has
                param_group.setdefault(key, value)
        self._join()

    def _replace_param_groups(self, groups: list[dict[str, Any]]) -> None:
        """Adopt ``groups`` as the param groups (``BaseFinetuning`` does this when a fit resumes).

        The parameters the engine holds must stay in the groups they were laid out in; new groups' trainable
        parameters join the engine.
        """
        where = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        for bs in self.engine.buckets:
            moved = [where.get(id(place.param)) for place in bs.layout.places]
            if any(i != bs.layout.group_index for i in moved):
                raise ValueError(
                    f"The new param groups move parameters of param group {bs.layout.group_index} elsewhere "
                    f"({sorted({str(i) for i in moved} - {str(bs.layout.group_index)})}; None: dropped). SCAPE lays "
                    "out each group's parameters once: param groups may be added (optimizer.add_param_group), and "
                    "their hyperparameters changed, but not their parameters."
                )
        for group in groups:
            for opt in (self.adams, self.source):
                for key, value in opt.defaults.items():
                    group.setdefault(key, value)
        self.adams.param_groups = groups
        self.source.param_groups = groups
        self._join()

    def _join(self) -> None:
        """Let parameters that became trainable join the engine, and say so once in the log."""
        joined = self.engine.add_trainable_params()
        if joined:
            phase = "sent dense until the warm-up ends" if self.engine.in_warmup else "sent sparsely from now on"
            rank_zero_info(
                f"lightning_scape: {joined:,} parameters became trainable and joined SCAPE after step "
                f"{self.engine.step_count} ({phase}; {self.engine.numel:,} parameters in "
                f"{len(self.engine.buckets)} buckets now)."
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
        waiting = self.engine.waiting
        if waiting:  # Lightning's BaseFinetuning froze them again: under DDP too they stay frozen unless unfrozen
            rank_zero_info(
                f"lightning_scape: the checkpoint's SCAPE state of {sum(w.waiting_numel() for w in waiting):,} "
                f"parameters (param group {sorted({w.layout.group_index for w in waiting})}) waits for them: they are "
                "frozen now, and continue from it when they become trainable again. (BaseFinetuning freezes them "
                "again when a fit resumes; they train again only if your callback unfreezes them, as under DDP.)"
            )


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Lightning's ``LightningOptimizer`` / Fabric's ``_FabricOptimizer`` wrappers."""
    seen = 0
    while seen < 4 and type(optimizer) is not ScapeOptimizer:
        inner = optimizer.__dict__.get("_optimizer") if hasattr(optimizer, "__dict__") else None
        if inner is None:
            break
        optimizer, seen = inner, seen + 1
    return optimizer


def scape_optimizers(objects: Iterable[Any]) -> Iterator[ScapeOptimizer]:
    """The :class:`ScapeOptimizer` objects among ``objects`` (unwrapping Lightning's optimizer wrappers)."""
    for obj in objects:
        inner = unwrap_optimizer(obj)
        if isinstance(inner, ScapeOptimizer):
            yield inner
