# The two commands of the README: `make lab` (start the lessons) and `make test` (pass the tests).
# Both create or update a local virtual environment in .venv and are fast when nothing changed.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is installed on its own first: a requirement that the CPU build 2.13.0 satisfies keeps a
# CPU-only machine from downloading the several-GB CUDA build. On a GPU machine, or for another
# build, override it, e.g. `make test TORCH_SPEC=torch` or with PIP_EXTRA_INDEX_URL pointing at
# https://download.pytorch.org/whl/cpu.
TORCH_SPEC ?= torch==2.13.0
PORT   ?= 8888
NBVAL_FLAGS := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg

.PHONY: lab test unit notebooks clean-venv status-cpu

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	touch $@

$(VENV)/.lab: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q -e ".[lab]"
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.lab
	$(BIN)/python -m pip install -q -e ".[lab,test]"
	touch $@

# JupyterLab on loopback only, with its default random token (printed in the URL it shows).
lab: $(VENV)/.lab
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(PORT) \
		--ServerApp.root_dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

# Unit tests, then every notebook under strict nbval (outputs compared cell by cell). Figures the
# lessons draw during the tests go to test-artifacts/, so testing leaves the committed ones alone.
# TEST_WORKERS pytest processes (pytest-xdist); --dist loadscope keeps each test module, and each notebook's cells in
# order, in one process. 2 = CI's cores (on a 2-core machine like CI's: 18 min, against 33 in one process); 0 = one.
TEST_WORKERS ?= 2
test: $(VENV)/.test
	WB_FIGURES_DIR=$(CURDIR)/test-artifacts/figures $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope \
		tests notebooks $(NBVAL_FLAGS)

unit: $(VENV)/.test
	WB_FIGURES_DIR=$(CURDIR)/test-artifacts/figures $(BIN)/python -m pytest -q tests

notebooks: $(VENV)/.test
	WB_FIGURES_DIR=$(CURDIR)/test-artifacts/figures $(BIN)/python -m pytest -q notebooks $(NBVAL_FLAGS)

# `make test` timed from the start (installing included: after `make clean-venv` it is a first run) and counted,
# into results/status/cpu.json, then the README's status block rendered from it (scripts/status.py).
status-cpu:
	@start=$$(date +%s); PYTEST_ADDOPTS="--junitxml=$(CURDIR)/test-artifacts/make-test.xml" $(MAKE) test; rc=$$?; \
	$(BIN)/python scripts/status.py record cpu test-artifacts/make-test.xml --seconds $$(( $$(date +%s) - start )) \
		--venv $(VENV) && $(BIN)/python scripts/status.py --update-readme; exit $$rc

clean-venv:
	rm -rf $(VENV)
