#!/usr/bin/env bash
# The whole test suite: lint, format check, type check, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# service/, api/ and workers/ as configured in pyproject [tool.mypy]: strict on service/ and api/, basic on workers/
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
