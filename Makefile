# Ragblend: `make dev` runs the whole product locally, `make test` runs the test suite.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: dev test test-fast lint bench clean-venv

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned, so no resolver ever reaches for a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

## dev: install, then run every service, the workers and the web server (Ctrl-C stops all)
dev: $(STAMP)
	$(BIN)/python -m deploy.devstack

## test: install, then run the whole suite (starts its own services and workers)
test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## test-fast: the suite without the slow end-to-end tests
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean-venv:
	rm -rf $(VENV)
