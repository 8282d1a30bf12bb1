"""A short dry run on this machine that measures one rank's compute per step, and SCAPE's own work.

The dense step (forward, backward, clipping, ``torch.optim.AdamW``) and a SCAPE step at each density take
turns on copies of the model, round by round, so that a machine whose load drifts slows all of them alike.
The SCAPE steps run the real engine as rank 0 of W ranks whose collectives complete at once
(:class:`PretendGroup`): the engine's work at that world size (its shard's mask, its slots' update) is
measured without a network. What a SCAPE step adds is the median over rounds of its step minus the dense
step of the same round.

litgpt (an optional dependency) supplies models by config name (:func:`litgpt_model`).
"""

from __future__ import annotations

import difflib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_scape.adams import AdamS
from lightning_scape.comm.base import Done, Pending
from lightning_scape.config import ScapeConfig
from lightning_scape.engine.scape_engine import ScapeEngine
from lightning_scape.planning.predict import StepCompute

Batch = tuple[Tensor, Tensor]
LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]
GroupsOf = Callable[[nn.Module], Any]  # a model's param groups for AdamS (default: one group)
PRECISIONS = ("32-true", "bf16-mixed")


class PretendGroup:
    """Rank 0 of ``world_size`` ranks whose collectives complete at once: every rank is taken to hold this
    rank's tensors (a sum is left as it is, a gather repeats this rank's part). For timing an engine's own
    work, never for training."""

    rank = 0

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def all_reduce_sum(self, tensor: Tensor) -> Pending:
        """Left as it is."""
        return Done()

    def reduce_scatter_sum(self, output: Tensor, input: Tensor) -> Pending:
        """Rank 0's slice of ``input``."""
        output.copy_(input[: output.numel()])
        return Done()

    def all_gather(self, output: Tensor, input: Tensor) -> Pending:
        """``input`` repeated for every rank."""
        output.view(self.world_size, -1).copy_(input.view(1, -1).expand(self.world_size, -1))
        return Done()

    def all_to_all(self, output: Tensor, input: Tensor) -> Pending:
        """Rank 0's slice of ``input`` repeated for every rank."""
        n = output.numel() // self.world_size
        output.view(self.world_size, -1).copy_(input[:n].view(1, -1).expand(self.world_size, -1))
        return Done()


@dataclass
class _Timed:
    """A model and how it steps, with the seconds of each timed round."""

    model: nn.Module
    step: Callable[[Batch], dict[str, float]]
    rounds: list[dict[str, float]]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device, precision: str) -> AbstractContextManager[Any]:
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def _clock(device: torch.device) -> Iterator[float]:
    """Successive readings of the clock, each after the device's queued work is done."""
    while True:
        _sync(device)
        yield time.perf_counter()


def _dense(model: nn.Module, loss_fn: LossFn, device: torch.device, precision: str, clip: float) -> _Timed:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1)

    def step(batch: Batch) -> dict[str, float]:
        clock = _clock(device)
        t0 = next(clock)
        with _autocast(device, precision):
            loss = loss_fn(model, *batch)
        t1 = next(clock)
        loss.backward()
        t2 = next(clock)
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=False)
        t3 = next(clock)
        return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "total": t3 - t0}

    return _Timed(model, step, [])


def _scape(model: nn.Module, loss_fn: LossFn, device: torch.device, precision: str, clip: float,
           config: ScapeConfig, world_size: int, groups: GroupsOf) -> _Timed:  # fmt: skip
    # One dense step builds the momentum the first mask is scored from; every step after it is sparse.
    cfg = config.replace(dense_warmup_steps=1, density_ramp_steps=0)
    opt = AdamS(groups(model), lr=1e-5)
    engine = ScapeEngine(opt, cfg, PretendGroup(world_size), list(model.parameters()))

    def step(batch: Batch) -> dict[str, float]:
        clock = _clock(device)
        t0 = next(clock)
        with _autocast(device, precision):
            loss = loss_fn(model, *batch)
        loss.backward()
        engine.step(max_grad_norm=clip)
        engine.zero_grad()
        engine.current_masks()
        return {"total": next(clock) - t0}

    return _Timed(model, step, [])


def measure_compute(
    make_model: Callable[[], nn.Module],
    make_batch: Callable[[], Batch],
    loss_fn: LossFn,
    world_size: int,
    densities: Sequence[float],
    config: ScapeConfig | None = None,
    steps: int = 5,
    warmup: int = 2,
    precision: str = "32-true",
    max_grad_norm: float = 1.0,
    param_groups: GroupsOf | None = None,
) -> StepCompute:
    """Time one rank's dense step and SCAPE's steps at ``densities`` on this machine.

    Args:
        make_model: A new copy of the model, on the device to measure (one per method is held at once).
        make_batch: One rank's batch ``(inputs, targets)`` on that device.
        loss_fn: ``loss_fn(model, inputs, targets)``, a scalar.
        world_size: W: the SCAPE engine is rank 0 of this many ranks.
        densities: SCAPE's densities.
        config: SCAPE's other settings (default: the package's).
        steps: Timed rounds (the medians are over these).
        warmup: Rounds run first and not timed (allocation, the dense step of SCAPE, caches).
        precision: ``"32-true"`` or ``"bf16-mixed"`` (the forward pass under bf16 autocast).
        max_grad_norm: Clipping, as a training run would.
        param_groups: The model's param groups for SCAPE's AdamS (they decide its buckets); default: one group.

    Returns:
        The medians: forward, backward, the dense optimizer step, and per density what SCAPE adds.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not measured; choose one of {PRECISIONS}.")
    if steps < 1 or warmup < 1:
        raise ValueError(f"steps ({steps}) and warmup ({warmup}) must be >= 1.")
    base = config or ScapeConfig()
    dense_model = make_model()
    device = next(dense_model.parameters()).device
    dense = _dense(dense_model, loss_fn, device, precision, max_grad_norm)
    groups = param_groups or (lambda model: model.parameters())
    runs = {d: _scape(make_model(), loss_fn, device, precision, max_grad_norm, base.replace(density=d), world_size,
                      groups) for d in densities}  # fmt: skip
    timed = [dense, *runs.values()]
    for r in range(warmup + steps):
        batch = make_batch()
        for i in range(len(timed)):  # a rotating order, so no method always runs right after another
            run = timed[(r + i) % len(timed)]
            seconds = run.step(batch)
            if r >= warmup:
                run.rounds.append(seconds)
    med = {k: statistics.median(s[k] for s in dense.rounds) for k in ("forward", "backward", "optimizer")}
    extra = {
        d: max(0.0, statistics.median(s["total"] - t["total"] for s, t in zip(run.rounds, dense.rounds, strict=True)))
        for d, run in runs.items()
    }
    return StepCompute(med["forward"], med["backward"], med["optimizer"], extra)


def litgpt_config(name: str) -> Any:
    """litgpt's ``Config`` of ``name``.

    Raises:
        ValueError: litgpt is not installed, or ``name`` is not one of its configs (with the closest names).
    """
    try:
        from litgpt import Config
        from litgpt.config import name_to_config
    except ImportError as exc:
        raise ValueError(
            f"{name!r} is a litgpt config name, and litgpt is not installed: pip install 'lightning-scape[litgpt]', "
            "or give the parameter count (e.g. 1.2B)."
        ) from exc
    if name not in name_to_config:
        close = difflib.get_close_matches(name, list(name_to_config), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else " (litgpt.config.name_to_config lists them)."
        raise ValueError(f"{name!r} is neither a parameter count (e.g. 1.2B, 160M) nor a litgpt config name{hint}")
    return Config.from_name(name)


def litgpt_model(name: str, device: str | torch.device = "meta", block_size: int | None = None) -> nn.Module:
    """litgpt's GPT of config ``name`` with random weights (on the meta device: shapes only, no memory)."""
    from litgpt import GPT

    config = litgpt_config(name)
    with torch.device(device):
        model = GPT(config)
        if block_size is not None:
            model.max_seq_length = block_size
    return model


def litgpt_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Next-token cross-entropy of a litgpt GPT."""
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def measure_litgpt(
    name: str,
    world_size: int,
    densities: Sequence[float],
    batch_size: int,
    block_size: int,
    config: ScapeConfig | None = None,
    precision: str = "32-true",
    steps: int = 5,
) -> tuple[StepCompute, str]:
    """:func:`measure_compute` on litgpt's ``name`` with random tokens, on CUDA if there is one, else the CPU.

    Returns:
        The compute, and a description of what was measured where.
    """
    cfg = litgpt_config(name)
    block = min(block_size, cfg.block_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device="cpu").manual_seed(0)

    def batch() -> Batch:
        tokens = torch.randint(0, cfg.padded_vocab_size, (batch_size, block + 1), generator=gen).to(device)
        return tokens[:, :-1], tokens[:, 1:]

    compute = measure_compute(
        lambda: litgpt_model(name, device, block), batch, litgpt_loss, world_size, densities, config, steps=steps,
        precision=precision,
    )  # fmt: skip
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    return compute, f"measured: {name}, {batch_size} x {block} tokens, {precision}, on {where}, median of {steps}"
