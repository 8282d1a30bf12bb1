"""SCAPE against DDP, PowerSGD and compressed hooks on an emulated slow network (one machine).

    sudo .venv/bin/python -m benchmarks.network.run --profile 1gbit --methods all --steps 40 --out out/net
    .venv/bin/python -m benchmarks.network.run --profile all --out out/net          # 10gbit, 1gbit, 100mbit
    .venv/bin/python -m benchmarks.network.run --loopback --model tiny --steps 4    # no root needed

Each of the W ranks runs in its own network namespace (a "host") behind a veth pair on a bridge, with a
token-bucket limit of the profile's rate on what it sends and on what it receives (``netns.py``). Ranks
meet over those addresses with gloo and torchrun-style environment variables. Without root (or with
``--loopback``) the ranks run on 127.0.0.1 without any limit, and every output says so.

All methods train in the same W processes, step by step in rotating order (``worker.py``), on the same
model, data, seed and global batch; ``compute_only`` is W = 1 with the per-rank batch (each rank trains
alone, so both cores stay busy as in the other methods). Outputs under ``--out``: ``results.md``,
``results.csv``, ``results.json``, per profile ``loss_vs_step.png`` and ``loss_vs_time.png``, and
``step_time_vs_bandwidth.png``; the per-rank raw records and logs are under ``<out>/<profile>/``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
from typing import Any

from benchmarks.network import harness
from benchmarks.network.netns import PROFILES
from benchmarks.network.worker import (
    ALL_METHODS,
    COMPUTE_ONLY,
    EXTRA_METHODS,
    FSDP_METHODS,
    METHOD_LABELS,
    UNCOUNTED_METHODS,
    WorkerSpec,
)
from benchmarks.reporting import (
    cumsum,
    fmt,
    goodput_cell,
    machine_line,
    mean,
    method_style,
    network_column,
    network_mode,
    pyplot,
    write_csv,
    write_json,
)
from lightning_scape.examples.workloads import MODEL_PRESETS

LOSS_WINDOW = 10  # losses are averaged over this many steps (one rank's batch is 512 tokens: noisy)
SCAPE_HEADLINE = "scape_sharded_d0.01"
DDP_HEADLINE = "ddp_adamw"


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return math.nan
    i = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[i]


def summarize(
    ranks: list[dict[str, Any]],
    methods: list[str],
    warmup: int,
    tokens_per_rank_step: int,
    emulated: bool,
    ranks_per_host: int = 1,
) -> dict[str, Any]:
    """Medians, spreads, bytes and losses per method from the per-rank records of one profile.

    Args:
        ranks: The workers' ``rank<r>.json`` contents, by rank.
        methods: The methods, in table order.
        warmup: Steps left out of the step-time and byte statistics (SCAPE's dense warm-up, PowerSGD's
            vanilla all-reduce, the LR warm-up); all steps are kept when there are no more than these.
        tokens_per_rank_step: Batch size times block size.
        emulated: Whether the interface counters belong to the rank's host (False on loopback).
        ranks_per_host: P. The interface counters are the host's, which its P ranks share; with P > 1 only the
            FSDP methods' formula (all of whose traffic crosses hosts) is compared with them.

    Returns:
        ``per_method`` (one dict per method), ``equal_time_s`` and ``world_size``.
    """
    W = len(ranks)
    n_steps = len(ranks[0]["methods"][methods[0]]["step_s"])
    first = warmup if n_steps > warmup else 0
    per: dict[str, dict[str, Any]] = {}
    for name in methods:
        recs = [rk["methods"][name] for rk in ranks]
        steps = len(recs[0]["step_s"])
        # A step ends when its slowest rank ends (all ranks started together after a barrier).
        step_s = [max(r["step_s"][i] for r in recs) for i in range(steps)]
        exposed_s = [max(r["bwd_tail_s"][i] + r["wait_s"][i] for r in recs) for i in range(steps)]
        loss = [mean([r["loss"][i] for r in recs]) for i in range(steps)]
        cum = cumsum(step_s)
        timed = step_s[first:]
        med = statistics.median(timed)
        sent = mean([mean([float(r["sent"][i]) for r in recs]) for i in range(first, steps)])
        if name in UNCOUNTED_METHODS:
            sent = math.nan
        tx = mean([mean([float(r["tx"][i]) for r in recs]) for i in range(first, steps)])
        formula = recs[0]["formula_bytes"]
        per[name] = {
            "method": name,
            "label": METHOD_LABELS.get(name, name),
            "timed_steps": len(timed),
            "step_ms_median": 1e3 * med,
            "step_ms_p10": 1e3 * _pct(timed, 0.1),
            "step_ms_p90": 1e3 * _pct(timed, 0.9),
            "tokens_per_s": (1 if name == COMPUTE_ONLY else W) * tokens_per_rank_step / med,
            "exposed_comm_ms": 1e3 * statistics.median(exposed_s[first:]),
            "fwd_bwd_ms": 1e3 * statistics.median(max(r["fwd_bwd_s"][i] for r in recs) for i in range(first, steps)),
            "opt_ms": 1e3 * statistics.median(max(r["opt_s"][i] for r in recs) for i in range(first, steps)),
            "sent_bytes_counters": sent,
            "formula_bytes": formula,
            # On loopback, lo's counters add up every process of the machine: not this rank's traffic.
            "tx_bytes_kernel": tx if emulated else math.nan,
            "kernel_over_formula": _kernel_over_formula(name, tx, formula, ranks_per_host) if emulated else math.nan,
            "counters_over_formula": sent / formula if formula else math.nan,
            "loss_final": mean(loss[-LOSS_WINDOW:]),
            "total_s": cum[-1],
            "loss_curve": loss,
            "cum_time_s": cum,
            "step_s": step_s,
        }
        for key in ("slots", "effective_density", "padded_numel"):
            if key in recs[0]:
                per[name][key] = recs[0][key]
    # Paired ratios: a method's step against compute-only's (DDP's) step of the same round, seconds apart,
    # so that the machine's load, which drifts over minutes on a shared VM, cancels.
    refs = (
        (COMPUTE_ONLY, "vs_compute_paired", False),
        (DDP_HEADLINE, "ddp_vs_paired", True),
        (SCAPE_HEADLINE, "vs_scape_paired", False),
        ("hsdp_adamw", "hsdp_vs_paired", True),
    )
    for ref_name, key, invert in refs:
        ref = per.get(ref_name)
        for p in per.values():
            if ref is None:
                p[key] = math.nan
                continue
            pairs = zip(p["step_s"][first:], ref["step_s"][first:], strict=True)
            p[key] = statistics.median((b / a) if invert else (a / b) for a, b in pairs)
    distributed = [p for n, p in per.items() if n != COMPUTE_ONLY]
    t_equal = min((p["total_s"] for p in distributed), default=math.nan)
    for p in per.values():
        within = [loss_i for loss_i, c in zip(p["loss_curve"], p["cum_time_s"], strict=True) if c <= t_equal + 1e-9]
        p["loss_at_equal_time"] = mean(within[-LOSS_WINDOW:]) if within else math.nan
        p["steps_at_equal_time"] = len(within)
    ddp = per.get(DDP_HEADLINE)
    for p in per.values():
        p["bytes_vs_ddp"] = (
            ddp["sent_bytes_counters"] / p["sent_bytes_counters"] if ddp and p["sent_bytes_counters"] else math.nan
        )
    return {"per_method": per, "equal_time_s": t_equal, "world_size": W, "ranks_per_host": ranks_per_host}


def _kernel_over_formula(name: str, tx: float, formula: float, ranks_per_host: int) -> float:
    """The host's interface bytes over the formula's bytes for the host (NaN where they do not compare)."""
    if not formula:
        return math.nan
    if ranks_per_host == 1:
        return tx / formula
    return tx / (formula * ranks_per_host) if name in FSDP_METHODS else math.nan


def _ratios(summary: dict[str, Any]) -> dict[str, float]:
    """The ratios docs/benchmarks.md reports, for the headline SCAPE (sharded, d = 0.01)."""
    per = summary["per_method"]
    out: dict[str, float] = {}
    s, c, d = per.get(SCAPE_HEADLINE), per.get(COMPUTE_ONLY), per.get(DDP_HEADLINE)
    if s and c:
        out["scape_over_compute"] = s["step_ms_median"] / c["step_ms_median"]
        out["scape_over_compute_paired"] = s["vs_compute_paired"]
    if s and d:
        out["ddp_over_scape"] = d["step_ms_median"] / s["step_ms_median"]
        out["ddp_over_scape_paired"] = s["ddp_vs_paired"]
        out["bytes_ddp_over_scape"] = d["sent_bytes_counters"] / s["sent_bytes_counters"]
        if not math.isnan(s["tx_bytes_kernel"]):
            out["kernel_bytes_ddp_over_scape"] = d["tx_bytes_kernel"] / s["tx_bytes_kernel"]
    h, f = per.get("hsdp_adamw"), per.get("scape_fsdp_d0.01")
    if h and f:
        out["hsdp_over_scape_fsdp_paired"] = f["hsdp_vs_paired"]
        if not math.isnan(f["tx_bytes_kernel"]):
            out["kernel_bytes_hsdp_over_scape_fsdp"] = h["tx_bytes_kernel"] / f["tx_bytes_kernel"]
    if s:
        out["scape_kernel_over_formula"] = s["kernel_over_formula"]
        others = {n: p for n, p in per.items() if n not in (SCAPE_HEADLINE, COMPUTE_ONLY)}
        if others:
            fastest = min(others, key=lambda n: others[n]["step_ms_median"])
            out["scape_over_fastest_other"] = s["step_ms_median"] / others[fastest]["step_ms_median"]
            # Paired: the other method's step over SCAPE's in the same round; > 1 means SCAPE is faster.
            out["min_other_over_scape_paired"] = min(p["vs_scape_paired"] for p in others.values())
    return out


def markdown_table(summary: dict[str, Any], emulated: bool) -> str:
    """The per-method table of one profile."""
    tx_of = "host" if summary.get("ranks_per_host", 1) > 1 else "rank"
    head = (
        "| method | step ms (median) | p10-p90 | vs compute-only (paired) | DDP / this (paired) "
        "| this / SCAPE d=0.01 (paired) | tokens/s "
        f"| exposed comm ms | kB sent/rank/step (counters) | kB formula | kB tx/{tx_of}/step (kernel) | kernel/formula "
        "| DDP bytes / bytes | loss @ last step | loss @ equal time (steps) |"
    )
    lines = [head, "|" + "---|" * 15]
    for p in summary["per_method"].values():
        lines.append(
            f"| {p['label']} | {fmt(p['step_ms_median'])} | {fmt(p['step_ms_p10'])}-{fmt(p['step_ms_p90'])} "
            f"| {fmt(p['vs_compute_paired'], '.3f')} | {fmt(p['ddp_vs_paired'], '.3f')} "
            f"| {fmt(p['vs_scape_paired'], '.3f')} "
            f"| {fmt(p['tokens_per_s'], '.0f')} | {fmt(p['exposed_comm_ms'])} "
            f"| {fmt(p['sent_bytes_counters'] / 1e3)} | {fmt(p['formula_bytes'] / 1e3)} "
            f"| {fmt(p['tx_bytes_kernel'] / 1e3) if emulated else 'n/a (loopback)'} "
            f"| {fmt(p['kernel_over_formula'], '.3f')} | {fmt(p['bytes_vs_ddp'], '.1f')} "
            f"| {fmt(p['loss_final'], '.3f')} | {fmt(p['loss_at_equal_time'], '.3f')} ({p['steps_at_equal_time']}) |"
        )
    return "\n".join(lines)


def _hosts(results: dict[str, Any]) -> str:
    """`` on H hosts of P ranks`` when the ranks share hosts (only traffic between hosts is shaped)."""
    per_host = results.get("ranks_per_host", 1)
    if per_host == 1:
        return ""
    return f" on {results['world_size'] // per_host} hosts of {per_host} ranks (only the links between hosts shaped)"


def write_outputs(results: dict[str, Any], out: str) -> None:
    """results.md, results.csv, results.json and the plots."""
    emulated = results["emulated"]
    md = [
        "# Network benchmark results",
        "",
        f"Network: **{network_mode(results)}**.",
        f"Command: `{results['command']}`",
        f"Machine: {machine_line(results)}.",
        f"Model: litgpt GPT preset `{results['model']}` ({results['params'] / 1e6:.2f}M parameters), "
        f"W = {results['world_size']}{_hosts(results)}, {results['batch_size']} x {results['block_size']} tokens "
        "per rank per step, "
        f"{results['steps']} steps ({results['warmup']} warm-up steps excluded from the medians and bytes).",
        "",
    ]
    rows: list[dict[str, Any]] = []
    for prof in results["profiles"]:
        s = prof["summary"]
        tput = prof["throughput_bps"]
        md += [
            f"## Profile {prof['profile']}" + ("" if emulated else " (loopback: no limit)"),
            "",
            f"Rate {fmt(prof['rate_mbit'], '.0f') if prof['rate_mbit'] else 'unlimited'} Mbit/s per direction, "
            f"one-way latency {prof['latency_ms']} ms; measured TCP goodput host 0 -> 1: "
            f"{goodput_cell(tput)} Mbit/s. Loss at equal time: at "
            f"{s['equal_time_s']:.1f} s, the total time of the fastest distributed method.",
            "",
            markdown_table(s, emulated),
            "",
            "Ratios: " + ", ".join(f"{k} = {v:.3f}" for k, v in prof["ratios"].items()),
            "",
        ]
        for p in s["per_method"].values():
            rows.append(
                {
                    "network": network_column(emulated),
                    "profile": prof["profile"],
                    "rate_mbit": prof["rate_mbit"],
                    **{k: v for k, v in p.items() if k not in ("loss_curve", "cum_time_s", "step_s")},
                }
            )
    if len(results["profiles"]) > 1:
        profs = results["profiles"]
        md += [
            "## Median step ms against bandwidth",
            "",
            "| method | " + " | ".join(p["profile"] for p in profs) + " |",
            "|---|" + "---|" * len(profs),
        ]
        for name in results["methods"]:
            cells = [fmt(p["summary"]["per_method"][name]["step_ms_median"]) for p in profs]
            md.append(f"| {METHOD_LABELS.get(name, name)} | " + " | ".join(cells) + " |")
        md.append("")
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write("\n".join(md))
    write_csv(os.path.join(out, "results.csv"), rows)
    write_json(results, out)
    plot(results, out)


def _style(method: str) -> dict[str, Any]:
    """One colour per method (tab10; compute-only is black), dashed for DDP, dotted for compute-only."""
    return method_style(method, (*ALL_METHODS, *EXTRA_METHODS), reference=COMPUTE_ONLY)


def plot(results: dict[str, Any], out: str) -> None:
    """Loss against step and against wall-clock per profile; step time against bandwidth."""
    plt = pyplot()
    if plt is None:
        return
    tag = "" if results["emulated"] else " [LOOPBACK, no rate limit]"
    for prof in results["profiles"]:
        per = prof["summary"]["per_method"]
        for kind, xkey, xlabel in (("step", None, "step"), ("time", "cum_time_s", "wall-clock s")):
            fig, ax = plt.subplots(figsize=(8, 5))
            for p in per.values():
                y = p["loss_curve"]
                k = min(LOSS_WINDOW, len(y))
                smooth = [mean(y[max(0, i - k + 1) : i + 1]) for i in range(len(y))]
                x = list(range(1, len(y) + 1)) if xkey is None else p[xkey]
                ax.plot(x, smooth, label=p["label"], **_style(p["method"]))
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"train loss (mean of ranks, {LOSS_WINDOW}-step mean)")
            ax.set_title(f"{prof['profile']}: loss against {xlabel}{tag}")
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(os.path.join(out, prof["profile"], f"loss_vs_{kind}.png"), dpi=110)
            plt.close(fig)
    profs = [p for p in results["profiles"] if p["rate_mbit"]]
    fig, ax = plt.subplots(figsize=(8, 5))
    if profs:
        names = list(profs[0]["summary"]["per_method"])
        for name in names:
            pts = sorted((p["rate_mbit"], p["summary"]["per_method"][name]["step_ms_median"]) for p in profs)
            ax.plot(
                [a for a, _ in pts],
                [b for _, b in pts],
                marker="o",
                label=METHOD_LABELS.get(name, name),
                **_style(name),
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no rate-limited profile (loopback)", ha="center", transform=ax.transAxes)
    ax.set_xlabel("link rate, Mbit/s")
    ax.set_ylabel("median step ms")
    ax.set_title(f"step time against bandwidth, W={results['world_size']}{tag}")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "step_time_vs_bandwidth.png"), dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.network.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--profile", default="1gbit", help=f"comma list of {[*PROFILES, 'unlimited']} or rates, or 'all'")
    ap.add_argument("--methods", default="all", help=f"comma list of 'all' and of {[*ALL_METHODS, *EXTRA_METHODS]}")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per method")
    ap.add_argument("--warmup", type=int, default=10, help="LR warm-up, SCAPE dense warm-up and PowerSGD start")
    ap.add_argument("--world-size", type=int, default=2, help="ranks (hosts); 4 for the small/tiny models")
    ap.add_argument(
        "--ranks-per-host",
        type=int,
        default=1,
        help="ranks sharing one host's namespace and link (unshaped between them); the FSDP methods shard over them",
    )
    ap.add_argument("--model", default="base", choices=list(MODEL_PRESETS), help="model preset")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (all methods)")
    ap.add_argument("--chunk-size", type=int, default=4096, help="SCAPE mask chunk size")
    ap.add_argument("--max-bytes", type=int, default=4_000_000, help="bytes of stdlib source to train on")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency per host (needs netem)")
    ap.add_argument("--loopback", action="store_true", help="no namespaces, no limit (also without root)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="give up on a profile after this long")
    ap.add_argument("--out", default=None, help="output directory (default: a new temporary one)")
    ap.add_argument("--resummarize", metavar="OUT", default=None, help="only rebuild OUT's outputs from its records")
    ns = ap.parse_args(argv)
    if ns.steps < 1 or ns.warmup < 0 or ns.world_size < 1:
        ap.error("--steps must be >= 1, --warmup >= 0, --world-size >= 1")
    if ns.world_size < 2:
        ap.error("--world-size must be >= 2 (compute_only already covers W = 1)")
    if ns.ranks_per_host < 1 or ns.world_size % ns.ranks_per_host:
        ap.error(f"--ranks-per-host {ns.ranks_per_host} must divide --world-size {ns.world_size}")
    return ns


def resummarize(out: str) -> dict[str, Any]:
    """Rebuild every output of ``out`` from its per-rank records (after a change to the statistics)."""

    def summary_of(ranks: list[dict[str, Any]], r: dict[str, Any]) -> dict[str, Any]:
        tokens = r["batch_size"] * r["block_size"]
        return summarize(ranks, r["methods"], r["warmup"], tokens, r["emulated"], r.get("ranks_per_host", 1))

    results = harness.resummarize(out, summary_of)
    for prof in results["profiles"]:
        prof["ratios"] = _ratios(prof["summary"])
    write_outputs(results, out)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns everything written to ``results.json``."""
    args = parse_args(argv)
    if args.resummarize:
        rebuilt = resummarize(args.resummarize)
        print(f"rewrote {args.resummarize}/results.md, results.csv, results.json and plots")
        return rebuilt
    methods: list[str] = []
    for m in (m.strip() for m in args.methods.split(",")):
        for name in ALL_METHODS if m == "all" else (m,):
            if name not in methods:
                methods.append(name)
    unknown = [m for m in methods if m not in ALL_METHODS + EXTRA_METHODS]
    if unknown:
        raise SystemExit(
            f"unknown method(s) {unknown}; choose from {[*ALL_METHODS, *EXTRA_METHODS]} or 'all' "
            "(e.g. --methods all,scape_sharded_d0.01_a2a)."
        )
    profiles = harness.select_profiles(args.profile, args.latency_ms)
    out = args.out or tempfile.mkdtemp(prefix="netbench-")
    os.makedirs(out, exist_ok=True)
    profiles, reason = harness.emulation(args.loopback, profiles)
    results: dict[str, Any] = {
        **harness.results_header("benchmarks.network.run", argv, args, reason),
        "warmup": args.warmup,
        "methods": methods,
        "profiles": [],
    }
    tokens = args.batch_size * args.block_size

    def show(prof: dict[str, Any]) -> None:
        prof["ratios"] = _ratios(prof["summary"])
        print(markdown_table(prof["summary"], reason is None), flush=True)

    harness.measure_profiles(
        results,
        profiles,
        out,
        announce=f"{args.world_size} ranks, {len(methods)} methods, {args.steps} steps",
        spec_for=lambda h, prof_dir: WorkerSpec.for_host(
            args, methods, prof_dir, h.ifname, warmup=args.warmup, shard_size=args.ranks_per_host
        ),
        timeout_s=args.timeout_s,
        summarize=lambda ranks: summarize(ranks, methods, args.warmup, tokens, reason is None, args.ranks_per_host),
        show=show,
        write=lambda r: write_outputs(r, out),
    )
    print(f"wrote {out}/results.md, results.csv, results.json and plots")
    return results


if __name__ == "__main__":
    main()
