"""Runs a test module's multi-process scenarios: ``python _launch_scenarios.py <module> <launch> <outdir> [args]``.

Every process of the launch (Lightning's launcher re-runs this command for rank 1; torchrun or a test starts
the others) imports the test module ``<module>``, which registers its scenarios with
:func:`helpers.scenario`, and runs those registered under ``<launch>`` in the order they are defined, each
as ``fn(outdir, *args)``. Later scenarios may use files that earlier ones wrote under ``outdir``.
"""

from __future__ import annotations

import importlib
import sys

import torch

torch.set_num_threads(1)

from helpers import SCENARIOS  # noqa: E402


def main() -> None:
    """Import the module named on the command line and run its scenarios of the named launch."""
    module, launch, outdir, *args = sys.argv[1:]
    importlib.import_module(module)
    scenarios = SCENARIOS.get(launch)
    if not scenarios:
        raise SystemExit(f"{module} registers no scenario for the launch {launch!r}; it has {sorted(SCENARIOS)}")
    for run in scenarios:
        run(outdir, *args)


if __name__ == "__main__":
    main()
