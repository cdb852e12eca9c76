# The two commands a newcomer needs (both set up from nothing):
#   make demo   - install, then run the whole product on the tiny default (CPU, minutes)
#   make test   - install, then run the test suite (unit + integration + end-to-end)
SHELL := /bin/bash
.PHONY: setup demo test test-fast lint bench

# Two pytest-xdist workers: most slow tests are one busy process (a flow step, a server, a generation),
# so two run side by side on 2 cores; e2e tests are dispatched one by one, first, and every other module
# stays whole on one worker (tests/conftest.py). `make test PYTEST_WORKERS=0` runs in one process.
PYTEST_WORKERS ?= 2
PYTEST_DIST := -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

test: setup
	source scripts/env.sh && pytest -q $(PYTEST_DIST)

test-fast: setup
	source scripts/env.sh && pytest -q $(PYTEST_DIST) -m "not slow"

lint: setup
	source scripts/env.sh && ruff check src flows tests bench && ruff format --check src flows tests bench

bench: setup
	source scripts/env.sh && for f in bench/*.py; do echo "== $$f"; python $$f || exit 1; done
