# attn — the two commands a new machine needs:
#   make demo   set up, build, and run the embedded demo
#   make test   set up, build, and run every test tier
# Everything missing is installed by scripts/bootstrap.sh (apt-get, pip).

MAKEFLAGS += --no-print-directory

BUILD      ?= build
ASAN_BUILD ?= build-asan
PYTHON     ?= python3
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=

.PHONY: all demo build test test-c test-asan test-python python clean help

all: build

help:
	@echo "make demo        build and run the demo"
	@echo "make test        the C suite, the sanitizer tier (ASan+UBSan), the Python suite"
	@echo "make python      pip install the Python package attn (warnings are errors)"
	@echo "make test-python the Python package against PyTorch 2.13 (ATTN_TEST_SEED=N)"
	@echo "make clean       remove build trees"

build:
	@./scripts/bootstrap.sh build
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DATTN_WERROR=ON $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

demo: build
	@$(BUILD)/tools/attn

# ---- tests ----

test: test-c test-asan test-python

# Quick tier: warnings are errors; ctest prints its own summary.
test-c: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# Sanitizer tier: the same suite built with ASan + UBSan.
test-asan:
	@./scripts/bootstrap.sh build
	@cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DATTN_WERROR=ON -DATTN_SANITIZE=ON \
		-DATTN_BUILD_BENCH=OFF $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(ASAN_BUILD) -j $(JOBS)
	@cd $(ASAN_BUILD) && ctest --output-on-failure -j $(JOBS)

# Python tier: the package built from this tree, then the conformance suite
# against real PyTorch (pinned by bootstrap.sh); pytest prints its summary.
python:
	@./scripts/bootstrap.sh build python
	@$(PYTHON) -m pip install --disable-pip-version-check --root-user-action=ignore -q \
		--no-build-isolation --config-settings=cmake.define.ATTN_WERROR=ON .

test-python: python
	@$(PYTHON) -m pytest tests/python -q -p no:cacheprovider

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) build-python
