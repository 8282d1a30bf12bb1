"""The ``lightning-scape`` command line: ``demo``, ``pretrain``, ``estimate`` and ``plot`` (also ``python -m
lightning_scape``).

This module lies outside the ``lightning_scape`` package on purpose. Importing the package imports torch
and Lightning (``import lightning_scape`` registers ``strategy="scape"``), which takes seconds; from here
``lightning-scape --help``, ``demo --help``, ``estimate --help`` and their argument errors answer without them,
and a command imports the package only when it runs (``tests/test_demo.py`` and ``tests/test_planning.py`` check
that torch stays unimported). The
package never imports this module: the demo receives its parsed options as a
:class:`~lightning_scape.examples.demo.DemoOptions`. ``pretrain --help`` needs the package: its options are
read from litgpt's and SCAPE's own classes.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

PROG = "lightning-scape"

# One line per command, for ``lightning-scape --help``.
COMMANDS: dict[str, str] = {
    "demo": "DDP + AdamS against SCAPE on 2 CPU processes on real text: bytes per step, losses, a plot",
    "pretrain": "pretrain a litgpt model with SCAPE from a YAML recipe (recipes/debug.yaml: 2 CPU processes)",
    "estimate": "does SCAPE pay on your network? bytes, step time and memory per rank against DDP, predicted",
    "plot": "the demo's plot for a run of yours: loss and bytes per step against DDP's, from its metrics CSV",
}

PLOT_DESCRIPTION = """\
The demo's plot for a run of yours: the loss against the step, and the bytes SCAPE sent per step against
what DDP's all-reduce would have sent (log axis), from the metrics CSV a Lightning CSVLogger wrote with
SCAPE's comm/ keys: a Trainer fit with lightning_scape.CommunicationMonitor() in its callbacks, a Fabric loop
that logs CommunicationMonitor.compute(), or lightning-scape pretrain (OUT_DIR/logs/csv/.../metrics.csv).

  lightning-scape plot lightning_logs/version_0/metrics.csv
  lightning-scape plot out/pretrain/debug/logs/csv/version_0/metrics.csv --out debug.png
"""

DEMO_DESCRIPTION = """\
DDP + AdamS against SCAPE on real text, on 2 CPU processes of this machine (gloo): about 95 s on a quiet
2-core machine, about twice that on a busy one.

A small litgpt GPT (0.86M parameters, byte tokens) trains twice through Lightning Fabric with the same seed,
data order and learning-rate schedule: once as DDP + AdamS (every fp32 gradient all-reduced, what DDP sends,
and SCAPE's optimizer AdamS on every rank), once with SCAPE in the form it takes on a slow link: 2.5% of the
gradient values as 8-bit codes (about 1/80 of the bytes DDP sends a step) after a short dense warm-up and
density ramp. The text is a folder of your own (--data) or, by default, the Python standard library's sources
(no download).

The table prints the bytes each method sends per step, their ratio to DDP, the training throughput and the
final losses, with a note on what they mean; OUT/demo.csv holds every step and OUT/demo.png plots the loss
and the bytes sent per step. On one machine the processes talk over loopback, which is never the
bottleneck, so both methods train at about the same tokens/s: the wall-clock gain of sending 1/80 appears
on a slow network (benchmarks/network/, docs/benchmarks.md).
"""


def demo_parser() -> argparse.ArgumentParser:
    """The ``lightning-scape demo`` options; their names are the fields of ``examples.demo.DemoOptions``."""
    ap = argparse.ArgumentParser(
        prog=f"{PROG} demo", description=DEMO_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per process per step (default: %(default)s)")
    ap.add_argument("--block-size", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    ap.add_argument(
        "--lr", type=float, default=1.5e-3, help="peak learning rate, cosine schedule (default: %(default)s)"
    )
    ap.add_argument(
        "--dense-warmup-steps", type=int, default=30, help="SCAPE's dense warm-up steps (default: %(default)s)"
    )
    ap.add_argument(
        "--density-ramp-steps",
        type=int,
        default=150,
        help="SCAPE's density ramp after the warm-up, in steps (default: %(default)s)",
    )
    ap.add_argument("--density", type=float, default=0.025, help="SCAPE's density (default: %(default)s)")
    ap.add_argument(
        "--wire-format",
        choices=("int8", "full"),
        default="int8",
        help="SCAPE's wire: 8-bit codes, or values in the parameters' dtype (default: %(default)s)",
    )
    ap.add_argument(
        "--data", type=Path, default=None, help="a folder of text files, or one file (default: the Python stdlib's)"
    )
    ap.add_argument(
        "--tokenizer", choices=("byte", "bpe"), default="byte", help="byte tokens, or a BPE trained on the text"
    )
    ap.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (ignored for byte tokens)")
    ap.add_argument("--max-bytes", type=int, default=4_000_000, help="bytes of text to read (default: %(default)s)")
    ap.add_argument(
        "--eval-every", type=int, default=50, help="validation loss every N steps and after the last (default: 50)"
    )
    ap.add_argument("--out", type=Path, default=Path("out/demo"), help="where demo.csv and demo.png go")
    return ap


def demo_command(argv: list[str]) -> list[dict[str, Any]]:
    """``lightning-scape demo``: parse and check the options, then run the demo.

    Args:
        argv: The arguments after ``demo``.

    Returns:
        The demo's results (:func:`lightning_scape.examples.demo.run_demo`).

    Raises:
        SystemExit: With status 0 for ``--help``, 2 and a one-line message for bad arguments or a setting, text
            or output folder the demo cannot use.
    """
    parser = demo_parser()
    ns = parser.parse_args(argv)  # --help and bad values answer here, before torch is imported
    for flag, value in (("--steps", ns.steps), ("--batch-size", ns.batch_size), ("--eval-every", ns.eval_every)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    from lightning_scape.examples.demo import DemoError, DemoOptions, run_demo

    try:
        return run_demo(DemoOptions(**vars(ns)))
    except DemoError as exc:
        parser.error(str(exc))


def plot_parser() -> argparse.ArgumentParser:
    """The ``lightning-scape plot`` options."""
    ap = argparse.ArgumentParser(
        prog=f"{PROG} plot", description=PLOT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("metrics", type=Path, help="a CSVLogger metrics.csv with the comm/ keys")
    ap.add_argument("--out", type=Path, default=None, help="the PNG to write (default: scape.png beside the CSV)")
    ap.add_argument("--loss", default=None, help="the training loss column (default: train_loss, or litgpt's loss)")
    ap.add_argument("--val-loss", default=None, help="the validation loss column (default: val_loss)")
    return ap


def plot_command(argv: list[str]) -> Path:
    """``lightning-scape plot``: draw the demo's plot for a logged run.

    Args:
        argv: The arguments after ``plot``.

    Returns:
        The PNG written.

    Raises:
        SystemExit: With status 0 for ``--help``, 2 and a one-line message for a file that cannot be plotted.
    """
    parser = plot_parser()
    ns = parser.parse_args(argv)
    from lightning_scape.examples.run_plot import PlotError, plot_metrics_csv

    try:
        png = plot_metrics_csv(ns.metrics, ns.out, ns.loss, ns.val_loss)
    except PlotError as exc:
        parser.error(str(exc))
    print(f"plot: {png}")
    return png


ESTIMATE_DESCRIPTION = """\
Does SCAPE pay on your network? For a model, a cluster and one rank's compute per step, print what DDP
(fp32 all-reduce), DDP's bf16 hook and SCAPE at a few densities send per step, their predicted step time and
memory per rank, the link rate below which SCAPE reaches the same loss sooner (its step times the steps its
sparse phase needs, where measured), what its dense warm-up and density ramp cost, the form SCAPE's defaults
would choose, and the settings to use. Nothing is launched.

The bytes are the package's own ring formulas on the engine's layout; a collective takes its bytes over the
link plus one latency per ring step; DDP's all-reduces and SCAPE's value reduce-scatters overlap the
backward pass, SCAPE's parameter all-gathers do not. docs/benchmarks.md ("Predicted against measured")
states the model and compares it with the network benchmark.

  lightning-scape estimate --model Llama-3.2-1B --nodes 4 --procs-per-node 8 --bandwidth 25gbit --compute-ms 900
  lightning-scape estimate --model 160M --nodes 2 --bandwidth 1gbit --compute-ms 120 --scape-extra-ms 9
  lightning-scape estimate --model pythia-14m --nodes 2 --bandwidth 100mbit --measure   # a dry run here
"""

_COUNT = re.compile(r"^(\d+(?:\.\d*)?(?:e\d+)?)([kmbt]?)$", re.IGNORECASE)
_RATE = re.compile(r"^(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmgt])(?:bit(?:/s)?|bps|b/s)?$", re.IGNORECASE)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}


def parameter_count(text: str) -> int | None:
    """``1.2B``, ``160M``, ``7e9``, ``125000`` as a count of parameters; None for anything else (a config name)."""
    match = _COUNT.match(text.strip())
    return None if match is None else round(float(match[1]) * _SCALE[match[2].lower()])


def link_rate(text: str) -> float:
    """``25gbit``, ``100mbit``, ``1.5Gbit/s``, ``400gbps`` in bits per second (argparse type)."""
    match = _RATE.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a link rate; give a number and a unit: 25gbit, 100mbit")
    return float(match[1]) * _SCALE[match[2].lower()]


def estimate_parser() -> argparse.ArgumentParser:
    """The ``lightning-scape estimate`` options."""
    ap = argparse.ArgumentParser(
        prog=f"{PROG} estimate",
        description=ESTIMATE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="parameters (1.2B, 160M, 7e9) or a litgpt config (pythia-160m)")
    ap.add_argument("--nodes", type=int, required=True, help="machines")
    ap.add_argument("--procs-per-node", type=int, default=1, help="processes (GPUs) per machine (default: 1)")
    ap.add_argument(
        "--bandwidth", type=link_rate, required=True,
        help="each node's link to the others, per direction (25gbit); with --nodes 1, the link between processes",
    )  # fmt: skip
    ap.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency per message (default: 0)")
    ap.add_argument(
        "--efficiency", type=float, default=0.95,
        help="fraction of the rate that carries data: 0.95 for TCP (default), about 0.97 for RDMA",
    )  # fmt: skip
    ap.add_argument("--compute-ms", type=float, help="one rank's forward + backward + optimizer step, no communication")
    ap.add_argument(
        "--scape-extra-ms", default=None,
        help="what a SCAPE sparse step adds on one rank (the engine's own work): one value, or one per density",
    )  # fmt: skip
    ap.add_argument("--measure", action="store_true", help="measure the compute by a short dry run of the litgpt model")
    ap.add_argument("--batch-size", type=int, default=4, help="--measure: sequences per rank (default: 4)")
    ap.add_argument("--block-size", type=int, default=512, help="--measure: tokens per sequence (default: 512)")
    ap.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true", help="--measure's precision")
    ap.add_argument("--densities", default="0.1,0.01", help="SCAPE's densities, comma-separated (default: 0.1,0.01)")
    ap.add_argument("--dense-warmup-steps", type=int, default=None, help="SCAPE's dense warm-up (default: 30)")
    ap.add_argument("--density-ramp-steps", type=int, default=None, help="SCAPE's density ramp (default: 400)")
    ap.add_argument(
        "--wire-format",
        choices=("full", "int8"),
        default=None,
        help="how SCAPE's values travel (default: full; int8 with --densities 0.025 on slow links)",
    )
    ap.add_argument("--steps", type=int, default=None, help="the run's length: also print each method's total time")
    return ap


def _check_estimate_options(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Refuse, in one line, the option combinations that cannot work (no torch needed)."""
    if ns.nodes < 1 or ns.procs_per_node < 1:
        parser.error(f"--nodes ({ns.nodes}) and --procs-per-node ({ns.procs_per_node}) must be at least 1")
    if ns.nodes * ns.procs_per_node < 2:
        parser.error("one process sends nothing: give --nodes 2 or more, or --procs-per-node 2 or more")
    if (ns.compute_ms is None) == (not ns.measure):
        parser.error("give one of --compute-ms MS (one rank's step without communication) or --measure")
    if ns.compute_ms is not None and not ns.compute_ms > 0:
        parser.error(f"--compute-ms must be > 0, got {ns.compute_ms}")
    if ns.measure and parameter_count(ns.model) is not None:
        parser.error("--measure runs the model: name a litgpt config (e.g. pythia-160m), or give --compute-ms")
    if ns.measure and ns.scape_extra_ms is not None:
        parser.error("--measure measures SCAPE's own work: leave out --scape-extra-ms")
    if not ns.latency_ms >= 0:
        parser.error(f"--latency-ms must be >= 0, got {ns.latency_ms}")
    for flag, value in (("--steps", ns.steps), ("--batch-size", ns.batch_size), ("--block-size", ns.block_size)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")


def _estimate_numbers(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> tuple[list[float], list[float]]:
    """The densities, and SCAPE's extra seconds per density (empty: not given)."""
    try:
        densities = [float(d) for d in ns.densities.split(",")]
        extra = [float(x) / 1e3 for x in ns.scape_extra_ms.split(",")] if ns.scape_extra_ms else []
    except ValueError as exc:
        parser.error(f"--densities and --scape-extra-ms take comma-separated numbers: {exc}")
    if len(extra) not in (0, 1, len(densities)):
        parser.error(f"--scape-extra-ms: give one value or one per density ({len(densities)}), got {len(extra)}")
    if any(not x >= 0 for x in extra):
        parser.error(f"--scape-extra-ms must be >= 0, got {ns.scape_extra_ms}")
    return densities, (extra * len(densities) if len(extra) == 1 else extra)


def estimate_command(argv: list[str]) -> Any:
    """``lightning-scape estimate``: parse and check the options, predict, print.

    Args:
        argv: The arguments after ``estimate``.

    Returns:
        The :class:`~lightning_scape.planning.Estimate`.

    Raises:
        SystemExit: With status 0 for ``--help``, 2 and a one-line message for options that cannot work.
    """
    parser = estimate_parser()
    ns = parser.parse_args(argv)  # --help and malformed values answer here, before torch is imported
    _check_estimate_options(parser, ns)
    densities, extra = _estimate_numbers(parser, ns)
    from lightning_scape.config import ScapeConfig
    from lightning_scape.planning import Cluster, Link, StepCompute, estimate, format_estimate, parameter_groups
    from lightning_scape.planning.measure import litgpt_model, measure_litgpt

    schedule = {
        "dense_warmup_steps": ns.dense_warmup_steps,
        "density_ramp_steps": ns.density_ramp_steps,
        "wire_format": ns.wire_format,
    }
    W = ns.nodes * ns.procs_per_node
    try:
        config = ScapeConfig(**{k: v for k, v in schedule.items() if v is not None})
        for d in densities:
            config.replace(density=d)
        link = Link(ns.bandwidth, ns.latency_ms / 1e3, ns.efficiency)
        count = parameter_count(ns.model)
        groups = parameter_groups(numel=count) if count else parameter_groups(model=litgpt_model(ns.model))
        if ns.measure:
            print(f"measuring {ns.model} on this machine ({ns.batch_size} x {ns.block_size} tokens) ...", flush=True)
            compute, source = measure_litgpt(ns.model, W, densities, ns.batch_size, ns.block_size, config, ns.precision)
        else:
            given = dict(zip(densities, extra, strict=False))  # extra is empty when not given
            compute, source = StepCompute.from_total(ns.compute_ms / 1e3, given), "given"
    except ValueError as exc:
        parser.error(str(exc))
    est = estimate(groups, Cluster(ns.nodes, ns.procs_per_node, link), compute, densities, config, ns.steps)
    print(format_estimate(est, ns.model, source))
    return est


def usage() -> str:
    """``lightning-scape --help``: what the package is, and one line per command."""
    width = max(len(name) for name in COMMANDS) + 2
    lines = [
        f"usage: {PROG} COMMAND [options]",
        "",
        "SCAPE sparse-communication data-parallel training for PyTorch Lightning and Fabric.",
        "",
        "commands:",
        *(f"  {name:<{width}}{line}" for name, line in COMMANDS.items()),
        "",
        "options:",
        f"  {'-h, --help':<{width + 2}}show this message and exit",
        f"  {'--version':<{width + 2}}print the version and exit",
        "",
        f"'{PROG} COMMAND --help' lists a command's options.",
    ]
    return "\n".join(lines)


def _version() -> str:
    """The installed distribution's version, read from its metadata (no import of the package)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning-scape")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    """Dispatch a command.

    Args:
        argv: The arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The process exit code: 0 on success, 2 for a command line that cannot work.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if args[0] == "--version":
        print(f"{PROG} {_version()}")
        return 0
    command, rest = args[0], args[1:]
    if command == "demo":
        demo_command(rest)
        return 0
    if command == "pretrain":
        from lightning_scape.litgpt.pretrain import run_pretrain

        return run_pretrain(rest)
    if command == "estimate":
        estimate_command(rest)
        return 0
    if command == "plot":
        plot_command(rest)
        return 0
    what = "option" if command.startswith("-") else "command"
    print(
        f"usage: {PROG} COMMAND [options]\n{PROG}: error: unknown {what} {command!r}; the commands are "
        f"{', '.join(COMMANDS)} ('{PROG} --help' describes them)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
