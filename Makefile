# The two commands a newcomer needs: `make demo` and `make test` (both set up .venv on first use).
.PHONY: setup demo test lint bench

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/ringtrain demo

test: setup
	scripts/test.sh

lint: setup
	.venv/bin/ruff check .

bench: setup
	.venv/bin/python -m bench.attention
