#!/usr/bin/env bash
# The test suite. `scripts/test.sh` (make test): lint and format check, then every test on every
# core (pytest-xdist) with the type check beside them.
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
# service/, api/ and workers/ as configured in pyproject [tool.mypy]: strict on service/ and api/,
# basic on workers/. It runs beside the tests (about 90 s of one core that the first tests, which
# mostly wait on Ray, leave idle) and its verdict is printed and counted after them.
mypy_log="$(mktemp)"
.venv/bin/mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
trap 'kill "$mypy_pid" 2>/dev/null || true; rm -f "$mypy_log"' EXIT
# every core (RINGTRAIN_TEST_WORKERS overrides); loadgroup hands out one test at a time (a few
# ahead), in the order tests/conftest.py puts them on each worker: the longest first.
workers="${RINGTRAIN_TEST_WORKERS:-auto}"
rc=0
.venv/bin/python -m pytest -n "$workers" --dist loadgroup "$@" || rc=$?
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
echo "mypy:"
cat "$mypy_log"
if [ "$mypy_rc" != 0 ]; then echo "mypy failed (exit $mypy_rc)" >&2; fi
exit "$(( rc != 0 ? rc : mypy_rc ))"
