# nanrunbook: `make demo` and `make test` work on a fresh clone of a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch that the capture API's tests and examples run on.
TORCH ?= torch==2.13.0

.PHONY: demo test lint fuzz bench install clean fixtures

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,lint]' '$(TORCH)'
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	@echo '$$ nanrunbook check fixtures/hold-backward-dynamic-skip'
	@$(BIN)/nanrunbook check fixtures/hold-backward-dynamic-skip; status=$$?; \
	  echo; echo "exit code: $$status (1 = HOLD, 0 = CONTINUE, 3 = rejected)"; test $$status -eq 1

test: $(VENV)/.test-installed
	$(BIN)/python -m pytest -q

lint: $(VENV)/.test-installed
	$(BIN)/ruff check nanrunbook tests fixtures
	$(BIN)/ruff format --check nanrunbook tests fixtures
	$(BIN)/mypy

fixtures: $(VENV)/.installed
	$(BIN)/python fixtures/generate.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
