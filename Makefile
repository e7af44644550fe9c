# `make test`: set up .venv and run the tests.  `make run`: set up .venv and start the server
# (tiny built-in model; pass SERVE_ARGS='--port 9000 --controller greedy' to change it).
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
	$(BIN)/tidegate serve --model tiny $(SERVE_ARGS)

bench: $(STAMP)
	$(BIN)/tidegate bench --trace splitwise_conv --trace splitwise_code --out bench-out

clean:
	rm -rf $(VENV) bench-out .pytest_cache .hypothesis
