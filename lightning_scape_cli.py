"""The ``lightning-scape`` command line: ``demo`` and ``pretrain`` (also ``python -m lightning_scape``).

This module lies outside the ``lightning_scape`` package on purpose. Importing the package imports torch
and Lightning (``import lightning_scape`` registers ``strategy="scape"``), which takes seconds; from here
``lightning-scape --help``, ``demo --help`` and the demo's argument errors answer without them, and a command
imports the package only when it runs (``tests/test_demo.py`` checks that torch stays unimported). The
package never imports this module: the demo receives its parsed options as a
:class:`~lightning_scape.examples.demo.DemoOptions`. ``pretrain --help`` needs the package: its options are
read from litgpt's and SCAPE's own classes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

PROG = "lightning-scape"

# One line per command, for ``lightning-scape --help``.
COMMANDS: dict[str, str] = {
    "demo": "dense AdamS against SCAPE (d=0.01) on 2 CPU processes on real text: bytes per step, losses, a plot",
    "pretrain": "pretrain a litgpt model with SCAPE from a YAML recipe (recipes/debug.yaml: 2 CPU processes)",
}

DEMO_DESCRIPTION = """\
Dense AdamS against SCAPE on real text, on 2 CPU processes of this machine (gloo): about 2-3 minutes on
2 cores.

A small litgpt GPT (0.86M parameters, byte tokens) trains twice through Lightning Fabric with the same seed,
data order and learning-rate schedule: once dense (every gradient all-reduced, what DDP sends), once with
SCAPE, which sends 1% of the gradient values after a short dense warm-up. The text is a folder of your own
(--data) or, by default, the Python standard library's sources (no download).

The table prints the bytes each method sends per step, their ratio to DDP, the training throughput and the
final losses, with a note on what they mean; OUT/demo.csv holds every step and OUT/demo.png plots the loss
and the bytes sent per step. On one machine the processes talk over loopback, which is never the
bottleneck, so both methods train at about the same tokens/s: the wall-clock gain of sending 1% appears
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
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate, cosine schedule (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=30, help="SCAPE's dense warm-up steps (default: %(default)s)")
    ap.add_argument(
        "--ramp", type=int, default=60, help="SCAPE's density ramp after the warm-up, in steps (default: %(default)s)"
    )
    ap.add_argument("--density", type=float, default=0.01, help="SCAPE's density (default: %(default)s)")
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
    what = "option" if command.startswith("-") else "command"
    print(
        f"usage: {PROG} COMMAND [options]\n{PROG}: error: unknown {what} {command!r}; the commands are "
        f"{', '.join(COMMANDS)} ('{PROG} --help' describes them)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
