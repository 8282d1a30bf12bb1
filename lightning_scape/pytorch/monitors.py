"""Monitoring callbacks: what SCAPE sends (``comm/``) and how its masks behave (``mask/``).

Both monitors are Trainer callbacks and work from a Fabric loop too:

    comm, masks = CommunicationMonitor(), MaskMonitor(topk_every_n_steps=100)
    trainer = Trainer(strategy="scape", callbacks=[comm, masks])          # logs every log_every_n_steps

    fabric = Fabric(strategy="scape", callbacks=[comm, masks], loggers=CSVLogger("logs"))
    ...
    optimizer.step()                      # Fabric calls on_after_optimizer_step: the monitors read the engine
    if step % 10 == 0:
        fabric.log_dict({**comm.compute(), **masks.compute()}, step=step)

Values are aggregated over the steps since the last ``compute()`` with torchmetrics (mean, or max where
the key says so); quantities that differ between ranks (wait time, residual norm, unsent age) are also
aggregated over ranks, which costs one small all-gather per such key and log step.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torchmetrics import MaxMetric, MeanMetric, Metric, SumMetric
from typing_extensions import override

from lightning_scape.comm import TRAFFIC_KINDS
from lightning_scape.engine import ScapeEngine, feedback
from lightning_scape.kernels import mask_positions
from lightning_scape.planning.pilot import FormPilot
from lightning_scape.runtime.optimizer import ScapeOptimizer, scape_optimizers, unwrap_optimizer


class _Aggregates:
    """torchmetrics aggregates by key, created on first update; ``compute`` returns and resets them."""

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}
        self._updated: set[str] = set()

    def update(self, key: str, value: float, kind: str = "mean", sync: bool = False, device: Any = None) -> None:
        metric = self._metrics.get(key)
        if metric is None:
            cls = {"mean": MeanMetric, "max": MaxMetric, "sum": SumMetric}[kind]
            metric = cls(sync_on_compute=sync)
            if device is not None:
                metric = metric.to(device)
            metric = metric.set_dtype(torch.float64)  # after .to(): moving a metric resets its dtype
            self._metrics[key] = metric
        metric.update(torch.tensor(float(value), dtype=torch.float64, device=metric.device))
        self._updated.add(key)

    def compute(self) -> dict[str, float]:
        # Every rank updates the same keys at the same steps, so the synced computes line up across ranks.
        out = {key: float(self._metrics[key].compute()) for key in sorted(self._updated)}
        for key in self._updated:
            self._metrics[key].reset()
        self._updated.clear()
        return out

    def reset(self) -> None:
        for metric in self._metrics.values():
            metric.reset()
        self._updated.clear()


class _ScapeMonitor(Callback):
    """The shared plumbing: find the engine after each optimizer step, aggregate, log."""

    def __init__(self, log_every_n_steps: int | None) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps} must be >= 1 (or None for the Trainer's).")
        self.log_every_n_steps = log_every_n_steps
        self._agg = _Aggregates()
        self._seen_global_step = -1
        self._names: dict[int, str] = {}

    # -- what a monitor measures

    def update(self, engine: ScapeEngine) -> None:
        """Record the step the engine just made."""
        raise NotImplementedError

    def compute(self) -> dict[str, float]:
        """The aggregates since the last call (keys under ``comm/`` or ``mask/``), then reset."""
        return self._agg.compute()

    def set_parameter_names(self, module: torch.nn.Module) -> None:
        """Name the parameters in per-layer keys after ``module.named_parameters()``."""
        self._names = {id(p): n for n, p in module.named_parameters()}

    # -- Fabric: Fabric(callbacks=[monitor]) calls this after every optimizer.step()

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        """Fabric hook: record the step of the SCAPE optimizer that just stepped."""
        opt = unwrap_optimizer(optimizer)
        if not isinstance(opt, ScapeOptimizer):
            return
        if not self._names:
            for module in getattr(strategy, "scape_modules", []):
                if opt.owns(module):
                    self.set_parameter_names(module)
        self.update(opt.engine)

    # -- Trainer

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._agg.reset()
        self._seen_global_step = -1
        self.set_parameter_names(pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_global_step = trainer.global_step  # a resumed run starts past 0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._seen_global_step:  # an accumulating micro-batch: no step happened
            return
        self._seen_global_step = trainer.global_step
        engine = _engine_of(trainer.strategy)
        if engine is None:
            return
        self.update(engine)
        self._on_trainer_step(engine, pl_module)
        every = self.log_every_n_steps or int(getattr(trainer, "log_every_n_steps", 50))
        if trainer.global_step % every == 0:
            metrics = self.compute()
            if metrics:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)

    def _on_trainer_step(self, engine: ScapeEngine, pl_module: pl.LightningModule) -> None:
        """Per-step extras for the Trainer (progress bar)."""


def _engine_of(strategy: Any) -> ScapeEngine | None:
    opts = list(scape_optimizers(getattr(strategy, "optimizers", []) or []))
    if not opts:
        opts = list(getattr(strategy, "scape_optimizers", []))
    return opts[-1].engine if opts else None


def form_metrics(engine: ScapeEngine) -> dict[str, float]:
    """The form SCAPE chose and the link it last measured (none where the form is fixed)."""
    pilot = engine.pilot
    if not isinstance(pilot, FormPilot):
        return {}
    link = pilot.decisions[-1].link.bandwidth_bps / 1e9 if pilot.decisions else math.nan
    return {
        "comm/form_density": 1.0 if pilot.form.density is None else pilot.form.density,
        "comm/form_int8": float(pilot.form.wire_format == "int8"),
        "comm/link_gbps": link,
    }


class CommunicationMonitor(_ScapeMonitor):
    """Bytes SCAPE sent per step, by kind, against what DDP would have sent, and wait time.

    Keys (means per optimizer step over the logging window; bytes are per rank, as the ring formulas of
    ``docs/algorithm.md`` section 5 counts them; a ring collective receives as much as it sends):

    * ``comm/sent_bytes`` and, per kind (``values``, ``params``, ``indices``, ``dense``, ``scalars``, ``probe``,
      ``setup``), ``comm/sent_bytes/<kind>``;
    * ``comm/dense_equivalent_bytes``: what DDP's dense all-reduce of the same gradients would send;
    * ``comm/compression_ratio``: dense-equivalent over sent bytes of the window; the progress bar shows the last
      step's as ``DDP/sent`` (:attr:`progress_bar_key`: a key short enough not to be cut);
    * ``comm/wait_s`` (mean over steps and ranks) and ``comm/wait_s_max``: time blocked on collectives, i.e.
      communication not hidden under compute;
    * ``comm/total_sent_bytes``, ``comm/total_dense_equivalent_bytes``, ``comm/total_wait_s``: since the start
      of the run (restored from checkpoints);
    * where SCAPE chooses its form (``docs/self_driving.md``), the form in use and the link last measured:
      ``comm/form_density`` (1 for a dense form, else its density), ``comm/form_int8`` (1 on the int8 wire) and
      ``comm/link_gbps`` (nan before the first decision).

    Args:
        log_every_n_steps: Trainer only: log every this many optimizer steps; default: the Trainer's
            ``log_every_n_steps``. With Fabric, call :meth:`compute` at your own logging interval.
        per_kind: Also log the per-kind keys. Turn off to keep dashboards small once the split is known.
        progress_bar: Show the last step's compression ratio on the Trainer's progress bar, as ``DDP/sent``.
    """

    # The progress bar's key: DDP's bytes over the bytes sent. Short, so that a terminal's width does not cut it
    # (the loggers get comm/compression_ratio, averaged over the logging window).
    progress_bar_key = "DDP/sent"

    def __init__(self, log_every_n_steps: int | None = None, per_kind: bool = True, progress_bar: bool = True) -> None:
        super().__init__(log_every_n_steps)
        self.per_kind = per_kind
        self.progress_bar = progress_bar
        self._window_dense = 0.0
        self._window_sent = 0.0

    @override
    def update(self, engine: ScapeEngine) -> None:
        c = engine.counters
        dev = engine.buckets[0].params.device
        agg = self._agg
        agg.update("comm/sent_bytes", c.step_sent_bytes, device=dev)
        if self.per_kind:
            for kind in TRAFFIC_KINDS:
                agg.update(f"comm/sent_bytes/{kind}", c.step_sent.get(kind, 0), device=dev)
        agg.update("comm/dense_equivalent_bytes", c.step_dense_equivalent, device=dev)
        agg.update("comm/wait_s", c.step_wait_s, sync=True, device=dev)
        agg.update("comm/wait_s_max", c.step_wait_s, kind="max", sync=True, device=dev)
        self._window_dense += c.step_dense_equivalent
        self._window_sent += c.step_sent_bytes
        self._totals = {
            "comm/total_sent_bytes": float(c.total_sent_bytes),
            "comm/total_dense_equivalent_bytes": float(c.total_dense_equivalent),
            "comm/total_wait_s": float(c.total_wait_s),
            **form_metrics(engine),
        }

    @override
    def compute(self) -> dict[str, float]:
        out = super().compute()
        if not out:
            return out
        out["comm/compression_ratio"] = _ratio(self._window_dense, self._window_sent)
        out.update(getattr(self, "_totals", {}))
        self._window_dense = self._window_sent = 0.0
        return out

    @override
    def _on_trainer_step(self, engine: ScapeEngine, pl_module: pl.LightningModule) -> None:
        if self.progress_bar:
            c = engine.counters
            ratio = _ratio(c.step_dense_equivalent, c.step_sent_bytes)
            pl_module.log(self.progress_bar_key, ratio, prog_bar=True, logger=False, on_step=True, on_epoch=False)


def _ratio(dense: float, sent: float) -> float:
    return dense / sent if sent > 0 else math.inf


class MaskMonitor(_ScapeMonitor):
    """How SCAPE's masks evolve and how much gradient waits outside them.

    Keys (means over the optimizer steps of the logging window, sparse steps only):

    * ``mask/kept_fraction``: fraction of the slots of a step's mask that the previous step's mask also had;
    * ``mask/jaccard``: intersection over union of consecutive masks;
    * ``mask/churn/<parameter>``: per parameter, the fraction of its slots that changed (``per_layer``);
    * ``mask/residual_norm``: L2 norm of the error-feedback residual (mean over ranks);
    * ``mask/oldest_unsent_age``: steps since the least recently sent coordinate was sent (max over ranks);
    * ``mask/topk_coverage`` (every ``topk_every_n_steps``): the fraction of the true top-k coordinates of the
      dense averaged gradient (k = the mask's size) that the step's mask covered.

    Args:
        log_every_n_steps: Trainer only: log every this many optimizer steps; default: the Trainer's
            ``log_every_n_steps``. With Fabric, call :meth:`compute` at your own logging interval.
        per_layer: Log the per-parameter churn. One key per parameter: turn off for models with hundreds of
            parameter tensors, or look at it only in short diagnostic runs.
        topk_every_n_steps: Measure ``mask/topk_coverage`` every this many steps; None (default) never. Each
            measurement all-reduces the dense gradient once (what DDP sends per step; not counted in
            ``comm/``), so keep it rare in long runs: every 100-1000 steps.
    """

    def __init__(
        self, log_every_n_steps: int | None = None, per_layer: bool = True, topk_every_n_steps: int | None = None
    ) -> None:
        super().__init__(log_every_n_steps)
        if topk_every_n_steps is not None and topk_every_n_steps < 1:
            raise ValueError(f"topk_every_n_steps={topk_every_n_steps} must be >= 1, or None to never measure it.")
        self.per_layer = per_layer
        self.topk_every_n_steps = topk_every_n_steps
        self._previous: list[Tensor] | None = None

    @override
    def update(self, engine: ScapeEngine) -> None:
        masks = engine.last_used_masks
        if masks is None or engine.last_step_skipped:
            return
        dev = engine.buckets[0].params.device
        agg = self._agg
        positions = [mask_positions(m, bs.layout.chunk_size) for m, bs in zip(masks, engine.buckets, strict=True)]
        previous = self._previous
        if previous is not None and previous is not masks:
            old = [mask_positions(m, bs.layout.chunk_size) for m, bs in zip(previous, engine.buckets, strict=True)]
            kept = [torch.isin(new, o) for new, o in zip(positions, old, strict=True)]
            inter = sum(int(k.sum()) for k in kept)
            size = sum(p.numel() for p in positions)
            agg.update("mask/kept_fraction", inter / size, device=dev)
            agg.update("mask/jaccard", inter / (2 * size - inter), device=dev)
            if self.per_layer:
                for key, value in self._churn(engine, positions, kept).items():
                    agg.update(key, value, device=dev)
        elif previous is masks:  # the same masks: no sparse step since the last report
            agg.update("mask/kept_fraction", 1.0, device=dev)
            agg.update("mask/jaccard", 1.0, device=dev)
        self._previous = masks
        agg.update("mask/residual_norm", feedback.residual_norm(engine.buckets), sync=True, device=dev)
        age = feedback.oldest_unsent_age(engine.buckets, engine.step_count, engine.in_warmup)
        agg.update("mask/oldest_unsent_age", age, kind="max", sync=True, device=dev)
        n = self.topk_every_n_steps
        if n is not None and engine.step_count % n == 0:
            agg.update("mask/topk_coverage", topk_coverage(engine, positions), device=dev)

    def _churn(self, engine: ScapeEngine, positions: list[Tensor], kept: list[Tensor]) -> dict[str, float]:
        out: dict[str, float] = {}
        for bi, (bs, pos, keep) in enumerate(zip(engine.buckets, positions, kept, strict=True)):
            places = bs.layout.places
            starts = torch.tensor([pl.offset for pl in places], device=pos.device)
            real = pos < bs.layout.numel
            owner = torch.bucketize(pos[real], starts, right=True) - 1
            total = torch.bincount(owner, minlength=len(places))
            changed = torch.bincount(owner[~keep[real]], minlength=len(places))
            for j, place in enumerate(places):
                if int(total[j]) > 0:
                    name = self._names.get(id(place.param), f"bucket{bi}.param{j}")
                    out[f"mask/churn/{name}"] = float(changed[j]) / float(total[j])
        return out

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._previous = None


@torch.no_grad()
def topk_coverage(engine: ScapeEngine, positions: list[Tensor]) -> float:
    """Fraction of the top-k of the dense averaged gradient (k = real mask slots) inside the mask.

    One dense all-reduce of this rank's gradient (every rank must call it at the same step); the mask is
    the one the step used (``positions``: its flat positions per bucket, from :func:`mask_positions`).
    """
    grads = torch.cat([bs.grads[: bs.layout.numel].float() for bs in engine.buckets])
    if engine.world_size > 1:
        engine.comm.all_reduce_sum(grads).wait()
        grads.div_(engine.world_size)
    offsets, total = [], 0
    for bs in engine.buckets:
        offsets.append(total)
        total += bs.layout.numel
    mask = torch.cat(
        [p[p < bs.layout.numel] + off for p, bs, off in zip(positions, engine.buckets, offsets, strict=True)]
    )
    k = int(mask.numel())
    if k == 0:
        return math.nan
    top = grads.abs().topk(k).indices
    return float(torch.isin(top, mask).float().mean())
