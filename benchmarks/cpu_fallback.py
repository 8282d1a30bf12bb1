"""Where a GPU command runs without a GPU: it stops, or, with ``--tiny``, runs its code path on the CPU (the test
of the command in CI), with the Triton kernels in Triton's interpreter where it launches them."""

from __future__ import annotations

import os
import sys

import torch


def cpu_fallback(tiny: bool, interpret_kernels: bool) -> int | None:
    """Decide how a GPU command goes on: None to go on (CUDA, or ``--tiny`` on the CPU), else its exit status.

    Args:
        tiny: The command's ``--tiny``: on the CPU, run its code path (not a measurement).
        interpret_kernels: On the CPU, set ``TRITON_INTERPRET=1`` for the kernels it launches; Triton reads it when
            the kernels are decorated, so triton must not have been imported yet (else exit status 2).
    """
    if torch.cuda.is_available():
        return None
    if not tiny:
        how = ", with the kernels in Triton's interpreter." if interpret_kernels else "."
        print(f"No CUDA GPU (torch.cuda.is_available() is False): nothing to measure. --tiny runs this command's code "
              f"path on the CPU{how}")  # fmt: skip
        return 0
    if interpret_kernels:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("triton was imported before TRITON_INTERPRET=1 could be set; run this command in a fresh process")
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before their first import
    return None
