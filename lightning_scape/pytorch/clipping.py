"""The Trainer's gradient clipping (``gradient_clip_val``, ``self.clip_gradients``) routed to the SCAPE engine.

Clipping ``param.grad`` would act on gradients already sent during backward; the engine instead clips the
synchronised values of the coming step, by their global norm (over every rank's part) or by value.
"""

from __future__ import annotations

from types import MethodType

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import Optimizer

from lightning_scape.runtime.scape_runtime import ScapeRuntime


def redirect(plugin: Precision, runtime: ScapeRuntime) -> None:
    """Route ``plugin.clip_gradients`` (what ``gradient_clip_val`` calls) to ``runtime``'s engine, until
    :func:`restore`."""

    def clip_gradients(
        plugin: Precision,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        if GradClipAlgorithmType(gradient_clip_algorithm) == GradClipAlgorithmType.VALUE:
            runtime.clip_value(optimizer, float(clip_val))
        else:  # as Lightning's own clipping by norm, a non-finite norm is not an error
            runtime.request_norm_clip(optimizer, float(clip_val))

    plugin.clip_gradients = MethodType(clip_gradients, plugin)  # type: ignore[method-assign]


def restore(plugin: Precision) -> None:
    """Give ``plugin`` its own ``clip_gradients`` back."""
    if "clip_gradients" in vars(plugin):
        del plugin.clip_gradients
