"""``param.grad`` holds this rank's gradient: what is said to code that reads or writes it as DDP's average.

Under DDP, ``param.grad`` after backward is the average over the ranks, and clipping ``param.grad`` clips what
the optimizer applies. Under SCAPE it is this rank's own gradient (the engine sent it during backward and keeps
the synchronised gradient itself), so both silently change meaning; these notices say so, once, on rank 0.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from lightning.fabric.utilities.rank_zero import rank_zero_warn

GRADS_WRITTEN_AFTER_SEND = (
    "lightning_scape: param.grad was changed after backward (gradient clipping of param.grad, "
    "torch.nn.utils.clip_grad_norm_, an in-place nan_to_num_, ...), which has no effect: SCAPE sent each gradient "
    "during backward, and param.grad holds this rank's gradient, not the average. Clip with the Trainer's "
    "gradient_clip_val, self.clip_gradients(...) in manual optimization or fabric.clip_gradients: they clip the "
    "synchronised gradient. Its global norm: trainer.strategy.global_grad_norm() / fabric.strategy.global_grad_norm()."
)

# The total that Lightning's ``lightning.pytorch.utilities.grad_norm`` returns, e.g. "grad_2.0_norm_total".
_GRAD_NORM_TOTAL = re.compile(r"grad_(inf|[0-9.]+)_norm_total$")


class LocalGradNormNotice:
    """Says once, on rank 0, that logged metrics look like Lightning's ``grad_norm`` of ``param.grad``."""

    def __init__(self) -> None:
        self.given = False

    def check(self, metric_names: Iterable[str]) -> None:
        """Warn if one of ``metric_names`` is the total of Lightning's ``grad_norm``.

        Args:
            metric_names: The names logged so far (a prefix such as ``"train/"`` or ``"hook_name."`` is allowed).
        """
        if self.given:
            return
        name = next((n for n in metric_names if _GRAD_NORM_TOTAL.search(n)), None)
        if name is None:
            return
        self.given = True
        rank_zero_warn(
            f"lightning_scape: the logged metric {name!r} looks like Lightning's grad_norm() of param.grad. Under "
            "SCAPE param.grad holds this rank's own gradient, not the average as under DDP, so these norms are "
            "per-rank values, and in sparse steps not those of what the step applies. For the global norm of the "
            "synchronised gradient log self.trainer.strategy.global_grad_norm() in on_before_optimizer_step."
        )
