#!/usr/bin/env bash
# The test suite. `scripts/test.sh` (make test): lint, format check, type check, then every test
# on every core (pytest-xdist).
# `scripts/test.sh --fast` (make test-fast): lint and format check, then tests/unit without `slow`
# tests on every core (pytest-xdist): what a developer runs on every change; mypy stays in make test
# and make lint. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
fast=0
if [ "${1:-}" = "--fast" ]; then fast=1; shift; fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ "$fast" = 1 ]; then
  exec .venv/bin/python -m pytest tests/unit -m "not slow" -n auto "$@"
fi
# service/, api/ and workers/ as configured in pyproject [tool.mypy]: strict on service/ and api/, basic on workers/
.venv/bin/mypy
# every core; loadgroup hands out one test at a time (a few ahead), in the order tests/conftest.py
# puts them on each worker: the longest first
exec .venv/bin/python -m pytest -n auto --dist loadgroup "$@"
