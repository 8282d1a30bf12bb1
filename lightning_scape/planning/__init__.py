"""Planning a run: does SCAPE pay on this network? (``lightning-scape estimate``)

From a model's parameters, the cluster's shape and links and one rank's compute per step, predict the bytes,
step time and memory per rank of DDP, DDP's bf16 hook and SCAPE (with the int8 wire, also with every step
dense), where SCAPE breaks even, and what its warm-up and ramp cost. The bytes are the package's own formulas
(:mod:`lightning_scape.comm.wire`) applied to the engine's layout and mask schedule; the memory is the engine's
buffers; the step model is in :mod:`~lightning_scape.planning.predict` and ``docs/benchmarks.md`` ("Predicted
against measured").

* :mod:`~lightning_scape.planning.network`: links, the cluster, a ring collective's time;
* :mod:`~lightning_scape.planning.traffic`: each method's collectives, step by step;
* :mod:`~lightning_scape.planning.memory`: memory per rank;
* :mod:`~lightning_scape.planning.predict`: the step model, the break-even rate, the schedule's cost;
* :mod:`~lightning_scape.planning.estimate`: all of it for one cluster, and a recommendation;
* :mod:`~lightning_scape.planning.measure`: a short dry run that measures the compute on this machine;
* :mod:`~lightning_scape.planning.report`: the printed text.

And for a run under way: :mod:`~lightning_scape.planning.forms` and :mod:`~lightning_scape.planning.pilot` (the form
SCAPE chooses from the link it measures), :mod:`~lightning_scape.planning.run_traffic` (the bytes a whole run sends)
and :mod:`~lightning_scape.planning.run_summary` (what a run did, said at its end).
"""

from lightning_scape.planning.estimate import (
    DDP,
    DDP_BF16,
    SCAPE_INT8_DENSE,
    Estimate,
    MethodEstimate,
    estimate,
    scape_name,
)
from lightning_scape.planning.memory import Memory, ddp_memory, scape_memory
from lightning_scape.planning.network import Cluster, Collective, Link
from lightning_scape.planning.predict import ScheduleCost, StepCompute, StepTime, breakeven_bandwidth, step_time
from lightning_scape.planning.report import format_estimate, format_rate
from lightning_scape.planning.traffic import (
    ScapeTraffic,
    StepTraffic,
    ddp_bucket_numels,
    ddp_traffic,
    parameter_groups,
    scape_layout,
)

__all__ = [
    "DDP",
    "DDP_BF16",
    "SCAPE_INT8_DENSE",
    "Cluster",
    "Collective",
    "Estimate",
    "Link",
    "Memory",
    "MethodEstimate",
    "ScapeTraffic",
    "ScheduleCost",
    "StepCompute",
    "StepTime",
    "StepTraffic",
    "breakeven_bandwidth",
    "ddp_bucket_numels",
    "ddp_memory",
    "ddp_traffic",
    "estimate",
    "format_estimate",
    "format_rate",
    "parameter_groups",
    "scape_layout",
    "scape_memory",
    "scape_name",
    "step_time",
]
