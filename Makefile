# `make test`: set up .venv and run the tests.  `make run`: set up .venv and run the main job.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tidegate-installed

.PHONY: setup test run bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

run: $(STAMP)
	$(BIN)/tidegate bench --trace splitwise_conv --first 2000 --out bench-out

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) bench-out .pytest_cache .hypothesis
