"""What the benchmarks' reports share: numbers as table cells, the network and machine lines, CSV and JSON
files, the plots' set-up and colours, and a process's age (for the time budgets of whole commands).

``benchmarks.network.run`` (step times) and ``benchmarks.network.time_to_loss`` (time to a loss) write their
``results.md``, CSVs, ``results.json`` and plots with these; what each of them measures stays in its module.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from typing import Any


def mean(values: Sequence[float]) -> float:
    """The mean of ``values``; NaN when there are none."""
    return sum(values) / len(values) if values else math.nan


def cumsum(values: Sequence[float]) -> list[float]:
    """Running sums of ``values``."""
    out, t = [], 0.0
    for v in values:
        t += v
        out.append(t)
    return out


def fmt(v: Any, spec: str = ".1f") -> str:
    """A table cell: ``v`` formatted with ``spec``, "n/a" for None and NaN."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec)


def goodput_cell(bps: float | None) -> str:
    """A measured TCP goodput in whole Mbit/s ("n/a" when it was not measured: loopback)."""
    return fmt(bps / 1e6 if bps else math.nan, ".0f")


def network_mode(results: dict[str, Any]) -> str:
    """What the ranks ran on, as ``results.md`` states it: the emulated network, or loopback and why."""
    if results["emulated"]:
        return "emulated network (namespaces, veth, bridge, tc tbf)"
    return f"LOOPBACK, NO RATE LIMIT ({results['loopback_reason']}): not a network measurement"


def network_column(emulated: bool) -> str:
    """The ``network`` column of the CSVs."""
    return "emulated" if emulated else "loopback-unlimited"


def machine_line(results: dict[str, Any]) -> str:
    """The machine of a run (``results["machine"]``) as ``results.md`` names it."""
    m = results["machine"]
    return (
        f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, kernel {m['kernel']}, Python {m['python']}, "
        f"torch {m['torch']}; load average at start {tuple(round(x, 2) for x in m['loadavg_start'])}"
    )


def process_age_s() -> float:
    """Seconds since this process started (Linux; 0 elsewhere): what a time budget for a whole command must count,
    the interpreter's start-up and the imports of torch included."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def form_switches(decisions: Sequence[Sequence[Any]]) -> str:
    """The form a pilot chose at its first decision and each change after it ("int8 d=0.025 @10").

    Args:
        decisions: ``(step, form name)`` per decision, in order.
    """
    changes = [(d[0], d[1]) for i, d in enumerate(decisions) if i == 0 or d[1] != decisions[i - 1][1]]
    return ", ".join(f"{form} @{step}" for step, form in changes)


def write_csv(path: str, rows: Sequence[dict[str, Any]]) -> None:
    """``rows`` as CSV; the columns are every key of every row, in the order they first appear."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def write_json(results: dict[str, Any], out: str) -> None:
    """``results`` as ``<out>/results.json`` (what is not JSON, as text)."""
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1, default=str)


def pyplot() -> Any | None:
    """matplotlib's ``pyplot`` on the file-only Agg backend; None (and a line saying so) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib).")
        return None
    return plt


def method_style(method: str, order: Sequence[str], reference: str | None = None) -> dict[str, Any]:
    """A method's line: tab10 colour by its place in ``order``, dashed for DDP's methods; ``reference``
    (compute-only) black and dotted."""
    import matplotlib

    if method == reference:
        return {"color": "black", "linestyle": ":"}
    i = order.index(method) if method in order else len(order)
    return {"color": matplotlib.colormaps["tab10"](i % 10), "linestyle": "--" if method.startswith("ddp") else "-"}
