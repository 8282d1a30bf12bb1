"""The one validated configuration of the SCAPE engine (see ``docs/algorithm.md``)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from lightning_scape.kernels import MAX_CHUNK_SIZE

WireFormat = Literal["full", "int8"]

WIRE_FORMATS: tuple[str, ...] = ("full", "int8")
# A dense step's values and parameter updates in the int8 wire format get one scale per this many coordinates: a
# dense gradient varies more along a bucket than within a chunk row's few sparse values, which share one scale.
INT8_DENSE_GROUP = 256


def int8_dense_group(shard_numel: int) -> int:
    """Coordinates per scale in a dense step of the int8 wire: :data:`INT8_DENSE_GROUP`, or in a tiny bucket whose
    chunks are sized to it (not a power of two), the largest power of two that divides its shard."""
    return math.gcd(INT8_DENSE_GROUP, shard_numel)


# Where SCAPE chooses the form, the density of its first sparse form, the int8 wire's (docs/self_driving.md).
AUTO_START_DENSITY = 0.025
# A warm-up longer than any run: every step dense (a dense form, and where SCAPE chooses, until it has chosen).
DENSE_FOREVER = 10**9
# The density of a form fixed by wire_format alone.
FIXED_FORM_DENSITY = 0.01
# Where SCAPE chooses the form, it measures at least this many dense steps first (a shorter warm-up is lengthened),
# and at most FIRST_DECISION_STEP: a longer warm-up goes on after that first decision on the chosen form's wire.
MIN_MEASURED_STEPS = 5
FIRST_DECISION_STEP = 10


def first_decision_step(dense_warmup_steps: int) -> int:
    """Where SCAPE chooses the form: the step after which it first decides (the warm-up's end, within [5, 10])."""
    return max(MIN_MEASURED_STEPS, min(dense_warmup_steps, FIRST_DECISION_STEP))


# Options of earlier versions: what each is now, and the value at which a saved state still means the same run (None:
# any value; it never changed what a run computed).
REMOVED_OPTIONS: dict[str, tuple[object, str]] = {
    "density_ramp_shape": ("geometric", "the density ramp is always geometric; leave it out"),
    "mask_statistic": ("momentum", "masks always come from the first-moment statistic; leave it out"),
    "mask_refresh_interval": (1, "a new mask is built every step; leave it out"),
    "seed": (None, "nothing in SCAPE draws random numbers; leave it out"),
    "collective_timeout_s": (
        None,
        "pass the strategy's timeout instead (ScapeStrategy(timeout=datetime.timedelta(seconds=...))): it bounds "
        "SCAPE's collectives and Lightning's alike",
    ),
    "resume_with_new_config": (
        None,
        "it belongs to the load: pass it to the strategy (ScapeStrategy(resume_with_new_config=True); "
        "lightning-scape pretrain --resume_with_new_config true)",
    ),
}


def refuse_removed_options(names: Iterable[str], where: str) -> None:
    """Raise ``TypeError`` naming the first of ``names`` that is a :data:`REMOVED_OPTIONS` entry and what replaces it.

    Args:
        names: The option names given.
        where: What they were given to, for the message (``"ScapeConfig"``, ``"ScapeStrategy"``).
    """
    for name in names:
        if name in REMOVED_OPTIONS:
            raise TypeError(f"{where} has no option {name!r} any more: {REMOVED_OPTIONS[name][1]}.")


# A ramp step denser than this is sent dense. A sparse step sends an index beside every value and parameter,
# so the denser it is, the less it saves against dense, until it sends more (docs/algorithm.md section 5 has the
# bytes); and the compact buffers, sized for the densest sparse step, stay this fraction of the gradient.
DENSE_ABOVE = 0.25


@dataclass(frozen=True)
class ScapeConfig:
    """Everything that decides what SCAPE sends and how it updates the parameters.

    Left at None (the default), ``wire_format`` and ``density`` are chosen by SCAPE during the run, from the link
    it measures: after its first 10 steps (fp32 dense), and again whenever the link changes enough to change the
    answer, it takes the form with the shortest predicted time to the same loss, every step dense (fp32 as DDP sends
    it, or on the int8 wire) or sparse steps on the int8 wire after a density ramp (``docs/self_driving.md``). Set
    either to fix the form.

    The strategies take, beside these, ``timeout`` (how long any collective may wait) and
    ``resume_with_new_config`` (a load of a checkpoint saved with other settings): ``docs/lightning.md``.

    Args:
        density: Fraction d of the coordinates sent per step, in (0, 1]; None (the default) lets SCAPE choose
            (see above), or with ``wire_format`` set means 0.01. 0.01 sends 1% of the gradient
            values (the bytes per step against DDP + AdamW: ``docs/algorithm.md`` section 5); 0.1 is the
            safe choice for short runs. Each chunk gets ``max(1, round(density * chunk_size))`` slots, so the effective
            density is ``slots_per_chunk / chunk_size`` (higher in the smaller chunks of a tiny model's
            buckets: see ``chunk_size``).
        chunk_size: Coordinates per mask chunk C, a power of two <= 32768 (indices are int16). Larger
            chunks let top-k pick more freely; smaller ones make the per-chunk slot count coarse
            (C * d should be >= 8 for the statistic to matter). Buckets are padded to a multiple of
            ``world_size * chunk_size``, which the dense warm-up sends; where that padding would exceed 5%
            of a (tiny) model, its most padded buckets get smaller chunks sized to the bucket, each with
            ``max(1, round(density * C))`` slots (a density above ``density`` when that rounds up).
        sharded: True keeps momentum only for the shard this rank owns (ZeRO-1 memory: 4/W bytes per
            parameter) and sends reduce-scatter + parameter all-gather + mask indices. False keeps the
            full momentum on every rank and sends one all-reduce of the values, no parameters or
            indices; use it when memory is plentiful. Where SCAPE chooses the form, its fp32 dense steps are
            DDP's even when sharded (the whole momentum on every rank, the gradient all-reduced during the
            backward pass); it keeps only the shard while another form runs.
        dense_warmup_steps: Optimizer steps sent dense (as DDP + AdamS would) before the density ramp. The
            momentum built there seeds the first mask. At equal bytes, ramp steps buy more quality than
            dense ones (``docs/algorithm.md`` section 7): keep this short and the ramp long. 0 starts sparse
            at once with an all-zero statistic (and no density ramp). With ``wire_format="int8"``, a warm-up as
            long as the run makes every step dense on purpose (see ``wire_format``). Where SCAPE chooses the form,
            the warm-up's steps after its first decision are dense on the chosen form's wire.
        density_ramp_steps: Steps after the dense warm-up over which the density falls from 1 to ``density``
            (the ramp is part of the warm-up: with ``dense_warmup_steps=0`` there is none). Ramp steps denser
            than :data:`DENSE_ABOVE` (1/4) are sent dense; the density falls by the same factor every step, so
            the first ``log(4) / log(1 / density)`` of the ramp is dense (:attr:`dense_steps` counts the dense steps). A
            mask keeps the density of the step it was built for. The ramp is what the sparse phase needs to
            start well; what the default schedule costs in bytes and buys in loss is measured in
            ``docs/algorithm.md`` section 7. Shorten both for runs of less than about 2000 steps if bytes
            matter more than the last percent of loss.
        mask_delay: 1 (the default, the paper's choice) uses a mask built at the end of step t at step t + 1, so
            that its all-gather overlaps a whole forward pass; 0 builds each step's mask from its own gradient
            inside the backward pass and waits for it (the freshest mask, no overlap). Keep 1 unless the mask
            all-gather is free (one process per node, or a fast link) and you want to measure the difference.
            A new mask is built every step, by each rank for the shard it owns, from
            ``|b1*m + (1-b1)*e|`` (the first-moment statistic with its residual folded in).
        exploration: Fraction of each chunk's slots given to round-robin exploration, in [0, 1).
            With k_e exploration slots every coordinate is sent at least once per C / k_e refreshes,
            which bounds the age of any residual. 0.1 costs little; 0 lets rarely-large coordinates
            starve.
        catch_up_cap: How far a coordinate may catch up at once. A coordinate sent after tau steps moves as dense
            AdamS would have over those tau steps (the interval update, ``docs/algorithm.md`` section 4), but
            by at most ``catch_up_cap`` steps' worth at the peak learning rate seen so far (more as the learning
            rate decays): a coordinate frozen for a long interval kept seeing the gradient of where it stopped,
            and moving it all the way at once overshoots. The default is the best cap measured
            (``docs/algorithm.md`` section 7, "The catch-up cap"); lower it if the loss jumps when the sparse
            phase starts, raise it for long runs at a low learning rate.
        wire_format: How gradient values and parameter updates travel; None (the default) lets SCAPE choose
            (see above). ``"full"`` sends them in the parameters' dtype. ``"int8"`` (sharded mode only) sends
            each as an int8 code with one fp32 scale per group (a chunk row's slots in a sparse step, 256
            coordinates in a dense one): a gradient's rounding error
            stays in the residual, so no gradient mass is lost, and a parameter update travels as the change
            from the value every rank holds, which every rank (the owner too) applies identically, so replicas
            stay bitwise equal. Dense steps send about 1/4 of the bytes and sparse steps about 0.42 (the int16
            indices stay). When the network sets the pace, use ``"int8"`` with ``density=0.025``: a sparse step
            then sends what ``"full"`` sends at 0.01, and the extra coordinates ended closer to dense AdamS in
            every run measured (``docs/algorithm.md`` section 7). Where a dense int8 step costs little more than
            the compute (faster links), set ``dense_warmup_steps`` to the run's length instead: every step is then
            AdamS on the whole int8-rounded gradient, with dense AdamS's loss per step; ``lightning-scape estimate
            --wire-format int8`` predicts which of the two pays on a cluster. Keep ``"full"`` for
            ``sharded=False`` and where the dense steps must equal DDP + AdamS's bit for bit.
        bucket_cap_mb: Size of a communication bucket in MiB of parameters. Smaller buckets start
            communicating earlier in the backward pass but cost more launches; 25 is DDP's default.
    """

    density: float | None = None
    chunk_size: int = 4096
    sharded: bool = True
    dense_warmup_steps: int = 30
    density_ramp_steps: int = 400
    mask_delay: int = 1
    exploration: float = 0.1
    catch_up_cap: float = 32.0
    wire_format: WireFormat | None = None
    bucket_cap_mb: float = 25.0

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def chooses_form(self) -> bool:
        """Whether SCAPE chooses the wire format and the density from the link (neither is set)."""
        return self.density is None and self.wire_format is None

    @property
    def sparse_density(self) -> float:
        """d, for the arithmetic of a fixed form (``density`` and ``wire_format`` set, or as the engine resolved
        them: :attr:`ScapeEngine.config <lightning_scape.engine.scape_engine.ScapeEngine.config>`)."""
        if self.density is None and self.wire_format is not None:
            return FIXED_FORM_DENSITY
        if self.density is None:
            raise ValueError(
                "This ScapeConfig leaves the density to SCAPE, which chooses it during the run: read the density in "
                "use from the engine (engine.config), or set density= to fix it."
            )
        return self.density

    def start_form(self) -> ScapeConfig:
        """The fixed form a run starts with: itself, or where SCAPE chooses, fp32 dense steps while it measures
        (the density is the one the sparse form takes first, until it is chosen)."""
        if not self.chooses_form:
            return self.replace(wire_format=self.wire_format or "full", density=self.sparse_density)
        return self.replace(wire_format="full", density=AUTO_START_DENSITY, dense_warmup_steps=DENSE_FOREVER)

    @property
    def slots_per_chunk(self) -> int:
        """k_c: the number of mask slots in every chunk of ``chunk_size`` coordinates."""
        return self.slots_for(self.chunk_size)

    def slots_for(self, chunk_size: int) -> int:
        """The mask slots of a chunk of ``chunk_size`` coordinates after the ramp: ``max(1, round(density * C))``.

        Buckets of a very small model may use chunks smaller than ``chunk_size`` (``docs/algorithm.md``,
        layout); their density is then ``slots_for(C) / C``, higher than ``density`` when ``density * C < 1``.
        """
        return max(1, round(self.sparse_density * chunk_size))

    @property
    def explore_slots_per_chunk(self) -> int:
        """k_e: the round-robin exploration slots among the k_c slots of a chunk."""
        return self.explore_slots(self.slots_per_chunk)

    def explore_slots(self, k: int) -> int:
        """The round-robin exploration slots among ``k`` slots of a chunk."""
        return min(k, round(self.exploration * k))

    def ramp_density(self, step: int) -> float:
        """The density the schedule asks for at step ``step`` (1-based): 1 in the warm-up, then the ramp's."""
        ramp_step = step - self.dense_warmup_steps
        if ramp_step <= 0:
            return 1.0
        d = self.sparse_density
        if self.dense_warmup_steps == 0 or ramp_step >= self.density_ramp_steps:
            return d
        return float(d ** (ramp_step / self.density_ramp_steps))

    @property
    def masks_built_locally(self) -> bool:
        """Whether every rank builds every mask itself, from the replicated momentum (``sharded=False``): no index
        all-gather."""
        return not self.sharded

    @property
    def dense_steps(self) -> int:
        """The steps sent dense: the warm-up, and the ramp's first steps, denser than :data:`DENSE_ABOVE`."""
        step = self.dense_warmup_steps
        while step < self.dense_warmup_steps + self.density_ramp_steps and self.ramp_density(step + 1) > DENSE_ABOVE:
            step += 1
        return step

    def slots_at(self, step: int, chunk_size: int | None = None) -> int:
        """The slots per chunk of the masks built for sparse step ``step`` (1-based, warm-up included).

        ``slots_for(chunk_size)``, except on the density ramp that follows a dense warm-up.

        Args:
            step: The sparse step that first uses the mask.
            chunk_size: The bucket's chunk size C (default: ``self.chunk_size``).
        """
        C = self.chunk_size if chunk_size is None else chunk_size
        return min(C, max(self.slots_for(C), round(min(self.ramp_density(step), DENSE_ABOVE) * C)))

    @property
    def max_slots_per_chunk(self) -> int:
        """The most slots per chunk any step uses (the first step of the ramp): the compact buffers' capacity."""
        return self.max_slots(self.chunk_size)

    def max_slots(self, chunk_size: int) -> int:
        """:attr:`max_slots_per_chunk` for chunks of ``chunk_size`` coordinates; where SCAPE chooses the form, the
        most any form it may choose uses (a sparse step is never denser than :data:`DENSE_ABOVE`)."""
        if self.chooses_form or self.dense_warmup_steps == DENSE_FOREVER:
            return min(chunk_size, max(1, round(DENSE_ABOVE * chunk_size)))
        return self.slots_at(self.dense_steps + 1, chunk_size)

    @property
    def effective_density(self) -> float:
        """The density actually sent: ``slots_per_chunk / chunk_size``."""
        return self.slots_per_chunk / self.chunk_size

    @property
    def every_step_dense_fp32(self) -> bool:
        """Whether every step of the run is dense in fp32 (``dense_warmup_steps`` at :data:`DENSE_FOREVER`): the form
        the engine takes as DDP + AdamS takes it (``docs/self_driving.md``)."""
        return self.wire_format == "full" and self.dense_warmup_steps >= DENSE_FOREVER

    def replace(self, **changes: Any) -> ScapeConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, for checkpoints and logging."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> ScapeConfig:
        """A saved :meth:`to_dict`, of this version or an earlier one: the options this version no longer has
        (:data:`REMOVED_OPTIONS`) are left out (a checkpoint's are judged when it loads:
        :func:`~lightning_scape.engine.state.check_config`)."""
        return cls(**{k: v for k, v in fields.items() if k not in REMOVED_OPTIONS})


def _refusing_removed_options(init: Callable[..., None]) -> Callable[..., None]:
    """``ScapeConfig``'s generated ``__init__``, refusing first, with what to do instead, an option this version no
    longer has (:data:`REMOVED_OPTIONS`); its signature stays the generated one (``__wrapped__``)."""

    @functools.wraps(init)
    def checked(self: ScapeConfig, *args: Any, **kwargs: Any) -> None:
        refuse_removed_options(kwargs, "ScapeConfig")
        init(self, *args, **kwargs)

    return checked


ScapeConfig.__init__ = _refusing_removed_options(ScapeConfig.__init__)  # type: ignore[method-assign]


def _whole_number_from(low: int) -> Callable[[Any], bool]:
    """A rule's test: an integer >= ``low``."""
    return lambda value: isinstance(value, int) and value >= low


def _is_density(value: Any) -> bool:
    """A number in (0, 1], NaN excluded."""
    return isinstance(value, (int, float)) and 0.0 < value <= 1.0 and not math.isnan(value)


def _is_chunk_size(value: Any) -> bool:
    """A power of two the int16 chunk-local indices can address."""
    return isinstance(value, int) and 1 <= value <= MAX_CHUNK_SIZE and value & (value - 1) == 0


# One rule per field, checked in this order; the first broken one is reported as "field=value requirement".
# A test is written so that NaN fails it (``not x > 0`` rather than ``x <= 0``).
_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("density", lambda v: v is None or _is_density(v), "must lie in (0, 1] (or None: SCAPE chooses); 0.01 sends 1%."),
    (
        "chunk_size",
        _is_chunk_size,
        f"must be a power of two between 1 and {MAX_CHUNK_SIZE} (chunk-local indices are int16); 4096 is the default.",
    ),
    ("dense_warmup_steps", _whole_number_from(0), "must be an integer >= 0."),
    ("density_ramp_steps", _whole_number_from(0), "must be an integer >= 0 (0: no ramp)."),
    (
        "mask_delay",
        lambda v: v in (0, 1) and not isinstance(v, float),
        "must be 1 (overlaps the mask all-gather) or 0.",
    ),
    ("exploration", lambda value: 0.0 <= value < 1.0, "must lie in [0, 1); 0.1 is the default."),
    ("catch_up_cap", lambda value: value >= 1.0, "must be >= 1 (steps of movement at once)."),
    ("wire_format", lambda v: v is None or v in WIRE_FORMATS, f"is unknown; choose one of {WIRE_FORMATS} (or None)."),
    ("bucket_cap_mb", lambda value: value > 0.0, "must be > 0."),
)


def _validate(cfg: ScapeConfig) -> None:
    """Check ``cfg`` against :data:`_RULES`.

    Raises:
        ValueError: Naming the first field that breaks its rule, its value and what it must be.
    """
    for name, holds, requirement in _RULES:
        value = getattr(cfg, name)
        if not holds(value):
            raise ValueError(f"Invalid ScapeConfig: {name}={value!r} {requirement}")
    if cfg.wire_format == "int8" and not cfg.sharded:
        raise ValueError(
            "Invalid ScapeConfig: wire_format='int8' needs sharded=True (replicated mode sums its values with an "
            "all-reduce, which int8 codes with per-rank scales cannot take); set sharded=True or wire_format='full'."
        )


class ScapeOptions(TypedDict, total=False):
    """The :class:`ScapeConfig` fields, accepted as keyword arguments by both strategies."""

    density: float | None
    chunk_size: int
    sharded: bool
    dense_warmup_steps: int
    density_ramp_steps: int
    mask_delay: int
    exploration: float
    catch_up_cap: float
    wire_format: WireFormat | None
    bucket_cap_mb: float


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ScapeConfig))


def options_doc() -> str:
    """The ``Args`` section of :class:`ScapeConfig`'s docstring, for the strategies' docstrings.

    Each option's advice is written once, in :class:`ScapeConfig`; the strategies, which take the same
    fields as keyword arguments, show the same text.
    """
    doc = ScapeConfig.__doc__ or ""
    args = doc[doc.index("Args:") + len("Args:") :].rstrip()
    return "\n    SCAPE options (keyword arguments; they override the fields of ``config``):\n" + args + "\n"
