"""The ``lightning-scape`` command line (also ``python -m lightning_scape``)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatch a sub-command.

    Args:
        argv: The arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The process exit code.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: lightning-scape demo [--steps N ...]                 dense AdamS against SCAPE on 2 CPU processes\n"
        "       lightning-scape pretrain --config RECIPE.yaml [...]  litgpt pretraining with SCAPE\n"
        "(add --help after a command for its options)"
    )
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        return 0
    command, rest = args[0], args[1:]
    if command == "demo":
        from lightning_scape.demo import run_demo

        run_demo(rest)
        return 0
    if command == "pretrain":
        from lightning_scape.pretrain import run_pretrain

        return run_pretrain(rest)
    print(f"lightning-scape: unknown command {command!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
