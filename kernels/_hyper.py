"""The scalars of one AdamS step, shared by the AdamS ops' references and Triton launchers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdamSHyper:
    """Hyperparameters of one AdamS step of one param group.

    Built once per step from the param group (``lightning_scape.engine.update.step_hyper``, or
    :class:`lightning_scape.AdamS` per parameter) and handed to :func:`dense_adams` and :func:`sparse_adams`,
    whose references and kernels read the same fields.

    Args:
        step: The step t being taken (1-based, the dense warm-up included).
        lr: The group's learning rate; it drives the decoupled weight decay, and the update unless
            ``lr_update`` is set.
        beta1: First-moment decay b1.
        beta2: Weight b2 of the momentum in the second-moment term.
        eps: Denominator epsilon.
        weight_decay: Decoupled weight decay wd (``theta *= 1 - lr * wd``).
        bias_correction: Divide the momenta by ``1 - b1**t``.
        lr_update: Learning rate of the update term when it differs from ``lr`` (SCAPE's
            ``sparse_lr_scale``); None: ``lr``.
        staleness_correction: Sparse steps: divide the averaged value by tau (steps since the coordinate
            was last sent) in the second-moment term.
        catch_up: Sparse steps: multiply the update by ``min(tau, catch_up_cap)``.
        catch_up_cap: Cap of the catch-up factor.
        interval: Sparse steps: the interval update (``kernels/sparse_adams.py``) instead of one AdamS step.
        interval_cap: The interval update moves a coordinate by at most this many steps' worth.
    """

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: bool = True
    lr_update: float | None = None
    staleness_correction: bool = False
    catch_up: bool = False
    catch_up_cap: float = 1.0
    interval: bool = False
    interval_cap: float = float("inf")

    @property
    def bias_c(self) -> float:
        """c = ``1 - b1**t`` (1 without bias correction), computed in Python (fp64)."""
        return 1.0 - self.beta1**self.step if self.bias_correction else 1.0

    @property
    def decay(self) -> float:
        """The weight-decay factor ``1 - lr * wd``."""
        return 1.0 - self.lr * self.weight_decay

    @property
    def update_lr(self) -> float:
        """The learning rate of the update term."""
        return self.lr if self.lr_update is None else self.lr_update
