"""Registers, spills and barriers of the selection kernels compiled for an H100 (sm_90), without a GPU.

    python -m benchmarks.select_registers          # the current kernel and the candidate at C = 4096, d = 0.01
    python -m benchmarks.select_registers --all    # also C = 1024, 2048, 8192, d = 0.1 and the tile sweep

Compiles ``chunk_topk.py``'s ``_select_kernel`` and the candidate ``chunk_topk_stream.py``'s ``_stream_kernel``
with the triton wheel's own ``ptxas`` for sm_90, with the 16-byte pointer alignment a real launch specializes on
(without it nothing vectorizes and the counts mean little), and reads the cubin's resource usage with
``cuobjdump``. Registers per thread decide how many warps an SM keeps resident (65,536 registers / (32 x
registers)); ``bar.sync`` counts the block barriers in the code (cross-warp reductions), not how often they run.
This is what can be known without a GPU: the times are ``benchmarks/bench_kernels.py``'s, on one. Written against
triton 3.9's compile API (``ASTSource``, ``GPUTarget``).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# By module path: the package's ``chunk_topk`` attribute is the op, not its module.
current: Any = importlib.import_module("lightning_scape.kernels.chunk_topk")
stream: Any = importlib.import_module("lightning_scape.kernels.chunk_topk_stream")

SM90 = GPUTarget("cuda", 90, 32)
STAT = {"scores": 0, "momentum": 1, "gradient": 2}


def _aligned(n_pointers: int) -> dict[tuple[int, ...], list[list[Any]]]:
    """The first ``n_pointers`` arguments 16-byte aligned, as Triton specializes a launch on fresh tensors."""
    return {(i,): [["tt.divisibility", 16]] for i in range(n_pointers)}


def usage(compiled: Any) -> dict[str, int]:
    """Registers, stack (spills), shared memory of a compiled kernel, and its ``bar.sync`` count."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
        out = subprocess.run([tool, "--dump-resource-usage", fh.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(fh.name)
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", out, re.S)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{out}")
    ops = collections.Counter(re.findall(r"\bbar\.sync\b|\bld\.global\.v4", compiled.asm["ptx"]))
    regs, stack, shared = map(int, m.groups())
    return {
        "regs": regs,
        "stack": stack,
        "shared": shared,
        "bar.sync": ops["bar.sync"],
        "v4 loads": ops["ld.global.v4"],
    }


def compile_current(chunk: int, k: int, stat: str, dtype: str, num_warps: int | None = None) -> dict[str, int]:
    """The current kernel (its own launch configuration, or ``num_warps``)."""
    cfg = current._select_config(chunk, k, 4 if dtype == "fp32" else 2)
    sig = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "out_ptr": "*i16", "scratch_ptr": "*i32", "k": "i32",
           "k_explore": "i32", "offset": "i32", "beta1": "fp32", "one_minus_b1": "fp32"}  # fmt: skip
    const = {"C": chunk, "STAT": STAT[stat], "PREFILTER": cfg.prefilter, "VEC": cfg.vec, "CAP_GROUPS": cfg.cap_groups,
             "LOW_BIT": cfg.low_bit}  # fmt: skip
    sig.update(dict.fromkeys(const, "constexpr"))
    options = {"num_warps": num_warps or cfg.num_warps, "enable_fp_fusion": False}
    return usage(triton.compile(ASTSource(current._select_kernel, sig, const, _aligned(4)), target=SM90,
                                options=options))  # fmt: skip


def compile_stream(chunk: int, k: int, stat: str, dtype: str, values_per_thread: int | None = None) -> dict[str, int]:
    """The candidate (its own configuration, with ``values_per_thread`` per tile if given)."""
    old = stream.VALUES_PER_THREAD
    stream.VALUES_PER_THREAD = values_per_thread or old
    try:
        cfg = stream._stream_config(chunk, k, 4 if dtype == "fp32" else 2)
    finally:
        stream.VALUES_PER_THREAD = old
    if cfg is None:
        raise ValueError(f"C={chunk}, k={k}: the candidate launches the current kernel here")
    sig = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "out_ptr": "*i16", "scratch_ptr": "*i32", "next_row_ptr": "*i32",
           "rows": "i32", "k": "i32", "k_explore": "i32", "offset": "i32", "beta1": "fp32",
           "one_minus_b1": "fp32"}  # fmt: skip
    const = {"C": chunk, "STAT": STAT[stat], "GROUP": cfg.group, "TILE": cfg.tile, "CAP_GROUPS": cfg.cap_groups,
             "LOW": stream.LOW_BIT}  # fmt: skip
    sig.update(dict.fromkeys(const, "constexpr"))
    options = {"num_warps": cfg.num_warps, "enable_fp_fusion": False}
    out = usage(triton.compile(ASTSource(stream._stream_kernel, sig, const, _aligned(5)), target=SM90,
                               options=options))  # fmt: skip
    return {"warps": cfg.num_warps, "tile": cfg.tile, **out}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="more chunk sizes and densities, and the tile sweep")
    args = ap.parse_args(argv)
    cases = [(4096, 41, "momentum", "fp32"), (4096, 41, "scores", "fp32"), (4096, 41, "scores", "bf16")]
    if args.all:
        cases += [(1024, 10, "momentum", "fp32"), (2048, 20, "momentum", "fp32"), (8192, 82, "momentum", "fp32"),
                  (4096, 410, "momentum", "fp32")]  # fmt: skip
    for chunk, k, stat, dtype in cases:
        name = f"C={chunk} k={k} {stat} {dtype}"
        print(f"{name:<32} current (its warps):    {compile_current(chunk, k, stat, dtype)}", flush=True)
        print(f"{name:<32} candidate:              {compile_stream(chunk, k, stat, dtype)}", flush=True)
        if args.all and chunk == 4096 and k == 41:
            for warps in (1, 2):
                print(f"{name:<32} current, {warps} warp(s):    {compile_current(chunk, k, stat, dtype, warps)}")
            print(f"{name:<32} candidate, 8 values/thread: {compile_stream(chunk, k, stat, dtype, 8)}", flush=True)


if __name__ == "__main__":
    main()
