# `make test`: set up .venv, run the quality gates and the tests.  `make run`: set up .venv and start the server
# (tiny built-in model, the shipped learned policy; pass SERVE_ARGS='--port 9000 --controller greedy' to change it).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tidegate-installed

.PHONY: setup test lint run bench compile clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

test: lint
	$(BIN)/python -m pytest -q

# Quality gates: ruff (with the complexity limits), mypy on the torch-free core, and the
# import-linter contracts that keep dependencies pointing one way (pyproject.toml holds all three).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

run: $(STAMP)
	$(BIN)/tidegate serve --model tiny --controller learned $(SERVE_ARGS)

# The simulator's core compiled with mypyc into build/compiled, for `tidegate --compiled ...` and the speed
# benchmarks' --compiled (engine/sim/compiled.py); needs a C compiler.
compile: $(STAMP)
	$(BIN)/tidegate compile

bench: $(STAMP)
	$(BIN)/tidegate bench --trace splitwise_conv --trace splitwise_code --out bench-out

clean:
	rm -rf $(VENV) bench-out .pytest_cache .hypothesis build/compiled build/compiled.partial
