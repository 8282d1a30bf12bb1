#!/usr/bin/env bash
# Every check CI runs, on a checkout installed in .venv (README.md, "Tests"): lint, formatting, types, the
# single-process tests (two workers), then the multi-process ones two test files at a time (pytest -m dist: they
# spawn processes).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -q -m "not dist" -n 2
.venv/bin/python -m pytest -q -m dist -n 2 --dist loadfile
