"""Registers, spills, barriers and instructions of the selection kernel compiled for an H100 (sm_90), no GPU.

    python -m benchmarks.select_registers          # every selection kernel at C = 4096, d = 0.01
    python -m benchmarks.select_registers --all    # also C = 1024, 2048, 8192 and d = 0.1
    python -m benchmarks.select_registers --common-path  # the code a chunk of untied scores runs, alone

Compiles ``chunk_topk.py``'s ``_select_kernel`` as each value of ``LIGHTNING_SCAPE_SELECT_KERNEL`` runs it (the
default ``walk``, the alternatives ``prefilter`` and ``split``, and the split's second launch) with the triton
wheel's own ``ptxas`` for sm_90, with the 16-byte pointer alignment a real launch specializes on, and reads the
cubin with ``cuobjdump``:
registers per thread (65,536 registers / (32 x registers) decide the warps an SM keeps resident), stack
(spills), shared memory, the ``BAR`` instructions (block barriers: the cross-warp reductions' rounds) and all
SASS instructions in the code. These count the code, not how often it runs: the times are
``benchmarks/bench_kernels.py``'s, on a GPU. Written against triton 3.9's compile API (``ASTSource``,
``GPUTarget``).

The whole kernel holds its rare paths (a chunk of ties, many keys near the threshold, the walk giving up),
which decide its registers but rarely run. ``--common-path`` compiles a copy of ``chunk_topk.py`` with those
branches cut (:data:`RARE_BRANCHES`), so its instruction and barrier counts are what a chunk of untied scores
executes once through (the loops that step through keys near the threshold counted once).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from types import ModuleType
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# By module path: the package's ``chunk_topk`` attribute is the op, not its module.
select: Any = importlib.import_module("lightning_scape.kernels.chunk_topk")

SM90 = GPUTarget("cuda", 90, 32)
STAT = {"scores": 0, "momentum": 1, "gradient": 2}
CUDA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


# (text, replacement) in chunk_topk.py that cut the selection's rare branches (``--common-path``).
RARE_BRANCHES = (
    ("            if n_groups <= CAP_GROUPS:", "            if True:  # common path only"),
    ("        if n_above - k > 8:\n            t = _kth_key(key, k, 0)", "        if False:\n            t = lo"),
    ("        else:\n            t = _kth_key(key, k, LOW_BIT)\n        return t, walked", "        return t, walked"),
)


def common_path_module() -> ModuleType:
    """A copy of ``chunk_topk.py`` without :data:`RARE_BRANCHES`, imported as a module of the package."""
    path = select.__file__
    with open(path) as fh:
        text = fh.read()
    for old, new in RARE_BRANCHES:
        if old not in text:
            raise RuntimeError(f"{path} no longer holds {old!r}: update RARE_BRANCHES in {__file__}")
        text = text.replace(old, new)
    copy = os.path.join(tempfile.mkdtemp(), "chunk_topk_common_path.py")
    with open(copy, "w") as fh:
        fh.write(text)
    name = "lightning_scape.kernels.chunk_topk_common_path"
    spec = importlib.util.spec_from_file_location(name, copy)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # triton resolves the kernel's globals through the module
    spec.loader.exec_module(module)
    return module


def _aligned(n_pointers: int) -> dict[tuple[int, ...], list[list[Any]]]:
    """The first ``n_pointers`` arguments 16-byte aligned, as Triton specializes a launch on fresh tensors."""
    return {(i,): [["tt.divisibility", 16]] for i in range(n_pointers)}


def resident_warps(regs: int, warps: int) -> int:
    """Warps an sm_90 SM keeps resident by registers: 64K a SM, allocated 256 a warp; at most 64 warps."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(64, 65536 // (per_warp * warps) * warps)


def usage(compiled: Any) -> dict[str, int]:
    """Registers, stack (spills) and shared memory of a compiled kernel; its SASS and ``BAR`` instructions."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(compiled.asm["cubin"])
    tool = os.path.join(CUDA_BIN, "cuobjdump")
    try:
        res = subprocess.run([tool, "--dump-resource-usage", fh.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", fh.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(fh.name)
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", res, re.S)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{res}")
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    regs, stack, shared = map(int, m.groups())
    return {
        "regs": regs,
        "warps/SM": resident_warps(regs, compiled.metadata.num_warps),
        "stack": stack,
        "shared": shared,
        "sass": sum(op != "NOP" for op in ops),
        "BAR": sum(op.startswith("BAR") for op in ops),
    }


def compile_select(
    chunk: int, k: int, stat: str, dtype: str, kernel: str, module: ModuleType | None = None
) -> dict[str, int]:
    """``_select_kernel`` at its own launch configuration, as ``LIGHTNING_SCAPE_SELECT_KERNEL=kernel`` runs it.

    ``module``: where the kernel comes from (default ``chunk_topk.py``; :func:`common_path_module`).
    """
    module = module or select
    cfg = module._select_config(chunk, k, 4 if dtype == "fp32" else 2)
    cfg = cfg._replace(walk=kernel in ("walk", "split"), split=kernel == "split")
    sig = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "out_ptr": "*i16", "scratch_ptr": "*i32", "k": "i32",
           "k_explore": "i32", "offset": "i32", "beta1": "fp32", "one_minus_b1": "fp32"}  # fmt: skip
    const = {"C": chunk, "STAT": STAT[stat], "PREFILTER": cfg.prefilter, "VEC": cfg.vec, "CAP_GROUPS": cfg.cap_groups,
             "LOW_BIT": cfg.low_bit, "WALK": cfg.walk, "SPLIT": cfg.split}  # fmt: skip
    sig.update(dict.fromkeys(const, "constexpr"))
    options = {"num_warps": cfg.num_warps, "enable_fp_fusion": False}
    src = ASTSource(module._select_kernel, sig, const, _aligned(4))
    return {"warps": cfg.num_warps, **usage(triton.compile(src, target=SM90, options=options))}


def compile_rare(chunk: int, k: int, stat: str, dtype: str) -> dict[str, int]:
    """``_select_rare_kernel``, the split kernel's second launch (the chunks the prefilter cannot narrow)."""
    cfg = select._select_config(chunk, k, 4 if dtype == "fp32" else 2)
    sig = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "out_ptr": "*i16", "rare_ptr": "*i32", "k": "i32",
           "k_explore": "i32", "offset": "i32", "beta1": "fp32", "one_minus_b1": "fp32", "rows": "i32"}  # fmt: skip
    const = {"C": chunk, "STAT": STAT[stat], "WALK": True}
    sig.update(dict.fromkeys(const, "constexpr"))
    options = {"num_warps": cfg.num_warps, "enable_fp_fusion": False}
    src = ASTSource(select._select_rare_kernel, sig, const, _aligned(4))
    return {"warps": cfg.num_warps, **usage(triton.compile(src, target=SM90, options=options))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="more chunk sizes and a higher density")
    ap.add_argument("--common-path", action="store_true", help="the rare branches cut (see the module docstring)")
    args = ap.parse_args(argv)
    module = common_path_module() if args.common_path else select
    cases = [(4096, 41, "momentum", "fp32"), (4096, 41, "scores", "fp32"), (4096, 41, "scores", "bf16")]
    if args.all:
        cases += [(1024, 10, "momentum", "fp32"), (2048, 20, "momentum", "fp32"), (8192, 82, "momentum", "fp32"),
                  (4096, 410, "momentum", "fp32")]  # fmt: skip
    for chunk, k, stat, dtype in cases:
        name = f"C={chunk} k={k} {stat} {dtype}"
        for kernel in select.SELECT_KERNELS:
            print(f"{name:<32} {kernel:<10} {compile_select(chunk, k, stat, dtype, kernel, module)}", flush=True)
        if not args.common_path:
            print(f"{name:<32} {'split, 2nd':<10} {compile_rare(chunk, k, stat, dtype)}", flush=True)


if __name__ == "__main__":
    main()
