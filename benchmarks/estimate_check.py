"""``lightning-scape estimate``'s step times against the network benchmark's measured ones.

    sudo .venv/bin/python -m benchmarks.estimate_check                       # 3 links, about 6 minutes
    .venv/bin/python -m benchmarks.estimate_check --from-run out/estimate_check/run   # compare again (same dry run)

1. A dry run (``lightning_scape.planning.measure``) on this machine times one rank of the benchmark's model
   (forward, backward, clipping + AdamW) and what a SCAPE step adds at d = 0.1 and 0.01, one thread, as
   the benchmark's ranks run.
2. The network benchmark (``benchmarks.network.run``) measures DDP + AdamW, DDP's bf16 hook, SCAPE sharded
   at d = 0.1 and 0.01 and compute-only at W = 2 on 10 Gbit/s, 1 Gbit/s and 100 Mbit/s (namespaces joined by
   rate-limited links; root needed): median step times after its warm-up.
3. ``lightning_scape.planning.estimate`` predicts each method's step on each link with the benchmark's
   model, groups, bucket cap and SCAPE settings (10 dense steps, no ramp, index all-gather charged to the
   step as the benchmark charges it), in two ways: from the dry run alone, and with the compute scaled to
   this run's compute-only median (what a user who knows their step time would give; the machine's load
   drifts between the dry run and the benchmark). ``check.md`` and ``check.json`` hold the table: the
   predictions against the medians, and against the paired ratios to compute-only (the median over rounds
   of a method's step over compute-only's step of the same round, which cancels the drifting load); exit
   status 1 when a paired ratio is off by more than 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from typing import Any

import torch

from benchmarks.network import run as netbench
from lightning_scape import ScapeConfig
from lightning_scape.examples.workloads import build_model, lm_loss, weight_decay_groups
from lightning_scape.planning import Cluster, Link, StepCompute, estimate
from lightning_scape.planning.estimate import DDP, DDP_BF16, scape_name
from lightning_scape.planning.measure import measure_compute

DENSITIES = (0.1, 0.01)
# The benchmark's methods, by the name the estimate gives them.
METHODS = {
    DDP: "ddp_adamw",
    DDP_BF16: "ddp_bf16",
    scape_name(0.1): "scape_sharded_d0.1",
    scape_name(0.01): "scape_sharded_d0.01",
}
TARGET = 0.15  # predicted step within 15% of measured
DRY_RUN = "dry_run.json"


def dry_run(args: argparse.Namespace) -> StepCompute:
    """One rank's compute and SCAPE's extra work, measured on this machine with the benchmark's model and batch."""
    torch.set_num_threads(1)  # as the benchmark's ranks
    gen = torch.Generator().manual_seed(0)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 256, (args.batch_size, args.block_size + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    return measure_compute(
        lambda: build_model(args.block_size, preset=args.model),
        batch,
        lm_loss,
        world_size=2,
        densities=DENSITIES,
        config=scape_config(0.01, args.warmup),
        steps=args.dry_steps,
        warmup=3,
        param_groups=weight_decay_groups,
    )


def dry_run_dict(dry: StepCompute) -> dict[str, Any]:
    """The dry run as JSON holds it (densities as strings)."""
    return {**asdict(dry), "scape_extra_s": {str(d): s for d, s in dry.scape_extra_s.items()}}


def save_dry_run(dry: StepCompute, path: str) -> None:
    """``dry_run.json``, beside the benchmark's run: ``--from-run`` compares with the same dry run."""
    with open(path, "w") as fh:
        json.dump(dry_run_dict(dry), fh, indent=1)


def load_dry_run(path: str) -> StepCompute:
    """What :func:`save_dry_run` wrote."""
    with open(path) as fh:
        d = json.load(fh)
    extra = {float(k): v for k, v in d.pop("scape_extra_s").items()}
    return StepCompute(**d, scape_extra_s=extra)


def scape_config(density: float, warmup: int) -> ScapeConfig:
    """The benchmark's SCAPE methods (``benchmarks/network/worker.py``): sharded, a short warm-up, no ramp."""
    return ScapeConfig(density=density, dense_warmup_steps=warmup, density_ramp_steps=0, bucket_cap_mb=25.0)


def scaled(compute: StepCompute, total_s: float) -> StepCompute:
    """``compute`` with every part scaled so that forward + backward + optimizer take ``total_s``."""
    f = total_s / compute.total_s
    extra = {d: f * s for d, s in compute.scape_extra_s.items()}
    return replace(compute, forward_s=f * compute.forward_s, backward_s=f * compute.backward_s,
                   optimizer_s=f * compute.optimizer_s, scape_extra_s=extra)  # fmt: skip


def predict(args: argparse.Namespace, compute: StepCompute, rate_mbit: float) -> dict[str, float]:
    """Predicted step seconds per method on a link of ``rate_mbit`` between the two ranks."""
    groups = weight_decay_groups(build_model(args.block_size, preset=args.model))
    cluster = Cluster(2, 1, Link(rate_mbit * 1e6, 0.0, args.efficiency))
    est = estimate(groups, cluster, compute, DENSITIES, scape_config(0.01, args.warmup), overlap_next=False)
    return {m.name: m.step.total_s for m in est.methods}


def run_benchmark(args: argparse.Namespace) -> str:
    """The network benchmark's step-time run; returns its folder."""
    out = os.path.join(args.out, "run")
    netbench.main(
        [
            "--profile", args.profiles, "--model", args.model, "--world-size", "2",
            "--methods", ",".join(["compute_only", *METHODS.values()]),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch-size", str(args.batch_size), "--block-size", str(args.block_size), "--out", out,
        ]
    )  # fmt: skip
    return out


def compare(args: argparse.Namespace, results: dict[str, Any], dry: StepCompute) -> list[dict[str, Any]]:
    """One row per link and method: measured, and predicted both ways."""
    rows = []
    for prof in results["profiles"]:
        per = prof["summary"]["per_method"]
        compute_only = per["compute_only"]["step_ms_median"] / 1e3
        from_dry = predict(args, dry, prof["rate_mbit"])
        from_run = predict(args, scaled(dry, compute_only), prof["rate_mbit"])
        for name, method in METHODS.items():
            measured = per[method]["step_ms_median"] / 1e3
            paired = per[method]["vs_compute_paired"]  # median over rounds of this step / compute-only's step
            rows.append(
                {
                    "link": prof["profile"],
                    "goodput_mbit": (prof["throughput_bps"] or 0) / 1e6,
                    "method": name,
                    "measured_ms": 1e3 * measured,
                    "p10_ms": per[method]["step_ms_p10"],
                    "p90_ms": per[method]["step_ms_p90"],
                    "compute_only_ms": 1e3 * compute_only,
                    "predicted_ms": 1e3 * from_run[name],
                    "error": from_run[name] / measured - 1,
                    "measured_paired": paired,
                    "predicted_ratio": from_run[name] / compute_only,
                    "error_paired": from_run[name] / compute_only / paired - 1,
                    "predicted_dry_ms": 1e3 * from_dry[name],
                    "error_dry": from_dry[name] / measured - 1,
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]], dry: StepCompute, results: dict[str, Any]) -> str:
    """The table of ``check.md``."""
    extra = ", ".join(f"d={d:g}: {1e3 * s:.1f} ms" for d, s in dry.scape_extra_s.items())
    lines = [
        f"Dry run (one thread): forward {1e3 * dry.forward_s:.1f} ms, backward {1e3 * dry.backward_s:.1f} ms, "
        f"clipping + AdamW {1e3 * dry.optimizer_s:.1f} ms; a SCAPE step adds {extra}.",
        f"Benchmark: `{results['command']}`; machine: {results['machine']['cpu']}, load average at start "
        f"{tuple(round(x, 2) for x in results['machine']['loadavg_start'])}.",
        "",
        "| link | method | measured ms (p10-p90) | predicted ms | error | measured / compute-only (paired) "
        "| predicted / compute-only | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['link']} ({r['goodput_mbit']:.0f} Mbit/s; compute-only {r['compute_only_ms']:.1f} ms) "
            f"| {r['method']} | {r['measured_ms']:.1f} ({r['p10_ms']:.0f}-{r['p90_ms']:.0f}) | {r['predicted_ms']:.1f} "
            f"| {100 * r['error']:+.1f}% | {r['measured_paired']:.3f} | {r['predicted_ratio']:.3f} "
            f"| {100 * r['error_paired']:+.1f}% |"
        )
    worst = max(abs(r["error"]) for r in rows)
    worst_paired = max(abs(r["error_paired"]) for r in rows)
    dry_errors = [r["error_dry"] for r in rows]
    lines += [
        "",
        f"Largest error: {100 * worst:.1f}% on the medians, {100 * worst_paired:.1f}% on the paired ratios "
        f"(target: within {100 * TARGET:.0f}%). From the dry run alone (its compute, not this run's compute-only): "
        f"errors from {100 * min(dry_errors):+.1f}% to {100 * max(dry_errors):+.1f}%.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="10gbit,1gbit,100mbit", help="the benchmark's link profiles")
    ap.add_argument("--model", default="small", help="the benchmark's model preset (default: small)")
    ap.add_argument("--steps", type=int, default=70, help="steps per method (default: 70)")
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the medians; SCAPE's dense warm-up")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--dry-steps", type=int, default=20, help="timed rounds of the dry run")
    ap.add_argument("--efficiency", type=float, default=0.95, help="the estimate's usable fraction of the rate")
    ap.add_argument("--out", default="out/estimate_check")
    ap.add_argument("--from-run", default=None, help="compare with this finished benchmark run instead of running one")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    saved = os.path.join(os.path.dirname(os.path.abspath(args.from_run)), DRY_RUN) if args.from_run else ""
    if os.path.exists(saved):  # the run's own dry run, measured before it
        dry = load_dry_run(saved)
    else:
        dry = dry_run(args)
        save_dry_run(dry, os.path.join(args.out, DRY_RUN))
    print(f"dry run: {dry}", flush=True)
    run_dir = args.from_run or run_benchmark(args)
    with open(os.path.join(run_dir, "results.json")) as fh:
        results = json.load(fh)
    if not results["emulated"]:
        print("the benchmark ran on loopback (no root or no tc): there is no link to compare with", file=sys.stderr)
        return 2
    rows = compare(args, results, dry)
    text = markdown(rows, dry, results)
    print(text)
    with open(os.path.join(args.out, "check.md"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(args.out, "check.json"), "w") as fh:
        json.dump({"dry_run": dry_run_dict(dry), "rows": rows}, fh, indent=1)
    return 0 if max(abs(r["error_paired"]) for r in rows) <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
