"""The Trainer's gradient clipping (``gradient_clip_val``, ``self.clip_gradients``) routed to the SCAPE engine.

Clipping ``param.grad`` would act on gradients already sent during backward; the engine instead clips the
synchronised values of the coming step, by their global norm or by value. The two Trainer strategies differ only in
how a norm is requested (``NormRequest``): over this rank's engine, or over all of FSDP's shards.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer

from lightning_scape.runtime.optimizer import ScapeOptimizer, unwrap_optimizer

# Asks the engine to clip the coming step's synchronised gradient to this global L2 norm.
NormRequest = Callable[[ScapeOptimizer, float], object]


def request_norm(opt: ScapeOptimizer, max_norm: float) -> None:
    """The replicated engine's :data:`NormRequest`: its own global norm."""
    opt.request_clip(max_norm=max_norm)


def redirect(plugin: Precision, owner: str, norm_request: NormRequest = request_norm) -> None:
    """Route ``plugin.clip_gradients`` (what ``gradient_clip_val`` calls) to the engine, until :func:`restore`.

    Args:
        plugin: The strategy's precision plugin.
        owner: The strategy's name, for the error on an optimizer it did not set up.
        norm_request: How a clip by norm is requested.
    """

    def clip_gradients(
        plugin: Precision,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        opt = unwrap_optimizer(optimizer)
        if not isinstance(opt, ScapeOptimizer):
            raise TypeError(f"{owner} can only clip its own optimizer, got {type(opt).__name__}.")
        if GradClipAlgorithmType(gradient_clip_algorithm) == GradClipAlgorithmType.VALUE:
            opt.request_clip(clip_value=float(clip_val))
        else:
            norm_request(opt, float(clip_val))

    plugin.clip_gradients = MethodType(clip_gradients, plugin)  # type: ignore[method-assign]


def restore(plugin: Precision) -> None:
    """Give ``plugin`` its own ``clip_gradients`` back."""
    if "clip_gradients" in vars(plugin):
        del plugin.clip_gradients
