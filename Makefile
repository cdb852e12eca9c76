# The two commands a newcomer needs (both set up from nothing):
#   make demo   - install, then run the whole product on the tiny default (CPU, minutes)
#   make test   - install, then run the test suite (unit + integration + end-to-end)
SHELL := /bin/bash
.PHONY: setup demo test test-fast lint bench

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

test: setup
	source scripts/env.sh && pytest -q

test-fast: setup
	source scripts/env.sh && pytest -q -m "not slow"

lint: setup
	source scripts/env.sh && ruff check src flows tests bench && ruff format --check src flows tests bench

bench: setup
	source scripts/env.sh && for f in bench/*.py; do echo "== $$f"; python $$f || exit 1; done
