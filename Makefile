# The two commands a newcomer needs: `make demo` and `make test` (both set up .venv on first use).
.PHONY: setup demo test test-fast lint bench

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/ringtrain demo

test: setup
	scripts/test.sh

test-fast: setup  # the unit tier without slow tests, on every core: under 5 minutes on 2
	scripts/test.sh --fast

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

bench: setup
	.venv/bin/python -m bench.attention
