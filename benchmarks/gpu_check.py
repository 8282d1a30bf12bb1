"""One command for a CUDA machine: the kernels against their references, their bandwidth, a training run, then
SCAPE's quality at scale (``benchmarks.scale``).

    python -m benchmarks.gpu_check                      # on a CUDA GPU: this check, then the scale run (13 minutes)
    python -m benchmarks.gpu_check --no-scale           # this check only (a few minutes)
    python -m benchmarks.scale                          # the scale run only (8 minutes)
    python -m benchmarks.gpu_check --peak-gbps 3350     # a device the peak table of bench_kernels.py lacks
    python -m benchmarks.gpu_check --tiny               # no GPU: the code path in Triton's CPU interpreter

1. **Kernels against references**: every Triton kernel against its pure-PyTorch reference from the same
   state, fp32 and bf16 (``bench_kernels.check``): indices, error feedback and scatter/decay bit for bit,
   the AdamS arithmetic within tolerance, as ``tests/test_kernels.py`` requires on the CPU.
2. **Training**: a small litgpt model (``lightning_scape.examples.workloads``' ``small`` preset), W = 2 ranks in
   one process (``lightning_scape.simulate``), ``bf16-mixed`` (bf16 autocast, fp32 parameters; fp32 with
   ``--tiny``), SCAPE at
   d = 0.01 with a schedule that fits the run, trained twice from the same weights on the same batches:
   on the Triton kernels and on the references (``LIGHTNING_SCAPE_FORCE_REF=1``). Their losses must agree.
3. **Bandwidth**: each kernel's achieved DRAM bandwidth against the device's peak, and the whole sparse
   optimizer step against fused AdamW (``bench_kernels.run``); then the alternative selection kernels
   (``LIGHTNING_SCAPE_SELECT_KERNEL``) timed beside the default and checked against the references
   (``bench_kernels.check_alternatives``), last and guarded: their results are reported apart from the check's.
4. **Scale** (unless ``--no-scale``): ``python -m benchmarks.scale`` in a process of its own, given what is left of
   ``--total-budget-s`` (780 s: 13 minutes in all), at most its own 8 minutes; it writes under ``--out``/scale.

Writes ``report.md`` and ``report.json`` under ``--out``; exits 1 when a kernel differs from its reference,
the losses disagree or the scale run failed. ``--tiny`` (small tensors, a few steps) runs everything on the
CPU with the kernels in Triton's interpreter (``TRITON_INTERPRET=1``, set here before triton is imported)
and the scale run's ``--tiny``: a test of this script, not a measurement (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.cpu_fallback import cpu_fallback

# The training runs' losses agree when, step by step, they differ by at most this fraction of the loss, and
# their final losses (the mean of the last tenth of the steps) by at most FINAL_RTOL. The kernels round the
# AdamS arithmetic as IEEE does (PyTorch's CPU sqrt does not), and the last bits grow over a run.
STEP_RTOL = 0.05
FINAL_RTOL = 0.01
# The --tiny problems of the kernel check (chunk size, density, rows): what the interpreter runs in seconds.
TINY_CASES = ((8, 0.25, 7), (64, 0.1, 5), (256, 0.05, 3))
# The prepared command on a lent GPU: this check and then the scale run within TOTAL_BUDGET_S, the scale run given
# what is left, at most SCALE_BUDGET_S (its own 8 minutes). With less than MIN_SCALE_BUDGET_S left it is skipped:
# its text, kernel compilation and probe take about two minutes before it trains.
TOTAL_BUDGET_S = 780.0
SCALE_BUDGET_S = 480.0
MIN_SCALE_BUDGET_S = 300.0


@dataclass(frozen=True)
class Size:
    """What the training part runs."""

    preset: str
    steps: int
    batch_size: int
    block_size: int
    dense_warmup_steps: int
    density_ramp_steps: int
    chunk_size: int
    max_bytes: int
    precision: str  # "bf16-mixed" (bf16 autocast, fp32 parameters) or "32-true"
    world_size: int  # simulated ranks (threads of one process)


FULL = Size("small", 300, 8, 256, 20, 60, 4096, 4_000_000, "bf16-mixed", 2)
# On the CPU: fp32, and one rank. With two simulated ranks (threads) on Triton's interpreter, some runs' losses
# came out up to 7% apart from the references' even with the launches locked, while one rank agrees every run:
# the interpreter is not made for threads. Compiled kernels on a GPU run the two ranks (FULL).
TINY = Size("tiny", 4, 2, 32, 1, 1, 1024, 200_000, "32-true", 1)


@contextlib.contextmanager
def env(**values: str | None) -> Iterator[None]:
    """Environment variables set (None: removed) for the duration of the block."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def kernels_against_refs(device: str, tiny: bool, alternatives: bool = False) -> dict[str, list[str]]:
    """Per dtype, the ops whose kernel differs from its reference (``bench_kernels.check``); with ``alternatives``,
    the alternative selection kernels' (``bench_kernels.check_alternatives``)."""
    from benchmarks import bench_kernels

    cases = TINY_CASES if tiny else bench_kernels.CHECK_CASES
    check = bench_kernels.check_alternatives if alternatives else bench_kernels.check
    return {
        name: check(device, dtype, exploration=0.1, cases=cases)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }


def bandwidth(device: str, peak_gbps: float | None, tiny: bool = False) -> dict[str, Any]:
    """``bench_kernels.run``: each kernel's GB/s and share of the peak, the sparse step against fused AdamW.

    With ``tiny`` each op runs once (the code path only: on the CPU nothing is a measurement).
    """
    from benchmarks import bench_kernels

    argv = [] if peak_gbps is None else ["--peak-gbps", str(peak_gbps)]
    argv += ["--iters", "1", "--warmup", "0"] if tiny else []
    return bench_kernels.run(bench_kernels.build_parser().parse_args(argv), device)


def train(size: Size, device: str, reference: bool) -> dict[str, Any]:
    """Two simulated ranks of SCAPE on the small litgpt model (``size.precision``); losses, times and kernel paths.

    Args:
        size: The model and run.
        device: Where the ranks train (both on the one device).
        reference: Run the pure-PyTorch references instead of the kernels.
    """
    from lightning_scape import ScapeConfig, ScapeEngine, kernels, simulate
    from lightning_scape.comm import Communicator
    from lightning_scape.examples import workloads as wl

    tokens, _ = wl.corpus_tokens("stdlib", size.max_bytes)
    cfg = ScapeConfig(
        density=0.01,
        chunk_size=size.chunk_size,
        dense_warmup_steps=size.dense_warmup_steps,
        density_ramp_steps=size.density_ramp_steps,
    )

    def worker(rank: int, comm: Communicator) -> dict[str, Any]:
        model = wl.build_model(size.block_size, preset=size.preset, seed=0).to(device)
        engine = ScapeEngine(wl.adams_optimizer(model, lr=1.5e-3), cfg, comm, list(model.parameters()))
        gen = torch.Generator().manual_seed(1234 + rank)
        losses, step_s = [], []
        for step in range(size.steps):
            x, y = (t.to(device) for t in wl.sample_batch(tokens, gen, size.batch_size, size.block_size))
            wl.set_cosine_lr(engine.optimizer, step, size.steps, 1.5e-3, max(1, size.steps // 15))
            t0 = time.perf_counter()
            with torch.autocast(
                torch.device(device).type, dtype=torch.bfloat16, enabled=size.precision == "bf16-mixed"
            ):
                loss = wl.lm_loss(model, x, y)
            loss.backward()
            engine.step(max_grad_norm=1.0)
            engine.zero_grad()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
        # The kernels run where the dispatcher hands them the tensors and the chunk size is a power of two.
        paths = ["triton" if kernels.use_triton(bs.params) and _pow2(bs.layout.chunk_size) else "ref"
                 for bs in engine.buckets]  # fmt: skip
        engine.close()
        return {"losses": losses, "step_s": step_s, "bucket_paths": paths}

    force: dict[str, str | None] = {"LIGHTNING_SCAPE_FORCE_REF": "1" if reference else None}
    if device == "cpu" and not reference:
        force["LIGHTNING_SCAPE_FORCE_TRITON"] = "1"  # hand the CPU tensors to the interpreted kernels
    with env(**force):
        ranks = simulate(size.world_size, worker)
    losses = [statistics.fmean(r["losses"][i] for r in ranks) for i in range(size.steps)]
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(size.steps)]
    return {"losses": losses, "step_s": step_s, "bucket_paths": ranks[0]["bucket_paths"]}


def one_launch_at_a_time() -> None:
    """Triton's CPU interpreter is not thread-safe: under it, the simulated ranks' kernel launches take turns.

    Each ``*_triton`` launcher is replaced, in its op's module (where the dispatching op looks it up), by one
    that holds a lock. Compiled kernels on a GPU need none of this.
    """
    from lightning_scape import kernels

    lock = threading.Lock()
    for name in kernels.__all__:
        if not name.endswith("_triton") or name == "use_triton":
            continue
        launcher = getattr(kernels, name)

        def locked(*args: Any, _launch: Any = launcher, **kwargs: Any) -> Any:
            with lock:
                return _launch(*args, **kwargs)

        setattr(sys.modules[launcher.__module__], name, locked)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def losses_agree(kernel: list[float], reference: list[float]) -> dict[str, Any]:
    """Whether two runs' losses agree step by step (:data:`STEP_RTOL`) and at the end (:data:`FINAL_RTOL`)."""
    if len(kernel) != len(reference) or not kernel:
        raise ValueError(f"the runs have {len(kernel)} and {len(reference)} losses; compare equal, non-empty runs")
    worst = max(abs(a - b) / abs(b) for a, b in zip(kernel, reference, strict=True))
    tail = max(1, len(kernel) // 10)
    final_k, final_r = statistics.fmean(kernel[-tail:]), statistics.fmean(reference[-tail:])
    final = abs(final_k - final_r) / abs(final_r)
    finite = all(math.isfinite(v) for v in kernel + reference)
    return {
        "max_step_rel_diff": worst,
        "final_kernel": final_k,
        "final_reference": final_r,
        "final_rel_diff": final,
        "agree": finite and worst <= STEP_RTOL and final <= FINAL_RTOL,
    }


def scale_command(out: str, tiny: bool, elapsed_s: float, total_s: float) -> list[str] | None:
    """The scale run's command line, given the time left of ``total_s``; None when too little is left.

    Args:
        out: This check's output folder (the scale run writes under ``out/scale``).
        tiny: Run the scale run's ``--tiny`` (no budget applies).
        elapsed_s: Seconds this check has taken.
        total_s: Seconds for this check and the scale run together.
    """
    budget = min(SCALE_BUDGET_S, total_s - elapsed_s)
    if budget < MIN_SCALE_BUDGET_S and not tiny:
        return None
    argv = [sys.executable, "-m", "benchmarks.scale", "--out", os.path.join(out, "scale")]
    return argv + (["--tiny"] if tiny else ["--budget-s", f"{budget:.0f}"])


def run_scale(args: argparse.Namespace, elapsed_s: float) -> dict[str, Any]:
    """Run ``benchmarks.scale`` in a process of its own (a clean GPU, and this check's report already written)."""
    cmd = scale_command(args.out, args.tiny, elapsed_s, args.total_budget_s)
    if cmd is None:
        left = args.total_budget_s - elapsed_s
        print(f"scale run skipped: {left:.0f} s left of --total-budget-s {args.total_budget_s:.0f}", flush=True)
        return {"command": None, "returncode": None, "skipped": f"{left:.0f} s left"}
    print("running " + " ".join(cmd[1:]), flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the blocks this check's allocator caches, for the scale run's process
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, check=False).returncode
    report = os.path.join(args.out, "scale", "report.md")
    return {"command": " ".join(cmd[1:]), "returncode": rc, "seconds": time.perf_counter() - t0, "report": report}


def selection_md(cases: list[dict[str, Any]]) -> list[str]:
    """The selection kernels side by side (``bench_kernels.compare_selection``), as report lines."""
    if not cases:
        return []
    names = list(cases[0]["median_ms"])
    head = [f"{n} ms" for n in names] + [f"{n} / default" for n in names[1:]]
    lines = ["", f"Selection kernels side by side ({cases[0]['rounds']} alternating rounds; medians; ratio: the "
             "median of the per-round ratios to the default):", "",
             "| case | " + " | ".join(head) + " |", "|---" * (1 + len(head)) + "|"]  # fmt: skip
    for c in cases:
        times = " | ".join(f"{c['median_ms'][n]:.3f}" for n in names)
        ratios = " | ".join(f"{c['over_current'][n]:.3f}" for n in names[1:])
        lines.append(f"| {c['case']} | {times} | {ratios} |")
    return lines


def report_md(report: dict[str, Any]) -> str:
    """``report.md``."""
    dev = report["device"]
    lines = [
        "# GPU check",
        "",
        f"Device: {dev['name']} (peak {dev['peak_gbps'] or 'unknown'} GB/s), torch {dev['torch']}, "
        f"triton {dev['triton']}, Python {dev['python']}. Command: `{report['command']}`.",
    ]
    if not dev["cuda"]:
        lines += ["", "**No CUDA GPU: the kernels ran in Triton's CPU interpreter at a tiny size. Nothing here is a "
                  "measurement; the times and bandwidths are not reported.**"]  # fmt: skip
    lines += ["", "## Kernels against their references", ""]
    for dtype, failures in report["kernel_check"].items():
        lines.append(f"- {dtype}: " + ("every op matches" if not failures else "FAILED: " + "; ".join(failures)))
    for dtype, failures in report.get("alternative_check", {}).items():
        result = "both match" if not failures else "differ (the default is unaffected): " + "; ".join(failures)
        lines.append(f"- {dtype}, the alternative selection kernels (LIGHTNING_SCAPE_SELECT_KERNEL): {result}")
    lines += ["", "## Bandwidth", ""]
    if dev["cuda"]:
        lines += ["| op | path | values | median ms | GB/s | % of peak |", "|---|---|---|---|---|---|"]
        peak = dev["peak_gbps"]
        for r in report["bandwidth"]["kernels"] + report["bandwidth"]["steps"]:
            pct = f"{100 * r['gbps'] / peak:.1f}" if peak and r["bytes_moved"] else "n/a"
            lines.append(
                f"| {r['name']} | {r['path']} | {r['numel']:,} | {r['median_ms']:.3f} | {r['gbps']:.1f} | {pct} |"
            )
        lines += selection_md(report["bandwidth"].get("selection", []))
    else:
        lines.append("Not measured (no GPU): `bench_kernels.run` ran its code path only.")
    t = report["training"]
    a = t["agreement"]
    lines += [
        "",
        "## Training: Triton kernels against the references",
        "",
        f"{t['size']['preset']} model, W = {t['size']['world_size']} (simulate), {t['size']['precision']}, d = 0.01, "
        f"{t['size']['steps']} steps "
        f"({t['size']['dense_warmup_steps']} dense warm-up, {t['size']['density_ramp_steps']}-step ramp); buckets "
        f"on the kernels: {t['kernel']['bucket_paths']}, on the references: {t['reference']['bucket_paths']}.",
        "",
        f"- final loss (mean of the last tenth): kernels {a['final_kernel']:.4f}, references "
        f"{a['final_reference']:.4f} (relative difference {a['final_rel_diff']:.2e}, allowed {FINAL_RTOL})",
        f"- largest step-wise relative difference {a['max_step_rel_diff']:.2e} (allowed {STEP_RTOL})",
        f"- {'the losses agree' if a['agree'] else 'THE LOSSES DISAGREE'}",
    ]
    if dev["cuda"]:
        lines.append(
            f"- median step: kernels {1e3 * t['kernel']['median_step_s']:.1f} ms, references "
            f"{1e3 * t['reference']['median_step_s']:.1f} ms"
        )
    scale = report.get("scale")
    if scale is not None:
        lines += ["", "## The scale run", ""]
        if scale["command"] is None:
            lines.append(f"Skipped: {scale['skipped']} of the total budget.")
        else:
            done = "ran" if scale["returncode"] == 0 else f"FAILED (exit {scale['returncode']})"
            lines.append(f"`python {scale['command']}` {done} in {scale['seconds']:.0f} s; its report: "
                         f"`{scale['report']}`.")  # fmt: skip
    lines += ["", f"Result: **{'pass' if report['passed'] else 'FAIL'}**."]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: str) -> str:
    """``report.json`` and ``report.md`` under ``out``; returns the markdown."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=str)
    text = report_md(report)
    with open(os.path.join(out, "report.md"), "w") as fh:
        fh.write(text)
    return text


def main(argv: list[str] | None = None) -> int:
    from benchmarks.reporting import process_age_s

    t_start = time.perf_counter() - (process_age_s() if argv is None else 0.0)  # None: run as a command
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/gpu_check", help="where report.md and report.json go")
    ap.add_argument("--tiny", action="store_true", help="small tensors and a few steps (the CPU test of this script)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: 300; --tiny: 4)")
    ap.add_argument("--peak-gbps", type=float, default=None, help="the device's peak DRAM bandwidth, GB/s")
    ap.add_argument("--no-scale", action="store_true", help="this check only, without the scale run after it")
    ap.add_argument("--total-budget-s", type=float, default=TOTAL_BUDGET_S,
                    help="seconds for this check and the scale run together (default 780)")  # fmt: skip
    args = ap.parse_args(argv)
    exit_status = cpu_fallback(args.tiny, interpret_kernels=True)
    if exit_status is not None:
        return exit_status
    cuda = torch.cuda.is_available()
    import triton

    from benchmarks import bench_kernels

    device = "cuda" if cuda else "cpu"
    size = TINY if args.tiny else FULL
    if args.steps is not None:
        size = dataclasses.replace(size, steps=args.steps)
    name = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)"
    report: dict[str, Any] = {
        "command": "python -m benchmarks.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": {
            "name": name,
            "cuda": cuda,
            "peak_gbps": bench_kernels.peak_gbps(name, args.peak_gbps) if cuda else None,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
    }
    with env(LIGHTNING_SCAPE_FORCE_TRITON=None if cuda else "1", LIGHTNING_SCAPE_FORCE_REF=None):
        report["kernel_check"] = kernels_against_refs(device, args.tiny)
    if not cuda:
        one_launch_at_a_time()
    runs = {"kernel": train(size, device, reference=False), "reference": train(size, device, reference=True)}
    for r in runs.values():
        r["median_step_s"] = statistics.median(r["step_s"])
    agreement = losses_agree(runs["kernel"]["losses"], runs["reference"]["losses"])
    report["training"] = {"size": dataclasses.asdict(size), **runs, "agreement": agreement}
    # The alternative selection kernels last in this process (their timings end the bandwidth part): whatever they do,
    # the default's results are in. Their failures are theirs (the check passes on the default kernels), and the
    # scale run below is another process.
    with env(LIGHTNING_SCAPE_FORCE_TRITON=None if cuda else "1", LIGHTNING_SCAPE_FORCE_REF=None):
        report["bandwidth"] = bandwidth(device, args.peak_gbps, args.tiny)
        report["alternative_check"] = kernels_against_refs(device, args.tiny, alternatives=True)
    on_kernels = all(p == "triton" for p in runs["kernel"]["bucket_paths"])
    report["passed"] = not any(report["kernel_check"].values()) and agreement["agree"] and on_kernels
    text = write_report(report, args.out)  # before the scale run: a scale run cut short leaves this report whole
    print(text)
    if not args.no_scale:
        report["scale"] = run_scale(args, time.perf_counter() - t_start)
        report["passed"] = report["passed"] and report["scale"]["returncode"] in (0, None)
        print(write_report(report, args.out))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
