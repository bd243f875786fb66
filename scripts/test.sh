#!/usr/bin/env bash
# The whole test suite: lint, format check, type check, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# strict on service/ and api/ (pyproject [tool.mypy]); workers/ is read here only for the types it exports until its
# remaining errors are fixed, then this becomes plain `.venv/bin/mypy` (service, api and workers as configured)
.venv/bin/mypy --follow-imports=silent service api
exec .venv/bin/python -m pytest "$@"
