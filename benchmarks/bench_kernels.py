"""Achieved memory bandwidth of each SCAPE kernel, and the whole sparse step against fused AdamW (CUDA).

    python benchmarks/bench_kernels.py                          # kernels at 2**28 values; step at 1e8, 1e9
    python benchmarks/bench_kernels.py --sizes 1e8 --dtype bf16 # skip 1e9 (about 20 GB at fp32)
    python benchmarks/bench_kernels.py --peak-gbps 3350         # device not in the peak table
    python benchmarks/bench_kernels.py --compare-ref            # also time the pure-PyTorch refs on the GPU
    python benchmarks/bench_kernels.py --select walk            # only the default selection kernel

Per kernel: the bytes it must move (formulas in docs/kernels.md), the median time over ``--iters`` launches
measured with CUDA events, the achieved GB/s and its fraction of the GPU's peak DRAM bandwidth (from the
table below by device name, or ``--peak-gbps``). The whole sparse optimizer step at W = 1 is
ef_compact + sparse_adams + select_mask + scatter_decay on N parameters at density d (the collectives of
W > 1 are not part of it), compared with ``torch.optim.AdamW(fused=True)`` and the dense AdamS kernel on
the same N. Without a CUDA GPU the script says so, runs the code path on a tiny CPU size with the refs
(not a measurement) and exits 0.

The selection (``select_mask``, ``chunk_topk``) has two alternative kernels behind
``LIGHTNING_SCAPE_SELECT_KERNEL`` (``prefilter``, the former default, and ``split``;
``lightning_scape/kernels/chunk_topk.py``). ``--select all``
(the default) checks them against the refs with the other kernels (``--check``) and times them against the
default in alternating rounds (``--rounds``; medians of the rounds, and the median of the per-round ratios): on
the kernel table's problem, on an all-zero state (a chunk of ties), on heavy-tailed scores (the walk gives up
and bisects), and inside the whole sparse step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

import lightning_scape.kernels as K
from lightning_scape.config import INT8_DENSE_GROUP

# Peak DRAM bandwidth in GB/s (1e9 B/s) by a substring of torch.cuda.get_device_name(); the longest
# matching substring wins (so "GH200" beats "H200"). Vendor datasheet figures.
PEAK_GBPS: dict[str, float] = {
    "B200": 8000.0,
    "GH200": 4000.0,  # 96 GB HBM3; the 144 GB HBM3e part has 4900: pass --peak-gbps
    "H200": 4800.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,  # SXM5 80 GB HBM3
    "H800": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L40": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
    "A10": 600.0,
    "RTX 4090": 1008.0,
    "RTX 3090": 936.0,
    "V100": 900.0,
    "T4": 320.0,
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPS = ("ef_compact", "sparse_adams", "select_mask", "chunk_topk", "scatter_decay", "dense_adams", "round_int8")
# The tensors of a Problem, and the ops whose kernel must equal the ref bit for bit (the others are
# AdamS arithmetic: equal up to the last bits).
STATE = (
    *("params", "grads", "residual", "momentum", "last_sent", "values", "new_values", "mask", "topk"),
    *("codes", "scales"),
)
EXACT_OPS = ("ef_compact", "select_mask", "chunk_topk", "scatter_decay", "round_int8")
INT8_GROUP = INT8_DENSE_GROUP  # a dense step's coordinates per scale in the int8 wire
# The selection kernels (LIGHTNING_SCAPE_SELECT_KERNEL): the default, then the alternatives.
SELECT_ENV = "LIGHTNING_SCAPE_SELECT_KERNEL"
CURRENT, ALTERNATIVES = "walk", ("prefilter", "split")
SELECT_OPS = ("select_mask", "chunk_topk")
CPU_SMOKE_NUMEL = 1 << 14  # values per op in the CPU smoke run (no GPU)


@dataclass
class Row:
    """One timed operation."""

    name: str
    numel: int
    path: str
    median_ms: float
    bytes_moved: int

    @property
    def gbps(self) -> float:
        return self.bytes_moved / (self.median_ms * 1e-3) / 1e9


def peak_gbps(device_name: str, override: float | None) -> float | None:
    """The device's peak DRAM bandwidth: ``override``, else the longest table key found in the name."""
    if override is not None:
        return override
    hits = [key for key in PEAK_GBPS if key in device_name]
    return PEAK_GBPS[max(hits, key=len)] if hits else None


def time_cuda(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_cpu(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median milliseconds of ``fn`` on the CPU (perf_counter)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class Problem:
    """The tensors of one rank's sparse step on ``numel`` parameters (W = 1: region = shard = bucket)."""

    def __init__(
        self, numel: int, chunk_size: int, density: float, exploration: float, dtype: torch.dtype, device: str
    ):
        C = chunk_size
        self.C = C
        self.rows = -(-numel // C)
        self.N = self.rows * C  # padded to whole chunks, as the engine's buckets are
        self.k = max(1, round(density * C))
        self.ke = min(self.k, round(exploration * self.k))
        self.S = self.rows * self.k
        self.dtype = dtype
        self.bp = torch.empty(0, dtype=dtype).element_size()
        self.bs = 4  # fp32 residual and momentum
        gen = torch.Generator(device=device).manual_seed(0)
        self.params = torch.randn(self.N, generator=gen, device=device).to(dtype)
        self.grads = (torch.randn(self.N, generator=gen, device=device) * 1e-3).to(dtype)
        self.residual = torch.randn(self.N, generator=gen, device=device) * 1e-3
        self.momentum = torch.randn(self.N, generator=gen, device=device) * 1e-3
        self.last_sent = torch.zeros(self.N, dtype=torch.int32, device=device)
        self.values = torch.zeros(self.S, dtype=dtype, device=device)
        self.new_values = torch.zeros(self.S, dtype=dtype, device=device)
        self.mask = K.select_mask(self.momentum, self.residual, 0.9, "momentum", C, self.k, self.ke, 0)
        self.topk = self.mask
        self.codes = torch.zeros(self.N, dtype=torch.int8, device=device)
        self.scales = torch.zeros(self.N // INT8_GROUP if self.N % INT8_GROUP == 0 else 0, device=device)
        self.step_no = 10

    def clone(self) -> Problem:
        """A copy with its own tensors (for running an op twice from the same state)."""
        other = copy.copy(self)
        for name in STATE:
            setattr(other, name, getattr(self, name).clone())
        return other

    # ------------------------------------------------------------ the four ops of a sparse step

    def ef_compact(self) -> None:
        K.ef_compact(self.residual, self.grads, self.mask, self.C, self.values)

    def sparse_adams(self) -> None:
        K.sparse_adams(
            self.params,
            self.momentum,
            self.last_sent,
            self.values,
            self.mask,
            self.C,
            self.new_values,
            K.AdamSHyper(step=self.step_no, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1),
        )

    def select_mask(self) -> None:
        self.mask = K.select_mask(self.momentum, self.residual, 0.9, "momentum", self.C, self.k, self.ke, 3)

    def chunk_topk(self) -> None:
        self.topk = K.chunk_topk(self.momentum, self.C, self.k, self.ke, 3)

    def scatter_decay(self) -> None:
        K.scatter_decay(self.params, self.new_values, self.mask, self.C, 1.0 - 1e-4 * 0.1)

    def dense_adams(self) -> None:
        K.dense_adams(
            self.params,
            self.momentum,
            self.grads,
            K.AdamSHyper(step=self.step_no, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1),
        )

    def round_int8(self) -> None:
        """The int8 wire's rounding of a dense step's values (the residual stands in for ``e + g``)."""
        if self.scales.numel():
            K.round_int8(self.residual, INT8_GROUP, self.codes, self.scales)

    def sparse_step(self) -> None:
        """One sparse SCAPE step at W = 1: send, update the slots, next mask, decay + scatter."""
        self.ef_compact()
        self.sparse_adams()
        self.select_mask()
        self.scatter_decay()

    # ------------------------------------------------------------ bytes each op must move

    def bytes(self, op: str) -> int:
        """Bytes read + written by ``op`` (docs/kernels.md); slot accesses count their useful bytes."""
        N, S, bp, bs = self.N, self.S, self.bp, self.bs
        table = {
            # read e, g; write e; per slot: read index, re-read a, write v, write e
            "ef_compact": N * (2 * bs + bp) + S * (2 + bs + bp + bs),
            # per slot: index, theta, m, last_sent, gbar in; out, m, last_sent out
            "sparse_adams": S * (2 + bp + bs + 4 + bp) + S * (bp + bs + 4),
            # read m, e; write k int16 indices per chunk
            "select_mask": N * 2 * bs + 2 * S,
            # read the fp32 scores; write the indices
            "chunk_topk": N * 4 + 2 * S,
            # read + write the replica; per slot: index, value in, parameter out
            "scatter_decay": N * 2 * bp + S * (2 + bp + bp),
            # read theta, g, m; write theta, m
            "dense_adams": N * (2 * bp + bp + 2 * bs),
            # read and write x (its rounding error); write the codes and one scale per group
            "round_int8": N * (2 * bs + 1) + 4 * N // INT8_GROUP,
            # read theta, g, exp_avg, exp_avg_sq; write theta, exp_avg, exp_avg_sq (state in param dtype)
            "adamw_fused": N * (2 * bp + bp + 4 * bp),
        }
        table["sparse_step"] = sum(table[o] for o in ("ef_compact", "sparse_adams", "select_mask", "scatter_decay"))
        return table[op]

    def path(self) -> str:
        return "triton" if K.use_triton(self.params) else "ref"


def adamw_fused(numel: int, dtype: torch.dtype, device: str) -> tuple[Callable[[], object], list[Tensor]]:
    """A fused AdamW step on one flat parameter of ``numel`` values (state allocated outside the clock)."""
    p = torch.nn.Parameter(torch.randn(numel, device=device).to(dtype))
    p.grad = (torch.randn(numel, device=device) * 1e-3).to(dtype)
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, fused=device.startswith("cuda"))
    opt.step()
    return opt.step, [p]


def print_rows(title: str, rows: list[Row], peak: float | None, bandwidth: bool = True) -> None:
    """A table of ``rows``; ``bandwidth=False`` leaves out GB/s (a CPU smoke run measures nothing)."""
    print(f"\n{title}")
    head = f"{'op':<42} {'path':<7} {'numel':>13} {'median ms':>10} {'MB moved':>10}"
    print(head + (f" {'GB/s':>8} {'% peak':>7}" if bandwidth else ""))
    for r in rows:
        line = f"{r.name:<42} {r.path:<7} {r.numel:>13,} {r.median_ms:>10.3f} {r.bytes_moved / 1e6:>10.1f}"
        if bandwidth:
            pct = f"{100 * r.gbps / peak:6.1f}%" if peak else "    n/a"
            line += f" {r.gbps:>8.1f} {pct:>7}"
        print(line)


def free_bytes() -> int:
    """Free GPU memory after releasing the caching allocator's blocks."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def run(args: argparse.Namespace, device: str) -> dict[str, object]:
    """The kernel table and the step comparison on ``device``.

    On ``"cpu"`` (no GPU) the same code runs on 2**16 values with the refs, as a smoke test of this
    script: nothing is reported as a measurement.
    """
    cuda = device == "cuda"
    dtype = DTYPES[args.dtype]
    timer = time_cuda if cuda else time_cpu
    iters, warmup = (args.iters, args.warmup) if cuda else (min(args.iters, 3), min(args.warmup, 1))
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_gbps(name, args.peak_gbps) if cuda else None
    if cuda:
        print(
            f"device {name}, peak {peak if peak else 'unknown (pass --peak-gbps)'} GB/s, torch {torch.__version__}, "
            f"dtype {args.dtype}, d={args.density}, C={args.chunk_size}, {iters} timed launches (median)"
        )
        if not K.use_triton(torch.empty(1, device=device)):
            print("note: the dispatcher runs the refs (LIGHTNING_SCAPE_FORCE_REF=1 or no triton): timing the refs")
    results: dict[str, object] = {"device": name, "peak_gbps": peak, "args": vars(args)}

    # Per-kernel bandwidth on one problem (the selection ops on the kernel --select names; all: the default).
    # Without a GPU, a smoke run of the code path: four chunks of C = 4096 (Triton's interpreter runs the
    # selection's threshold walk about 10x slower than a bisection: seconds a launch at sixteen).
    kernel_numel = int(args.kernel_numel) if cuda else CPU_SMOKE_NUMEL
    prob = Problem(kernel_numel, args.chunk_size, args.density, args.exploration, dtype, device)
    with select_kernel(CURRENT if args.select == "all" else args.select):
        rows = [Row(op, prob.N, prob.path(), timer(getattr(prob, op), iters, warmup), prob.bytes(op)) for op in OPS]
    if args.compare_ref and cuda:
        with forced_ref():
            rows += [Row(op, prob.N, "ref", timer(getattr(prob, op), iters, warmup), prob.bytes(op)) for op in OPS]
    title = f"kernels (k={prob.k} of C={prob.C}, k_explore={prob.ke})"
    if not cuda:
        title = "CPU smoke run of the code path (tiny size, refs or forced interpreter): NOT a measurement; " + title
    print_rows(title, rows, peak, bandwidth=cuda)
    results["kernels"] = [asdict(r) | {"gbps": r.gbps} for r in rows]

    # The whole sparse step against fused AdamW (and the dense AdamS kernel of the warm-up steps).
    all_steps: list[Row] = []
    for size in args.sizes if cuda else [CPU_SMOKE_NUMEL]:
        rows = step_rows(int(size), args, device)
        all_steps += rows
        for scape in rows if cuda else []:
            if scape.name.startswith("SCAPE sparse step"):
                print(
                    f"\nN={scape.numel:,}: {scape.name} / fused AdamW step = {scape.median_ms / rows[-1].median_ms:.3f}"
                )
    if all_steps:
        title = f"optimizer step at d={args.density}"
        if not cuda:
            title = "CPU smoke run (tiny size): NOT a measurement; " + title
        print_rows(title, all_steps, peak, bandwidth=cuda)
    results["steps"] = [asdict(r) | {"gbps": r.gbps} for r in all_steps]
    if args.select == "all":  # last: whatever an alternative does, the default's numbers are in already
        rounds = args.rounds if cuda else 1  # on the CPU a smoke run of the code path: one round is all it needs
        results["selection"] = guarded([], compare_selection, prob, timer, (iters, warmup, rounds), peak, cuda)
    return results


def guarded(fallback: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or ``fallback`` when it raises (said in one line): an alternative kernel's failure is a result of
    its own, and the rest of the run goes on."""
    try:
        return fn(*args)
    except Exception as exc:  # an alternative that does not compile or run on this device
        print(f"a alternative selection kernel failed here: {type(exc).__name__}: {exc}")
        return fallback


def step_rows(n: int, args: argparse.Namespace, device: str) -> list[Row]:
    """The SCAPE sparse step, the dense AdamS kernel and fused AdamW on ``n`` parameters, timed on ``device``.

    ``args`` as :func:`build_parser` reads them (dtype, density, chunk size, exploration, iterations). Returns
    the three rows, the sparse step first and AdamW last; none when the GPU lacks the memory (said so).
    """
    cuda = device == "cuda"
    dtype = DTYPES[args.dtype]
    timer = time_cuda if cuda else time_cpu
    iters, warmup = (args.iters, args.warmup) if cuda else (min(args.iters, 3), min(args.warmup, 1))
    bp = torch.empty(0, dtype=dtype).element_size()
    need = n * (2 * bp + 12) * 1.05  # params, grads, residual, momentum, last_sent (+ the slots)
    if cuda and free_bytes() < need:
        print(f"\nskipping N={n:,}: needs about {need / 2**30:.1f} GiB, {free_bytes() / 2**30:.1f} GiB free")
        return []
    prob = Problem(n, args.chunk_size, args.density, args.exploration, dtype, device)
    kernel = CURRENT if args.select == "all" else args.select
    with select_kernel(kernel):
        ms = timer(prob.sparse_step, iters, warmup)
    scapes = [Row("SCAPE sparse step" + ("" if kernel == CURRENT else f" [{kernel}]"), prob.N, prob.path(), ms, 0)]
    dense = Row("dense AdamS (dense_adams)", prob.N, prob.path(), timer(prob.dense_adams, iters, warmup), 0)
    dense.bytes_moved = prob.bytes("dense_adams")
    for name in ALTERNATIVES if args.select == "all" else ():  # after the default's: see guarded()
        ms = guarded(None, _timed_with, name, prob.sparse_step, timer, iters, warmup)
        if ms is not None:
            scapes.append(Row(f"SCAPE sparse step [{name}]", prob.N, prob.path(), ms, 0))
    for row in scapes:
        row.bytes_moved = prob.bytes("sparse_step")
    adamw_bytes = prob.bytes("adamw_fused")
    del prob
    step, keep = adamw_fused(n, dtype, device)
    label = "torch AdamW(fused=True)" if cuda else "torch AdamW (CPU, not fused)"
    adamw = Row(label, n, "torch", timer(step, iters, warmup), adamw_bytes)
    del step, keep
    return [*scapes, dense, adamw]


def _timed_with(
    kernel: str,
    fn: Callable[[], object],
    timer: Callable[[Callable[[], object], int, int], float],
    iters: int,
    warmup: int,
) -> float:
    """``timer(fn)`` with the selection kernel ``kernel``."""
    with select_kernel(kernel):
        return timer(fn, iters, warmup)


def compare_selection(
    prob: Problem,
    timer: Callable[[Callable[[], object], int, int], float],
    counts: tuple[int, int, int],
    peak: float | None,
    cuda: bool,
) -> list[dict[str, Any]]:
    """The default and the alternative selection kernels timed in alternating rounds on ``prob``'s state.

    Cases: ``select_mask`` and ``chunk_topk`` as in the kernel table, ``select_mask`` on an all-zero state (every
    chunk one tie: the split kernel's second launch takes them all) and on heavy-tailed state (each chunk's
    largest value 64x the rest: the walk gives up and bisects, its worst case). Each round times the default,
    then each alternative (``iters`` launches each, their median).

    Args:
        prob: The kernel table's problem.
        timer: ``time_cuda`` or ``time_cpu``.
        counts: Timed launches per kernel and round, untimed warm-up launches, rounds.
        peak: The device's peak GB/s (None: unknown).
        cuda: Whether this is a measurement (False: the CPU smoke run).

    Returns:
        Per case: the medians over the rounds (ms) of each kernel, its GB/s, and per alternative the median of the
        per-round ratios of its time to the default's (``over_current``; below 1: faster).
    """
    iters, warmup, rounds = counts
    zeros = torch.zeros_like(prob.momentum)
    heavy = prob.momentum.clone()
    heavy.view(-1, prob.C)[:, prob.C // 2] = 64 * float(prob.momentum.abs().max())
    args = (0.9, "momentum", prob.C, prob.k, prob.ke, 3)
    cases: dict[str, tuple[Callable[[], object], int]] = {
        "select_mask": (prob.select_mask, prob.bytes("select_mask")),
        "chunk_topk": (prob.chunk_topk, prob.bytes("chunk_topk")),
        "select_mask, all-zero state": (lambda: K.select_mask(zeros, zeros, *args), prob.bytes("select_mask")),
        "select_mask, heavy tails": (lambda: K.select_mask(heavy, prob.residual, *args), prob.bytes("select_mask")),
    }
    rows: list[Row] = []
    out: list[dict[str, Any]] = []
    for case, (fn, nbytes) in cases.items():
        times: dict[str, list[float]] = {name: [] for name in (CURRENT, *ALTERNATIVES)}
        for _ in range(rounds):
            for name, series in times.items():
                with select_kernel(name):
                    series.append(timer(fn, iters, warmup))
        ratios = {name: statistics.median(c / p for p, c in zip(times[CURRENT], times[name], strict=True))
                  for name in ALTERNATIVES}  # fmt: skip
        medians = {name: statistics.median(t) for name, t in times.items()}
        rows += [Row(f"{case} [{name}]", prob.N, prob.path(), ms, nbytes) for name, ms in medians.items()]
        gbps = {name: nbytes / (ms * 1e-3) / 1e9 for name, ms in medians.items()}
        out.append({"case": case, "rounds": rounds, "median_ms": medians, "gbps": gbps,
                    "over_current": ratios})  # fmt: skip
    title = f"selection: the default and the alternatives ({', '.join(ALTERNATIVES)}), {rounds} alternating rounds"
    if not cuda:
        title = "CPU smoke run (tiny size): NOT a measurement; " + title
    print_rows(title, rows, peak, bandwidth=cuda)
    if cuda:
        for r in out:
            for name, ratio in r["over_current"].items():
                print(f"  {r['case']}: {name} / {CURRENT} = {ratio:.3f} (the median of the per-round ratios)")
    return out


# (chunk size, density, rows) of the problems check() runs: tiny to the largest chunks, odd row counts.
CHECK_CASES: tuple[tuple[int, float, int], ...] = ((64, 0.1, 1001), (4096, 0.01, 33), (4096, 1.0, 3), (32768, 0.01, 3))


def check(
    device: str, dtype: torch.dtype, exploration: float, cases: tuple[tuple[int, float, int], ...] = CHECK_CASES
) -> list[str]:
    """Every dispatched op (the kernels, on CUDA) against its ref from the same state; returns the failures.

    The test suite checks the kernels in Triton's CPU interpreter; this checks the compiled kernels on
    the GPU. Indices, error feedback and scatter/decay must be equal; the AdamS ops close.
    """
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (8e-3, 1e-5)
    failures = []
    for C, density, rows in cases:
        base = Problem(rows * C, C, density, exploration, dtype, device)
        base.values.normal_()  # the averaged slot values sparse_adams reads
        base.new_values.normal_()  # the new slot values scatter_decay writes
        for op in OPS:
            failures += compare_op(base, op, CURRENT, f"C={C}, d={density}, {rows} rows", (rtol, atol))
        print(f"checked C={C} d={density} rows={rows} on {device} ({base.path()} vs ref)")
    return failures if device == "cpu" else failures + check_hard_selection(device, dtype, (CURRENT,))


def check_alternatives(
    device: str, dtype: torch.dtype, exploration: float, cases: tuple[tuple[int, float, int], ...] = CHECK_CASES
) -> list[str]:
    """The alternative selection kernels (:data:`ALTERNATIVES`) against the refs, as :func:`check` checks the default,
    and on :func:`hard_scores` (on CUDA); the failures, an alternative that raises among them (one line)."""
    failures = []
    for C, density, rows in cases:
        base = Problem(rows * C, C, density, exploration, dtype, device)
        for name in ALTERNATIVES:
            for op in SELECT_OPS:
                where = f"C={C}, d={density}, {rows} rows"
                failures += guarded([f"{op}[{name}] raised"], compare_op, base, op, name, where, (0.0, 0.0))
    print(f"checked the alternative selection kernels ({', '.join(ALTERNATIVES)}) on {device}")
    return failures if device == "cpu" else failures + check_hard_selection(device, dtype, ALTERNATIVES)


def compare_op(base: Problem, op: str, kernel: str, where: str, tolerance: tuple[float, float]) -> list[str]:
    """``op`` on the dispatched path (with selection kernel ``kernel``) against its ref from ``base``'s state.

    Returns:
        One line per tensor that differs (the exact ops: at all; the AdamS arithmetic: beyond ``(rtol, atol)``).
    """
    rtol, atol = tolerance
    mine, ref = base.clone(), base.clone()
    with select_kernel(kernel):
        getattr(mine, op)()
    with forced_ref():
        getattr(ref, op)()
    label = op if kernel == CURRENT else f"{op}[{kernel}]"
    failures = []
    for name in STATE:
        a, b = getattr(mine, name), getattr(ref, name)
        if op in EXACT_OPS or not a.is_floating_point():
            ok = torch.equal(a, b)
        else:
            ok = torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol)
        if not ok:
            failures.append(f"{label} ({where}): {name} differs in {int((a != b).sum())} values")
    return failures


def hard_scores(rows: int, chunk_size: int, k: int, gen: torch.Generator) -> dict[str, Tensor]:
    """fp32 scores (on the CPU) that take each path of the selection kernel after its group-maximum prefilter.

    ``zeros``: every key tied; ``shared``: one 16-bit bin (the low bits decide); ``packed``: the top k in a few
    adjacent groups; ``outlier4`` / ``outlier5``: each chunk's largest value 4 and 5 binades above the rest (the
    threshold search walks its last binade, or bisects instead). ``tests/test_kernels.py`` runs such scores in
    the interpreter.
    """
    C = chunk_size
    shared = 1.0 + 1e-6 * torch.randn(rows * C, generator=gen).abs()
    packed = torch.rand(rows * C, generator=gen) * 1e-3
    packed.view(rows, C)[:, 100 : 100 + k + 5] += torch.rand(rows, k + 5, generator=gen) + 1.0
    outliers = {f"outlier{b}": 1.0 + torch.rand(rows * C, generator=gen) for b in (4, 5)}
    for b, scores in zip((4, 5), outliers.values(), strict=True):
        scores.view(rows, C)[:, 7] = 2.0**b + 1.0
    return {"zeros": torch.zeros(rows * C), "shared": shared, "packed": packed, **outliers}


def check_hard_selection(device: str, dtype: torch.dtype, kernels: tuple[str, ...], rows: int = 7) -> list[str]:
    """The selection ``kernels`` against the refs on :func:`hard_scores` (C = 1024 and 4096); the failures."""
    failures = []
    for C, k in ((1024, 10), (4096, 41)):
        gen = torch.Generator().manual_seed(C)
        for name, cpu_scores in hard_scores(rows, C, k, gen).items():
            s = cpu_scores.to(device=device, dtype=dtype)
            m = s.float()
            for ke, off in ((0, 0), (max(1, k // 10), C - 1)):
                with forced_ref():
                    want = (K.chunk_topk(s, C, k, ke, off), K.select_mask(m, 0 * m, 0.9, "momentum", C, k, ke, off))
                for search in kernels:
                    got = guarded(None, _selections, search, s, m, C, k, ke, off)
                    for op, g, w in zip(SELECT_OPS[::-1], got or (None, None), want, strict=True):
                        if g is None or not torch.equal(g, w):
                            failures.append(f"{op}[{search}] ({name}, C={C}, k={k}, k_explore={ke}) differs")
    print(f"checked the selection kernels {', '.join(kernels)} on hard scores on {device}")
    return failures


def _selections(kernel: str, s: Tensor, m: Tensor, C: int, k: int, ke: int, off: int) -> tuple[Tensor, Tensor]:  # noqa: N803
    """``chunk_topk`` of scores ``s`` and ``select_mask`` of momentum ``m`` (zero residual), on ``kernel``."""
    with select_kernel(kernel):
        return K.chunk_topk(s, C, k, ke, off), K.select_mask(m, 0 * m, 0.9, "momentum", C, k, ke, off)


@contextlib.contextmanager
def select_kernel(name: str) -> Iterator[None]:
    """Temporarily set ``LIGHTNING_SCAPE_SELECT_KERNEL`` to ``name`` (the selection kernel the entry points run)."""
    old = os.environ.get(SELECT_ENV)
    os.environ[SELECT_ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(SELECT_ENV, None)
        else:
            os.environ[SELECT_ENV] = old


@contextlib.contextmanager
def forced_ref() -> Iterator[None]:
    """Temporarily set ``LIGHTNING_SCAPE_FORCE_REF=1`` (the dispatcher then runs the refs on CUDA too)."""
    old = os.environ.get("LIGHTNING_SCAPE_FORCE_REF")
    os.environ["LIGHTNING_SCAPE_FORCE_REF"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LIGHTNING_SCAPE_FORCE_REF", None)
        else:
            os.environ["LIGHTNING_SCAPE_FORCE_REF"] = old


def build_parser() -> argparse.ArgumentParser:
    """The command line (``benchmarks/gpu_check.py`` reads its defaults)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel-numel", type=float, default=2**28, help="values per kernel in the bandwidth table")
    ap.add_argument(
        "--sizes", type=lambda s: [float(x) for x in s.split(",")], default=[1e8, 1e9],
        help="comma-separated parameter counts for the step comparison (default 1e8,1e9)",
    )  # fmt: skip
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--exploration", type=float, default=0.1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter/gradient dtype")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peak-gbps", type=float, default=None, help="peak DRAM bandwidth, GB/s (overrides the table)")
    ap.add_argument("--compare-ref", action="store_true", help="also time the pure-PyTorch refs on the GPU")
    ap.add_argument(
        "--select", choices=(CURRENT, *ALTERNATIVES, "all"), default="all",
        help="selection kernel(s) to time: the default (walk), an alternative (prefilter, split), or all side by side "
        "(default)",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the side-by-side selection timing")
    ap.add_argument("--no-cpu-smoke", action="store_true", help="without a GPU, do not run the tiny CPU smoke run")
    ap.add_argument("--check", action="store_true", help="first check every kernel against its ref (exit 1 if off)")
    ap.add_argument("--check-only", action="store_true", help="only the check")
    ap.add_argument("--json", default=None, help="write the results here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.check or args.check_only:
        if device == "cpu" and not K.use_triton(torch.empty(1)):
            print("check: no GPU and no forced interpreter (TRITON_INTERPRET=1 LIGHTNING_SCAPE_FORCE_TRITON=1)")
        else:
            failures = check(device, DTYPES[args.dtype], args.exploration)
            if args.select == "all":
                failures += check_alternatives(device, DTYPES[args.dtype], args.exploration)
            print("\n".join(["check FAILED:", *failures]) if failures else "check passed: kernels match the refs")
            if failures:
                return 1
        if args.check_only:
            return 0

    if not torch.cuda.is_available():
        print(
            "No CUDA GPU is available (torch.cuda.is_available() is False): there is nothing to measure. "
            "The Triton kernels run only on CUDA; no bandwidth or step-time numbers are produced."
        )
        if not args.no_cpu_smoke:
            run(args, "cpu")
        return 0
    results = run(args, "cuda")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
