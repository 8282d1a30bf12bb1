"""``python -m lightning_scape``: the ``lightning-scape`` command line (:mod:`lightning_scape_cli`)."""

from __future__ import annotations

import sys

from lightning_scape_cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
