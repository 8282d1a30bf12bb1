"""AdamS: Adam whose second moment is rebuilt from the momentum each step (``docs/algorithm.md`` section 2).

AdamS keeps one state tensor, the first moment m. Its second-moment term is

    nu = b2_t * (m_prev / c')**2 + (1 - b2_t) * g**2,   c' = 1 - b1**(t-1),   b2_t = b2 (1 - b2**(t-1)) / (1 - b2**t),

the squared previous momentum standing in for Adam's previous second-moment estimate, weighed as Adam's bias
correction weighs it (b2_1 = 0: the first step moves every coordinate by the learning rate, as Adam's does; b2_t
tends to b2). So it needs no exp_avg_sq, half of Adam's optimizer memory, and takes AdamW's hyperparameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_scape.kernels import AdamSHyper, dense_adams


def state_dtype_for(param_dtype: torch.dtype) -> torch.dtype:
    """Optimizer state is kept in fp32 at least (fp64 parameters keep fp64 state)."""
    return torch.promote_types(param_dtype, torch.float32)


class AdamS(Optimizer):
    """The AdamS optimizer.

    Args:
        params: Parameters or param groups; every group may override any of the arguments below.
        lr: Learning rate. AdamW's value for the same model carries over up to about 1e-3; above it take about
            half of it. Where a gradient is mostly noise AdamS still moves the coordinate by about lr per step
            (AdamW's steps shrink there), so it steps further than AdamW at the same rate; decay the rate towards
            the end of training (cosine or linear), as LLM recipes do (``docs/algorithm.md`` section 2).
        betas: (b1, b2). b1 drives the momentum that SCAPE's masks are built from; (0.9, 0.95) is the
            usual LLM choice.
        eps: Denominator epsilon; raise to 1e-6 for bf16-heavy runs where nu underflows.
        weight_decay: Decoupled weight decay (``theta *= 1 - lr * wd``); 0.1 is the LLM default, use 0 for
            norms and biases through a separate param group.
        bias_correction: Divide each momentum by the bias correction of its own step (the new one by
            ``1 - b1**t``, the previous one by ``1 - b1**(t-1)``) and weigh the previous one by b2_t, as Adam
            corrects its moments. Turn off only to reproduce the paper's text: its normaliser then weighs the
            zero momentum of the first step by b2, and the first steps move by up to ``(1 - b1) / sqrt(1 - b2)``
            times the learning rate (3.2x at b2 = 0.999).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = AdamS(model.parameters(), lr=1e-3)
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        bias_correction: bool = True,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"AdamS: lr={lr} must be >= 0.")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamS: betas={betas} must both lie in [0, 1).")
        if not eps >= 0.0:
            raise ValueError(f"AdamS: eps={eps} must be >= 0.")
        if not weight_decay >= 0.0:
            raise ValueError(f"AdamS: weight_decay={weight_decay} must be >= 0.")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state written by :meth:`state_dict`; the optimizer entry of a SCAPE checkpoint is refused.

        A SCAPE strategy's checkpoint holds, where the optimizer's state would be, a stub whose per-rank state
        lives in other files; it says so in place of a step count, and that message is raised here.
        """
        for param_state in state_dict.get("state", {}).values():
            step = param_state.get("step") if isinstance(param_state, dict) else None
            if isinstance(step, bytes):
                raise ValueError(step.decode())
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamS step over every parameter that has a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss (run with gradients enabled).

        Returns:
            The closure's loss, if a closure was given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamS does not support sparse gradients; use a dense embedding.")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype_for(p.dtype))
                state["step"] += 1
                hyper = AdamSHyper(
                    step=int(state["step"].item()),
                    lr=group["lr"],
                    beta1=b1,
                    beta2=b2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    bias_correction=group["bias_correction"],
                )
                dense_adams(p, state["exp_avg"], p.grad, hyper)
        return loss
