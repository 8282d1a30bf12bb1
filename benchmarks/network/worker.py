"""One rank of the network benchmark: every method's own model, trained one step at a time in turn.

Started by ``benchmarks.network.run`` inside the rank's namespace with torchrun-style environment
variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``) and
``python -m benchmarks.network.worker SPEC.json``. All methods live in this one process: at every step
each of them takes one optimizer step on the same batch, in an order that rotates from step to step,
with a barrier before each (outside the clock). Machine noise, which on a shared 2-core machine is
large, therefore hits every method alike; medians are taken over steps.

With ``WorkerSpec.eval_every`` > 0 (the time-to-loss mode, ``benchmarks.network.time_to_loss``) every
method is also evaluated on the same fixed validation batches before the first step, every
``eval_every`` steps and after the last, in the same round, outside the clock.

Per method and step the worker records: the loss; the step time (forward, backward, optimizer step and,
for SCAPE, the wait for the next mask's all-gather, which in a run of one method alone would overlap
the next forward pass and here must not overlap another method's step); the bytes the package's
``ByteCounters`` count (SCAPE: the engine's own; DDP: its hooks' ``torch.distributed.all_reduce`` calls,
counted with the same ring formula); the rank's interface counters (``tx_bytes``/``rx_bytes`` under
``/sys/class/net``, which ``ip netns exec`` shows for the namespace, read before the step and after a
barrier that follows it); and the time from the last gradient being ready to the return of ``backward()``
(DDP waits for its buckets there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_scape import AdamS, FormPilot, ProcessGroupCommunicator, ScapeConfig, ScapeEngine
from lightning_scape.comm import ByteCounters, Traffic, all_reduce_bytes, release_process_groups
from lightning_scape.engine import fsdp_binding
from lightning_scape.examples.workloads import (
    build_model,
    corpus_tokens,
    cosine_lr,
    lm_loss,
    sample_batch,
    validation_batch_losses,
    weight_decay_groups,
)
from lightning_scape.runtime import fsdp

# The model is one of lightning_scape.examples.workloads.MODEL_PRESETS (WorkerSpec.model names it). "base" is what the
# published W = 2 numbers use: on this 2-core VM one rank's step on 4 x 128 tokens takes 0.40-0.43 s
# (compute-only, docs/benchmarks.md), while DDP's fp32 all-reduce of its 4.88M gradients (19.5 MB) needs
# 0.17 s of wire at 1 Gbit/s: communication is 0.4 of the compute there, and 4 times it at 100 Mbit/s.
# "small" (0.86M, the README demo's model) is the W = 4 one, "tiny" (0.13M) the smoke test's.

COMPUTE_ONLY = "compute_only"
DDP_METHODS = ("ddp_adamw", "ddp_adams", "ddp_bf16", "ddp_powersgd")
SCAPE_METHODS = (
    "scape_sharded_d0.1",
    "scape_sharded_d0.01",
    "scape_replicated_d0.1",
    "scape_replicated_d0.01",
    "scape_gradient_d0.01",
)
ALL_METHODS: tuple[str, ...] = (COMPUTE_ONLY, *DDP_METHODS, *SCAPE_METHODS)
# Not part of "all". It measured SCAPE with an all-to-all reduce-scatter when the package still used gloo's own
# (2x the formula on the wire, docs/benchmarks.md finding 1). The package's ProcessGroupCommunicator now does
# exactly that all-to-all on gloo, so this is scape_sharded_d0.01 under its old name, kept so that the
# documented commands still run.
A2A_METHOD = "scape_sharded_d0.01_a2a"
# The time-to-loss mode's SCAPE methods: ScapeConfig(density=0.01) with only the density (and the statistic) stated, so
# that the dense warm-up, density ramp and update rule are whatever the package's defaults are when the run
# starts (they are recorded with every run). The methods above pin dense_warmup_steps to the harness's warm-up.
AUTO_METHOD = "scape_auto"
FIXED_DENSITY = 0.01
TTL_SCAPE_METHODS: tuple[str, ...] = (
    # The package's defaults: the form (dense, the int8 wire, sparse) chosen during the run from the measured link.
    AUTO_METHOD,
    "scape_default_d0.01",
    "scape_default_d0.1",
    "scape_default_gradient_d0.01",
    "scape_default_int8_d0.01",
    "scape_default_int8_d0.025",
    # The int8 wire with every step dense (the warm-up never ends): DDP + AdamS's steps at a quarter of its bytes.
    "scape_int8_dense",
)
TTL_METHODS: tuple[str, ...] = (*DDP_METHODS, *TTL_SCAPE_METHODS)
# Models sharded inside each host (WorkerSpec.shard_size ranks, FSDP2) and replicated across hosts: FSDP's native
# HSDP (dense all-reduce of each shard across hosts) and ScapeFSDPStrategy's wiring (SCAPE across hosts).
FSDP_METHODS: tuple[str, ...] = ("hsdp_adamw", "scape_fsdp_d0.01", "scape_fsdp_default_d0.01")
EXTRA_METHODS: tuple[str, ...] = (A2A_METHOD, *TTL_SCAPE_METHODS, *FSDP_METHODS)
# Methods whose bytes no ByteCounters sees (FSDP's own collectives): only the interface counters measure them.
UNCOUNTED_METHODS: tuple[str, ...] = ("hsdp_adamw",)
METHOD_LABELS: dict[str, str] = {
    COMPUTE_ONLY: "compute only (W=1, AdamW)",
    "ddp_adamw": "DDP + AdamW",
    "ddp_adams": "DDP + AdamS",
    "ddp_bf16": "DDP bf16 hook + AdamW",
    "ddp_powersgd": "DDP PowerSGD r=4 + AdamW",
    "scape_sharded_d0.1": "SCAPE sharded d=0.1",
    "scape_sharded_d0.01": "SCAPE sharded d=0.01",
    "scape_replicated_d0.1": "SCAPE replicated d=0.1",
    "scape_replicated_d0.01": "SCAPE replicated d=0.01",
    "scape_gradient_d0.01": "SCAPE gradient-stat d=0.01",
    A2A_METHOD: "SCAPE sharded d=0.01, all-to-all reduce-scatter",
    "scape_default_d0.01": "SCAPE defaults (d=0.01)",
    "scape_default_d0.1": "SCAPE defaults, d=0.1",
    "scape_default_gradient_d0.01": "SCAPE defaults, gradient statistic",
    "scape_default_int8_d0.01": "SCAPE defaults, int8 wire",
    "scape_default_int8_d0.025": "SCAPE defaults, int8 wire, d=0.025",
    "scape_int8_dense": "SCAPE int8 wire, every step dense",
    AUTO_METHOD: "SCAPE defaults (form chosen from the link)",
    "hsdp_adamw": "native HSDP + AdamW",
    "scape_fsdp_d0.01": "ScapeFSDPStrategy d=0.01",
    "scape_fsdp_default_d0.01": "ScapeFSDPStrategy defaults (d=0.01)",
}
# WorkerSpec.schedule: the network benchmark's "warmup_cosine_floor" (linear warm-up, cosine to 10% of the
# peak: lr_at) or workloads.cosine_lr, "cosine" (ramp times a cosine to 0 at the last step: the quality
# benchmark's, and the time-to-loss mode's).
SCHEDULES: tuple[str, ...] = ("warmup_cosine_floor", "cosine")
POWERSGD_RANK = 4
# One bucket cap for DDP and SCAPE (SCAPE's default, DDP's nominal default). Passed to DDP explicitly, which
# also drops DDP's extra 1 MiB first bucket: with two buckets, PowerSGD's per-bucket callback chains issue
# their all-reduces in an order that differs between ranks, and gloo then fails with "Received data size
# doesn't match expected size" (seen at 100 Mbit/s after about 30 steps). Every model here fits in one.
BUCKET_CAP_MB = 25.0


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank runs (written to JSON by ``harness.launch_workers``)."""

    methods: list[str]
    steps: int
    warmup: int
    model: str
    batch_size: int
    block_size: int
    lr: float
    chunk_size: int
    max_bytes: int
    out_dir: str
    ifname: str
    timeout_s: float = 600.0
    max_grad_norm: float = 1.0
    seed: int = 0
    schedule: str = "warmup_cosine_floor"
    eval_every: int = 0  # 0: no validation (the step-time mode)
    eval_batches: int = 8  # batches of 16 windows of workloads.validation_batch_losses
    corpus: str = "stdlib"
    scape_overrides: dict[str, Any] = field(default_factory=dict)  # ScapeConfig fields set on every TTL SCAPE method
    # Step budgets of single methods, each over its own learning-rate cosine (the others train ``steps``): a method
    # with cheaper steps may take more of them in the same wall-clock, as a user on a slow network would.
    method_steps: dict[str, int] = field(default_factory=dict)
    shard_size: int = 1  # ranks per host: the FSDP methods shard the model over them

    @classmethod
    def for_host(
        cls, args: argparse.Namespace, methods: list[str], out_dir: str, ifname: str, **fields: Any
    ) -> WorkerSpec:
        """One rank's spec from a benchmark's command line (``run`` or ``time_to_loss``).

        Args:
            args: The parsed command line: its ``steps``, ``model``, ``batch_size``, ``block_size``, ``lr``,
                ``chunk_size``, ``max_bytes`` and ``timeout_s`` are taken as they are.
            methods: The methods to train.
            out_dir: The profile's folder.
            ifname: The rank's network interface.
            **fields: Every other field (``warmup`` at least), and any of the above set otherwise.
        """
        shared = {
            "steps": args.steps,
            "model": args.model,
            "batch_size": args.batch_size,
            "block_size": args.block_size,
            "lr": args.lr,
            "chunk_size": args.chunk_size,
            "max_bytes": args.max_bytes,
            "timeout_s": args.timeout_s,
        }
        return cls(**{"methods": methods, **shared, "out_dir": out_dir, "ifname": ifname, **fields})

    def steps_of(self, method: str) -> int:
        """The step budget of ``method``: its entry of ``method_steps``, else ``steps``."""
        return self.method_steps.get(method, self.steps)


@dataclass
class MethodRecord:
    """Per-step measurements of one method on this rank."""

    loss: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    fwd_bwd_s: list[float] = field(default_factory=list)
    bwd_tail_s: list[float] = field(default_factory=list)
    opt_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    sent_by_kind: list[dict[Traffic, int]] = field(default_factory=list)
    tx: list[int] = field(default_factory=list)
    rx: list[int] = field(default_factory=list)
    val_step: list[int] = field(default_factory=list)  # steps done when evaluated (0: before the first)
    val_loss: list[float] = field(default_factory=list)  # mean over the fixed validation batches
    eval_s: list[float] = field(default_factory=list)  # this rank's evaluation time (outside the clock)


def lr_at(step: int, spec: WorkerSpec, steps: int | None = None) -> float:
    """The learning rate of step ``step`` (from 0) of a ``steps``-step run (default ``spec.steps``).

    ``"warmup_cosine_floor"``: linear warm-up over ``warmup`` steps, then cosine to 10% of the peak.
    ``"cosine"``: :func:`lightning_scape.examples.workloads.cosine_lr` (ramp over ``warmup`` steps times a cosine from
    the peak to 0 at ``steps``), the quality benchmark's schedule.
    """
    steps = spec.steps if steps is None else steps
    if spec.schedule == "cosine":
        return cosine_lr(step, steps, spec.lr, max(1, spec.warmup))
    if spec.schedule != "warmup_cosine_floor":
        raise ValueError(f"unknown schedule {spec.schedule!r}; choose one of {SCHEDULES}.")
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    frac = (step - spec.warmup) / max(1, steps - spec.warmup)
    return spec.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def powersgd_formula_bytes(model: nn.Module, world_size: int, rank: int = POWERSGD_RANK) -> int:
    """Ring bytes per rank per step of PowerSGD after its warm-up (ring formulas: ``docs/algorithm.md`` section 5).

    PowerSGD views each gradient as an ``n x m`` matrix (``n`` = first dimension) and compresses it when
    ``(n + m) r * min_compression_rate < n m`` (rate 2, the default); the rest travel uncompressed. It
    all-reduces the uncompressed tensors, then P (``n r`` per matrix), then Q (``m r``), all in fp32.
    """
    values = 0
    for p in model.parameters():
        if p.dim() < 2:
            values += p.numel()
            continue
        n = p.shape[0]
        m = p.numel() // n
        values += (n + m) * rank if (n + m) * rank * 2 < n * m else n * m
    return 2 * (world_size - 1) * values * 4 // world_size


class _AllReduceCounter:
    """Wraps ``torch.distributed.all_reduce`` so that DDP hooks' traffic lands in a ``ByteCounters``.

    DDP's ``allreduce_hook``, ``bf16_compress_hook`` and ``powerSGD_hook`` all call
    ``torch.distributed.all_reduce`` (looked up at call time), so replacing the module attribute sees
    every tensor they send; the count is the ring formula of the package's counters.
    """

    def __init__(self) -> None:
        self.active: ByteCounters | None = None
        self._orig = dist.all_reduce

    def __call__(self, tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.active is not None:
            self.active.add("dense", all_reduce_bytes(tensor.numel(), tensor.element_size(), self.active.world_size))
        return self._orig(tensor, *args, **kwargs)


_COUNTER = _AllReduceCounter()


def bf16_compress_hook_gloo(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """PyTorch's ``bf16_compress_hook``, unchanged, under another name.

    ``DistributedDataParallel.register_comm_hook`` refuses a function named ``bf16_compress_hook`` unless
    CUDA 11+ with NCCL 2.10+ is present; gloo does all-reduce bfloat16 tensors, so the same hook runs on
    the CPU once registered under this name.
    """
    return default_hooks.bf16_compress_hook(state, bucket)


# DDP compares the hook's annotations with the real classes; `from __future__ import annotations` made
# them strings, so give it the evaluated ones.
bf16_compress_hook_gloo.__annotations__ = {
    "state": Any,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[Tensor],
}


@dataclass(frozen=True)
class StepTimes:
    """What one step of one method measured on this rank (seconds)."""

    loss: float
    fwd_bwd_s: float  # forward + backward, up to the return of ``backward()``
    bwd_tail_s: float  # from the last parameter's gradient being ready to the return of ``backward()``
    opt_s: float  # clipping, optimizer (SCAPE: ``engine.step``, ``zero_grad`` and the mask wait)
    wait_s: float  # SCAPE: the engine's ``step_wait_s`` (blocked in collectives); 0 for the others


class Method:
    """One method's model, optimizer and synchronisation on this rank.

    Every parameter gets a post-accumulate-grad hook that stamps the time, so the part of ``backward()``
    after the last gradient exists (DDP: launching the last bucket, waiting for every bucket's
    all-reduce and copying back) is measured per step, next to the step it belongs to.
    """

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    counters: ByteCounters | None
    max_grad_norm: float

    def _watch_gradients(self) -> None:
        self._last_grad = 0.0
        self._hooks = [p.register_post_accumulate_grad_hook(self._tick) for p in self.model.parameters()]

    def close(self) -> None:
        """Let go of the process group: the gradient hooks are bound to this object and sit on parameters that
        DDP's reducer holds in C++, a cycle that would keep the group (and gloo's threads) alive past its
        destruction (``lightning_scape.comm.release_process_groups``)."""
        for hook in self.__dict__.pop("_hooks", []):  # methods that watch their gradients
            hook.remove()
        self.__dict__.pop("ddp", None)

    def _tick(self, p: Tensor) -> None:
        self._last_grad = time.perf_counter()

    def forward_backward(self, x: Tensor, y: Tensor) -> Tensor:
        """Loss of the batch, with ``backward()`` done (and gradients synchronised, where that happens there)."""
        loss = lm_loss(self.model, x, y)
        loss.backward()
        return loss

    def optimizer_step(self) -> float:
        """Clip, step, zero the gradients; returns the seconds blocked in communication."""
        nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        return 0.0

    def step_begins(self) -> None:
        """Before a step's forward pass (SCAPE's form pilot: the methods' rounds interleave, so the time since this
        method's previous step is not its compute)."""

    def train_step(self, x: Tensor, y: Tensor, lr: float) -> StepTimes:
        """One optimizer step at learning rate ``lr``."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.step_begins()
        t0 = time.perf_counter()
        loss = self.forward_backward(x, y)
        t1 = time.perf_counter()
        wait = self.optimizer_step()
        t2 = time.perf_counter()
        return StepTimes(float(loss.detach()), t1 - t0, max(0.0, t1 - self._last_grad), t2 - t1, wait)

    def formula_bytes(self) -> int:
        """Bytes per rank per step after warm-up, from the ring formulas of ``docs/algorithm.md`` section 5."""
        return 0


class ComputeOnly(Method):
    """W = 1 with the per-rank batch: this rank trains its own replica with AdamW and sends nothing."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.name = COMPUTE_ONLY
        self.model = build_model(spec.block_size, preset=spec.model, seed=spec.seed)
        self.opt = torch.optim.AdamW(weight_decay_groups(self.model), lr=spec.lr, weight_decay=0.1)
        self.max_grad_norm = spec.max_grad_norm
        self.counters = None
        self._watch_gradients()


class DDPMethod(Method):
    """``DistributedDataParallel`` (gloo) with a comm hook, and AdamW or AdamS."""

    def __init__(self, name: str, spec: WorkerSpec, world_size: int) -> None:
        self.name = name
        self.world_size = world_size
        self.model = build_model(spec.block_size, preset=spec.model, seed=spec.seed)
        # Gradients as views into DDP's buckets: no copy in or out of the buckets (PyTorch's advice).
        self.ddp = DistributedDataParallel(self.model, gradient_as_bucket_view=True, bucket_cap_mb=BUCKET_CAP_MB)
        hook: Callable[..., Any]
        state: Any = None
        if name in ("ddp_adamw", "ddp_adams"):
            # The built-in all-reduce, as a Python hook so that its bytes are counted; same traffic.
            hook = default_hooks.allreduce_hook
        elif name == "ddp_bf16":
            hook = bf16_compress_hook_gloo
        elif name == "ddp_powersgd":
            # PowerSGD cannot start before iteration 2 (DDP rebuilds its buckets after the first).
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=POWERSGD_RANK,
                start_powerSGD_iter=max(2, spec.warmup),
            )
            hook = powerSGD_hook.powerSGD_hook
        else:
            raise ValueError(f"unknown DDP method {name!r}")
        self.ddp.register_comm_hook(state, hook)
        groups = weight_decay_groups(self.model)
        if name == "ddp_adams":
            self.opt = AdamS(groups, lr=spec.lr, weight_decay=0.1)
        else:
            self.opt = torch.optim.AdamW(groups, lr=spec.lr, weight_decay=0.1)
        self.max_grad_norm = spec.max_grad_norm
        self.counters = ByteCounters(world_size=world_size)
        self._watch_gradients()

    def forward_backward(self, x: Tensor, y: Tensor) -> Tensor:
        """Through DDP: ``backward()`` returns once every bucket is all-reduced and copied back."""
        assert self.counters is not None
        self.counters.start_step()
        _COUNTER.active = self.counters
        try:
            loss = lm_loss(self.ddp, x, y)
            loss.backward()
        finally:
            _COUNTER.active = None
        return loss

    def formula_bytes(self) -> int:
        """Dense ring all-reduce of N values of b bytes (PowerSGD: its P, Q and uncompressed tensors)."""
        n = sum(p.numel() for p in self.model.parameters())
        w = self.world_size
        if self.name == "ddp_powersgd":
            return powersgd_formula_bytes(self.model, w)
        b = 2 if self.name == "ddp_bf16" else 4
        return 2 * (w - 1) * n * b // w


def ttl_scape_config(name: str, chunk_size: int = 0, overrides: dict[str, Any] | None = None) -> ScapeConfig:
    """The configuration of a time-to-loss SCAPE method: the package's defaults, read now.

    Only the density (from the name's ``_d`` suffix), the statistic (``scape_default_gradient_d0.01``), the
    wire format (``scape_default_int8_d0.01``) and a warm-up that never ends (``scape_int8_dense``) are stated;
    ``chunk_size`` (0: the default) and ``overrides`` (``--scape-set``, for smoke tests) are applied when given.

    Raises:
        ValueError: ``name`` is not one of :data:`TTL_SCAPE_METHODS`, or an override is not a ScapeConfig field.
    """
    if name not in TTL_SCAPE_METHODS:
        raise ValueError(f"{name!r} is not a time-to-loss SCAPE method; choose one of {TTL_SCAPE_METHODS}.")
    if name == AUTO_METHOD:
        cfg = ScapeConfig()  # the package's defaults: SCAPE chooses its form from the link
    else:
        cfg = ScapeConfig(density=FIXED_DENSITY)  # the fixed form that was the default: fp32 at d = 0.01
    if "_d0" in name:
        cfg = cfg.replace(density=float(name.rsplit("_d", 1)[1]))
    if name.endswith("_dense"):
        cfg = cfg.replace(dense_warmup_steps=10**9)
    if "int8" in name:
        cfg = cfg.replace(wire_format="int8")
    if chunk_size:
        cfg = cfg.replace(chunk_size=chunk_size)
    overrides = overrides or {}
    fields = sorted(cfg.to_dict())
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"--scape-set names {unknown}, which are not ScapeConfig fields; choose from {fields}.")
    return cfg.replace(**overrides)


class ScapeMethod(Method):
    """The package's ``ScapeEngine`` over ``ProcessGroupCommunicator`` (the default gloo group)."""

    def __init__(self, name: str, spec: WorkerSpec, world_size: int) -> None:
        self.name = name
        self.world_size = world_size
        self.model = build_model(spec.block_size, preset=spec.model, seed=spec.seed)
        density = 0.01 if "d0.01" in name else 0.1
        if name in TTL_SCAPE_METHODS:
            self.config = ttl_scape_config(name, spec.chunk_size, spec.scape_overrides)
        else:
            self.config = ScapeConfig(
                density=density,
                chunk_size=spec.chunk_size,
                sharded=not name.startswith("scape_replicated"),
                dense_warmup_steps=spec.warmup,
                # The step-time mode measures the sparse step at its density, right after a short warm-up.
                density_ramp_steps=0,
                bucket_cap_mb=BUCKET_CAP_MB,
            )
        self.opt = AdamS(weight_decay_groups(self.model), lr=spec.lr, weight_decay=0.1)
        self.engine = ScapeEngine(
            self.opt,
            self.config,
            ProcessGroupCommunicator(timeout_s=spec.timeout_s),
            param_order=list(self.model.parameters()),
        )
        # The baseline's masks score |e|, the raw gradient with its residual (top-k with error feedback).
        self.gradient_statistic = "gradient" in name
        if self.gradient_statistic:
            self.engine.masks.statistic = "gradient"
        self.counters = self.engine.counters
        self.max_grad_norm = spec.max_grad_norm
        self._watch_gradients()

    def step_begins(self) -> None:
        """Tell a form pilot where this method's step starts."""
        if isinstance(self.engine.pilot, FormPilot):
            self.engine.pilot.step_begins(self.engine)

    def optimizer_step(self) -> float:
        """``engine.step`` (clipping inside), ``zero_grad``, then the wait for the next mask's all-gather."""
        self.engine.step(max_grad_norm=self.max_grad_norm)
        self.engine.zero_grad()
        if not self.engine.in_warmup:
            # Wait for the next mask's all-gather here, so that it is charged to this method.
            self.engine.current_masks()
        return self.engine.counters.step_wait_s

    def formula_bytes(self) -> int:
        """``docs/algorithm.md`` section 5 with R = 1, plus the clipping scalar (sharded)."""
        w, slots, b = self.world_size, self.engine.slots, 4
        if self.config.sharded:
            return sharded_scape_bytes(w, slots)
        indices = (w - 1) * slots * 2 // w if self.gradient_statistic else 0
        return 2 * (w - 1) * slots * b // w + indices


class FSDPMethod(Method):
    """The model sharded with FSDP2 over the ``shard_size`` ranks of each host and replicated across hosts: FSDP's
    native HSDP with AdamW (``hsdp_adamw``), or the wiring of ``ScapeFSDPStrategy``: SCAPE across the hosts on each
    rank's shard, configured as ``ScapeMethod`` configures ``scape_sharded_d0.01`` (``scape_fsdp_d0.01``) or
    ``scape_default_d0.01`` (``scape_fsdp_default_d0.01``, the time-to-loss mode's)."""

    def __init__(self, name: str, spec: WorkerSpec, world_size: int) -> None:
        self.name = name
        self.grid = fsdp_binding.shard_grid(world_size, spec.shard_size, spec.shard_size, dist.get_rank())
        mesh = _mesh(self.grid)
        self.shard_group = mesh["shard"].get_group()
        self.model = build_model(spec.block_size, preset=spec.model, seed=spec.seed)
        self.numel = sum(p.numel() for p in self.model.parameters())
        self.max_grad_norm = spec.max_grad_norm
        self._last_grad = math.inf  # FSDP sets the sharded gradients itself: no per-parameter hook fires
        if name == "hsdp_adamw":
            from torch.distributed.fsdp import fully_shard

            for block in [m for m in self.model.modules() if type(m) in fsdp_binding.default_wrap_policy()]:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)  # a 2-D mesh: HSDP, replicate x shard
            self.opt = torch.optim.AdamW(weight_decay_groups(self.model), lr=spec.lr, weight_decay=0.1)
            self.counters = None
            return
        fsdp_binding.shard_module(self.model, mesh["shard"], None)
        fsdp_binding.sync_replicas(self.model, mesh["replicate"].get_group(), replicate_src=self.grid.shard_index)
        if name == "scape_fsdp_default_d0.01":
            self.config = ttl_scape_config("scape_default_d0.01", spec.chunk_size, spec.scape_overrides)
        else:
            self.config = ScapeConfig(
                density=0.01,
                chunk_size=spec.chunk_size,
                dense_warmup_steps=spec.warmup,
                density_ramp_steps=0,
                bucket_cap_mb=BUCKET_CAP_MB,
            )
        adams = AdamS(weight_decay_groups(self.model), lr=spec.lr, weight_decay=0.1)
        comm = fsdp_binding.replicate_communicator(mesh, self.grid, spec.timeout_s)
        self.opt, self.binding = fsdp.build_fsdp_scape_optimizer(adams, self.config, self.model, comm)
        self.engine = self.opt.engine
        self.counters = self.engine.counters

    def optimizer_step(self) -> float:
        """HSDP: clip, AdamW. SCAPE: clip by the norm over all shards, step, wait for the next mask."""
        if self.name == "hsdp_adamw":
            return super().optimizer_step()
        fsdp.request_global_clip(self.opt, self.max_grad_norm, self.shard_group, self.grid.shard_size)
        self.opt.step()
        self.opt.zero_grad()
        if not self.engine.in_warmup:
            self.engine.current_masks()
        return self.engine.counters.step_wait_s

    def formula_bytes(self) -> int:
        """Per rank, all of it between hosts: HSDP all-reduces its shard across the R hosts; SCAPE as
        ``ScapeMethod`` with W = R on the shard's slots."""
        r = self.grid.replicas
        if self.name == "hsdp_adamw":
            return 2 * (r - 1) * (self.numel // self.grid.shard_size) * 4 // r
        return sharded_scape_bytes(r, self.engine.slots)


_MESHES: dict[tuple[int, int], Any] = {}


def _mesh(grid: Any) -> Any:
    """One ``("replicate", "shard")`` mesh per grid, shared by the FSDP methods (every rank makes it in turn)."""
    key = (grid.replicas, grid.shard_size)
    if key not in _MESHES:
        _MESHES[key] = fsdp_binding.build_mesh("cpu", grid)
    return _MESHES[key]


def sharded_scape_bytes(world_size: int, slots: int) -> int:
    """Bytes per rank of a sharded fp32 sparse step over ``world_size`` ranks (``docs/algorithm.md`` section 5,
    R = 1): values, parameters and int16 indices of the slots, plus the clipping scalar."""
    w = world_size
    return (w - 1) * slots * (4 + 4 + 2) // w + 2 * (w - 1) * 4 // w


def make_method(name: str, spec: WorkerSpec, world_size: int) -> Method:
    """The method called ``name``."""
    if name == COMPUTE_ONLY:
        return ComputeOnly(spec)
    if name in FSDP_METHODS:
        return FSDPMethod(name, spec, world_size)
    if name in DDP_METHODS:
        return DDPMethod(name, spec, world_size)
    if name in SCAPE_METHODS or name in EXTRA_METHODS:
        return ScapeMethod(name, spec, world_size)
    raise ValueError(f"unknown method {name!r}; choose from {[*ALL_METHODS, *EXTRA_METHODS]}.")


def validation_loss_distributed(model: nn.Module, val: Tensor, spec: WorkerSpec, rank: int, world_size: int) -> float:
    """Mean loss on ``spec.eval_batches`` fixed validation batches, the batches shared out over the ranks.

    Every rank evaluates its own replica (identical on every rank after a step, for DDP and SCAPE alike) on
    batches ``rank``, ``rank + W``, ... of :func:`lightning_scape.examples.workloads.validation_batch_losses`; one
    all-reduce of the per-batch losses (outside every byte counter: no counter is active here, and the
    interface counters are read around steps only) gives every rank the mean over all batches.
    """
    was_training = model.training
    model.eval()
    try:
        part = validation_batch_losses(model, val, spec.block_size, spec.eval_batches, rank, world_size)
    finally:
        model.train(was_training)
    dist.all_reduce(part)
    return float(part.sum()) / spec.eval_batches


def read_iface(ifname: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of an interface of this network namespace."""
    base = f"/sys/class/net/{ifname}/statistics"
    with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def run(spec: WorkerSpec) -> dict[str, Any]:
    """Train every method of ``spec`` on this rank; returns the per-step records and static facts."""
    t_setup = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dist.all_reduce = _COUNTER  # count DDP hooks' traffic (see _AllReduceCounter)
    if spec.corpus not in ("stdlib", "prose"):
        raise ValueError(f"unknown corpus {spec.corpus!r}; choose 'stdlib' or 'prose'.")
    # The train and validation splits (by file) of the first max_bytes (0: all) of the corpus.
    tokens, val_tokens = corpus_tokens("prose" if spec.corpus == "prose" else "stdlib", spec.max_bytes or None)
    methods = [make_method(name, spec, world_size) for name in spec.methods]
    records = {m.name: MethodRecord() for m in methods}
    gen = torch.Generator().manual_seed(1234 + 1000 * spec.seed + rank)  # seed 0: the published runs' batches
    t_start = time.perf_counter()

    round_s: list[float] = []  # whole rounds (every method's step, barriers included): for sizing budgets
    eval_round_s: list[float] = []  # whole evaluations of every method

    def evaluate(done: int, due: list[Method]) -> None:
        # Outside the clock, between rounds: the next step's barrier starts a fresh clock.
        t_eval = time.perf_counter()
        first: float | None = None
        for m in due:
            t0 = time.perf_counter()
            if done == 0 and first is not None:
                # Before the first step every method holds the same weights (built from one seed; DDP and the
                # engine also start from rank 0's): one evaluation serves all (one round of 7 took 26 s here).
                loss = first
            else:
                loss = validation_loss_distributed(m.model, val_tokens, spec, rank, world_size)
                first = loss
            rec = records[m.name]
            rec.val_step.append(done)
            rec.val_loss.append(loss)
            rec.eval_s.append(time.perf_counter() - t0)
        eval_round_s.append(time.perf_counter() - t_eval)
        if rank == 0:
            print(
                f"    val @ {done:4d}  " + "  ".join(f"{m.name} {records[m.name].val_loss[-1]:.3f}" for m in due),
                flush=True,
            )

    if spec.eval_every > 0:
        evaluate(0, methods)
    total_steps = max(spec.steps_of(m.name) for m in methods)
    for step in range(total_steps):
        t_round = time.perf_counter()
        x, y = sample_batch(tokens, gen, spec.batch_size, spec.block_size)
        active = [m for m in methods if step < spec.steps_of(m.name)]  # every method sees the same batches
        k = step % len(active)
        for m in active[k:] + active[:k]:
            dist.barrier()
            tx0, rx0 = read_iface(spec.ifname)
            t0 = time.perf_counter()
            st = m.train_step(x, y, lr_at(step, spec, spec.steps_of(m.name)))
            dt = time.perf_counter() - t0
            # Outside the clock: once every rank has finished the step, the peers hold every byte this rank
            # sent for it, so all of it has left the interface. Read at once instead, the interface missed
            # what still sat in the socket and the shaper's queue, and no step counted it: up to 0.8 MB of
            # SCAPE's 3.5 MB dense warm-up step at 100 Mbit/s (small model, W = 2, measured). The barrier's
            # own few hundred bytes are counted in the step.
            dist.barrier()
            tx1, rx1 = read_iface(spec.ifname)
            rec = records[m.name]
            rec.loss.append(st.loss)
            rec.step_s.append(dt)
            rec.fwd_bwd_s.append(st.fwd_bwd_s)
            rec.bwd_tail_s.append(st.bwd_tail_s)
            rec.opt_s.append(st.opt_s)
            rec.wait_s.append(st.wait_s)
            rec.sent.append(0 if m.counters is None else m.counters.step_sent_bytes)
            rec.sent_by_kind.append({} if m.counters is None else dict(m.counters.step_sent))
            rec.tx.append(tx1 - tx0)
            rec.rx.append(rx1 - rx0)
        round_s.append(time.perf_counter() - t_round)
        if spec.eval_every > 0:
            due = [m for m in active if (step + 1) % spec.eval_every == 0 or step + 1 == spec.steps_of(m.name)]
            if due:
                evaluate(step + 1, due)
        if rank == 0 and (step % 10 == 0 or step == total_steps - 1):
            print(
                f"    step {step + 1:4d}/{total_steps}  "
                + "  ".join(f"{m.name} {records[m.name].loss[-1]:.2f}" for m in active[:4])
                + f"  ... ({time.perf_counter() - t_start:.0f} s)",
                flush=True,
            )
    dist.barrier()
    out: dict[str, Any] = {
        "rank": rank,
        "world_size": world_size,
        "params": sum(p.numel() for p in methods[0].model.parameters()),
        "methods": {},
        "loadavg_end": os.getloadavg(),
        "setup_s": t_start - t_setup,
        "round_s": round_s,
        "eval_round_s": eval_round_s,
    }
    for m in methods:
        info: dict[str, Any] = {"formula_bytes": m.formula_bytes(), **asdict(records[m.name])}
        if isinstance(m, DDPMethod):
            info["ddp_bucket_bytes"] = m.ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes")
            if m.name == "ddp_powersgd":
                info["powersgd"] = {"rank": POWERSGD_RANK, "start_powerSGD_iter": max(2, spec.warmup)}
        if isinstance(m, ScapeMethod):
            info["buckets"] = len(m.engine.buckets)
            info["slots"] = m.engine.slots
            info["padded_numel"] = m.engine.padded_numel
            info["effective_density"] = m.engine.config.effective_density  # the form in use at the end
            info["config"] = m.config.to_dict()
            if isinstance(m.engine.pilot, FormPilot):  # where SCAPE chose the form: each decision
                info["decisions"] = [
                    {"step": d.step, "before": d.before.name, "chosen": d.chosen.name,
                     "link_bps": d.link.bandwidth_bps, "compute_s": d.compute_s, "text": d.describe()}
                    for d in m.engine.pilot.decisions
                ]  # fmt: skip
            m.engine.close()
        out["methods"][m.name] = info
    for m in methods:
        m.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """Read the spec, join the gloo group from the environment, run, write ``rank<r>.json``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.network.worker SPEC.json (started by benchmarks.network.run)")
        return 2
    with open(args[0]) as fh:
        spec = WorkerSpec(**json.load(fh))
    # One intra-op thread per rank: the machine has 2 cores for 2 ranks (each rank is one "host's" CPU).
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    try:
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=spec.timeout_s))
        try:
            result = run(spec)
        finally:
            release_process_groups()
    except Exception:
        traceback.print_exc()
        print(f"rank {rank}: failed (traceback above)", file=sys.stderr, flush=True)
        return 1
    with open(os.path.join(spec.out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
