# Sets up a fresh machine by itself: a virtualenv in .venv, the CPU build of torch where none is
# installed, recsave in editable mode with its test and lint extras, then runs what was asked.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=
STAMP := $(VENV)/.recsave-installed
CSRC := $(shell find csrc -name '*.h' -o -name '*.cc' 2>/dev/null)

.PHONY: setup build lint test test-quick test-cpp demo bench clean

setup: $(STAMP)

$(STAMP): setup.cfg setup.py pyproject.toml $(CSRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# A bare `torch` requirement would pull a multi-GB CUDA build: install the CPU build first.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q "setuptools>=64" wheel "pybind11>=2.11"
	$(PY) -m pip install -q --no-build-isolation -e ".[test,lint]"
	touch $(STAMP)

# Rebuild the extension in place after editing csrc/ (what `setup` does when sources changed).
build: setup
	$(PY) setup.py -q build_ext --inplace

# ruff (style, imports, private-member access, bug finders; the library, its tests and benchmarks)
# and mypy (the library), configured in pyproject.toml. Both run, then the target fails if either
# found something.
lint: setup
	status=0; $(PY) -m ruff check recsave tests benchmarks || status=1; $(PY) -m mypy recsave || status=1; \
	exit $$status

# Test processes (pytest-xdist): many tests wait on child processes, gloo ranks or a local S3
# server, so two workers on 2 cores took the suite from about 23 minutes to 16 (a clean-clone CI
# run, quiet VM); 0 runs them in this process (for pdb, or one test's output).
TEST_WORKERS ?= 2

# The whole suite (what CI runs).
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS) tests

# For the edit-test loop, without the tests marked slow (large files, stress, killed
# subprocesses), multirank (gloo process groups) or s3 (a local S3 server).
test-quick: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow and not multirank and not s3" $(PYTEST_ARGS) tests

# The C++ core on its own (no Python), as the pytest suite also does.
test-cpp:
	mkdir -p build
	g++ -std=c++17 -O2 -Wall -pthread -Icsrc csrc/tests/core_test.cc csrc/core/crc32c.cc \
	    csrc/core/shard_io.cc csrc/core/thread_pool.cc csrc/core/row_copy.cc -o build/core_test && build/core_test

demo: setup
	$(PY) -m recsave.tools.demo

# recsave against torch.save / DCP / safetensors / raw I/O on a >= 2 GB state, then the id map and
# training-step benchmark (benchmarks/README.md; `pip install -e ".[bench]"` for compare.py --sweep's plot).
bench: setup
	$(PY) benchmarks/compare.py
	$(PY) benchmarks/hashtable.py

clean:
	rm -rf build dist *.egg-info recsave/_C*.so recsave/_cuda_kernels.so
