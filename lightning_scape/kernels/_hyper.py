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
        lr: The group's learning rate (the update and the decoupled weight decay).
        beta1: First-moment decay b1.
        beta2: Weight b2 of the momentum in the second-moment term.
        eps: Denominator epsilon.
        weight_decay: Decoupled weight decay wd (``theta *= 1 - lr * wd``).
        bias_correction: Divide the new momentum by ``1 - b1**t`` and the previous one by ``1 - b1**(t-1)``, and
            weigh the previous one in the second-moment term by :attr:`nu_beta2` (as Adam bias-corrects its
            second moment), not by b2.
        catch_up_cap: Sparse steps: a coordinate sent after tau steps moves by at most ``min(tau, catch_up_cap)``
            steps' worth of this step's learning rate (``kernels/sparse_adams.py``).
        first_step: The steps taken before this state's momentum started (parameters that joined the engine
            later): the bias corrections count the ``step - first_step`` steps since, as Adam's per-parameter
            step count does.
    """

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: bool = True
    catch_up_cap: float = float("inf")
    first_step: int = 0

    @property
    def age(self) -> int:
        """The steps of this state so far, this one included: ``step - first_step``."""
        return self.step - self.first_step

    @property
    def bias_c(self) -> float:
        """c = ``1 - b1**t`` (1 without bias correction), computed in Python (fp64); t counts from ``first_step``."""
        return 1.0 - self.beta1**self.age if self.bias_correction else 1.0

    @property
    def prev_c(self) -> float:
        """c' = ``1 - b1**(t-1)``, the bias correction of the previous momentum (1 at t = 1, where that momentum is
        zero, and without bias correction)."""
        if not self.bias_correction or self.age <= 1:
            return 1.0
        return 1.0 - self.beta1 ** (self.age - 1)

    @property
    def nu_beta2(self) -> float:
        """b2_t, the weight of the previous momentum in the second-moment term: ``b2 (1 - b2**(t-1)) / (1 - b2**t)``.

        Adam's bias-corrected second moment weighs the newest ``g**2`` by ``(1 - b2) / (1 - b2**t)`` and its previous
        estimate by the rest; AdamS, whose previous estimate is the squared momentum, weighs them the same way. So
        the first step (b2_1 = 0, ``nu = g**2``) moves every coordinate by the learning rate, as Adam's does, and
        early steps follow a growing gradient as Adam's do; b2_t tends to b2. Without bias correction: b2.
        """
        if not self.bias_correction:
            return self.beta2
        b2, t = self.beta2, self.age
        return b2 * (1.0 - b2 ** (t - 1)) / (1.0 - b2**t)

    @property
    def decay(self) -> float:
        """The weight-decay factor ``1 - lr * wd``."""
        return 1.0 - self.lr * self.weight_decay
