# attn — the two commands a new machine needs:
#   make demo   set up, build, and run the embedded demo
#   make test   set up, build, and run every test tier
# Everything missing is installed by scripts/bootstrap.sh (apt-get, pip).

MAKEFLAGS += --no-print-directory

BUILD      ?= build
ASAN_BUILD ?= build-asan
# The sanitizer builds: debug information, asserts kept, at -O1 as the
# sanitizers' documentation advises: the ASan+UBSan suite ran about twice
# as fast as at -O0 (test_backward 33 -> 16 s, Intel Xeon family 6 model
# 207, 2026-12-01), which keeps CI (90 minutes) well inside its budget.
SANITIZER_BUILD_TYPE = -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-O1 -g"
TSAN_BUILD ?= build-tsan
INSTALL_BUILD ?= build-install
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= fuzz_npy fuzz_sdpa fuzz_mha fuzz_safetensors fuzz_serving
PYTHON     ?= python3
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=

.PHONY: all demo build bench bench-counts bench-ring test test-c test-asan test-python test-determinism test-python-asan python test-install test-tsan test-valgrind fuzz fuzz-build clean help

all: build

help:
	@echo "make demo        build and run the demo"
	@echo "make test        the C suite, the sanitizer tier (ASan+UBSan), the Python suite, the install test"
	@echo "make test-determinism  MHA bits for 1-4 threads under every OpenBLAS core and kernel path"
	@echo "make python      pip install the Python package attn (warnings are errors)"
	@echo "make test-python the Python package against PyTorch 2.13 (ATTN_TEST_SEED=N)"
	@echo "make test-python-asan  the Python suite on an ASan+UBSan build of the extension"
	@echo "make test-install  install to a temporary prefix; build the README example with pkg-config and find_package"
	@echo "make test-tsan   the concurrency test under ThreadSanitizer (no OpenMP)"
	@echo "make test-valgrind  the attn tool (demo, sdpa on fixtures) under valgrind memcheck"
	@echo "make fuzz        build the libFuzzer targets (clang) and run each FUZZ_SECONDS (60)"
	@echo "make bench       attn vs PyTorch side by side (BENCH_ARGS=--quick for a smoke run)"
	@echo "make bench-ring  ring attention over MPI: 1 -> 2 ranks, one host and over a veth pair"
	@echo "make bench-counts  instructions per call of the kernels under callgrind, per commit (avx2, generic)"
	@echo "make clean       remove build trees"

build:
	@./scripts/bootstrap.sh build mpi
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DATTN_WERROR=ON $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

demo: build
	@$(BUILD)/tools/attn

# attn against PyTorch in one run; writes bench/results/ (see bench/run.py).
BENCH_ARGS ?=
bench: build python
	@./scripts/bootstrap.sh bench
	@$(PYTHON) bench/run.py --bench-bin $(BUILD)/bench/attn_bench $(BENCH_ARGS)

# Instruction counts of the kernels under callgrind, per commit, in
# bench/results/<cpu>/counts.json and counts.md (bench/counts.py).
bench-counts: build
	@./scripts/bootstrap.sh valgrind
	@$(PYTHON) bench/counts.py --bench-bin $(BUILD)/bench/attn_bench

# attn_ring 1 -> 2 ranks, one host and two network namespaces over a veth
# (root); writes bench/results/<cpu>/ring.json and ring.md (bench/ring_run.py).
RING_BENCH_ARGS ?=
bench-ring: build
	@$(PYTHON) bench/ring_run.py --build $(BUILD) $(RING_BENCH_ARGS)

# ---- tests ----

test: test-c test-asan test-python test-determinism test-install

# Quick tier: warnings are errors; ctest prints its own summary.
test-c: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# Sanitizer tier: the same suite built with ASan + UBSan.
test-asan:
	@./scripts/bootstrap.sh build
	@cmake -S . -B $(ASAN_BUILD) $(SANITIZER_BUILD_TYPE) -DATTN_WERROR=ON -DATTN_SANITIZE=ON \
		-DATTN_BUILD_BENCH=OFF $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(ASAN_BUILD) -j $(JOBS)
	@cd $(ASAN_BUILD) && ctest --output-on-failure -j $(JOBS)

# Python tier: the package built from this tree, then the conformance suite
# against real PyTorch (pinned by bootstrap.sh); pytest prints its summary.
python:
	@./scripts/bootstrap.sh build mpi python
	@$(PYTHON) -m pip install --disable-pip-version-check --root-user-action=ignore -q \
		--no-build-isolation --config-settings=cmake.define.ATTN_WERROR=ON .

# The whole suite on the best path, then the conformance tests again on every
# other kernel path this machine supports (ATTN_ISA forces a path).
CONFORMANCE = tests/python/test_sdpa_conformance.py tests/python/test_mha_conformance.py \
	tests/python/test_half_conformance.py tests/python/test_mha_half_conformance.py
test-python: python build # build: tests/python/test_cli_mha.py runs build/tools/attn
	@$(PYTHON) -m pytest tests/python -q -p no:cacheprovider
	@for isa in $$($(PYTHON) -c 'import attn; i = attn.kernel_info(); \
		print(" ".join(p for p in i["supported_isas"] if p != i["isa"]))'); do \
		echo "conformance on the $$isa path:"; \
		ATTN_ISA=$$isa $(PYTHON) -m pytest $(CONFORMANCE) -q -p no:cacheprovider || exit 1; \
	done

# Bitwise thread-count independence of MHA (1-4 threads) under every
# OpenBLAS kernel set this CPU can run, and, for the C test, every kernel
# path: a CPU whose OpenBLAS core differs from the developer's cannot turn
# CI red unnoticed (issue 9).
test-determinism: build python
	@isas=$$($(BUILD)/tools/attn info | sed -n 's/^supported paths: //p'); \
	for core in $$(./scripts/blas_cores.sh); do \
		for isa in $$isas; do \
			OPENBLAS_CORETYPE=$$core ATTN_ISA=$$isa $(BUILD)/tests/c/test_mha >/dev/null 2>&1 || \
				{ echo "test_mha failed: OPENBLAS_CORETYPE=$$core ATTN_ISA=$$isa"; \
				  OPENBLAS_CORETYPE=$$core ATTN_ISA=$$isa $(BUILD)/tests/c/test_mha | tail -20; exit 1; }; \
		done; \
		out=$$(OPENBLAS_CORETYPE=$$core $(PYTHON) -m pytest tests/python/test_api.py -q \
			-p no:cacheprovider -k thread_count 2>&1) || { echo "$$out"; exit 1; }; \
		printf 'determinism, OpenBLAS core %-14s C (%s): ok; Python: %s\n' $$core "$$isas" \
			"$$(echo "$$out" | tail -1)"; \
	done

# The Python suite on the extension and library built with ASan + UBSan
# (not part of `make test`: it takes a few minutes). Python itself is not
# instrumented, so the runtimes are preloaded and leak checks are off.
PY_ASAN_BUILD ?= build-python-asan
test-python-asan:
	@./scripts/bootstrap.sh build python
	@cmake -S . -B $(PY_ASAN_BUILD) $(SANITIZER_BUILD_TYPE) -DATTN_WERROR=ON -DATTN_SANITIZE=ON \
		-DATTN_BUILD_PYTHON=ON -DATTN_BUILD_TESTS=OFF -DATTN_BUILD_TOOLS=OFF \
		-DATTN_BUILD_BENCH=OFF -DPython_EXECUTABLE=$$(command -v $(PYTHON)) $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(PY_ASAN_BUILD) -j $(JOBS) --target _attn
	@rm -rf $(PY_ASAN_BUILD)/pkg && mkdir -p $(PY_ASAN_BUILD)/pkg/attn
	@cp python/attn/*.py $(PY_ASAN_BUILD)/python/_attn*.so $(PY_ASAN_BUILD)/pkg/attn/
	@LD_PRELOAD="$$(cc -print-file-name=libasan.so) $$(cc -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 PYTHONPATH=$(PY_ASAN_BUILD)/pkg \
		$(PYTHON) -m pytest tests/python -q -p no:cacheprovider

# Install tier: cmake --install to a temporary prefix, then the README's
# example built against it with pkg-config (shared and static) and
# find_package, again after moving the prefix, and with a multiarch LIBDIR.
test-install:
	@./scripts/bootstrap.sh build
	@JOBS=$(JOBS) ./scripts/test_install.sh $(INSTALL_BUILD) $(CMAKE_FLAGS)

# ThreadSanitizer tier: 8 caller threads race through SDPA and MHA. The
# library is built without OpenMP: GCC's libgomp is not instrumented, so its
# barriers look like races to TSan (see docs/RELIABILITY.md).
test-tsan:
	@./scripts/bootstrap.sh build
	@cmake -S . -B $(TSAN_BUILD) $(SANITIZER_BUILD_TYPE) -DATTN_WERROR=ON -DATTN_TSAN=ON \
		-DATTN_OPENMP=OFF -DATTN_BUILD_BENCH=OFF $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(TSAN_BUILD) -j $(JOBS) --target test_concurrency
	@cd $(TSAN_BUILD) && TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 \
		suppressions=$(CURDIR)/tests/tsan/attn.supp $(TSAN_OPTIONS)" \
		ATTN_CONCURRENCY_ITERS=200 ctest --output-on-failure -R '^test_concurrency$$'

# Valgrind tier: the attn tool, built as users get it (Release, OpenMP,
# OpenBLAS), under memcheck: zero errors, no definite or indirect leaks.
test-valgrind: build
	@./scripts/bootstrap.sh valgrind
	@./scripts/valgrind_cli.sh $(BUILD)

# Fuzz tier: libFuzzer + ASan + UBSan with clang, in its own build tree.
# OpenMP is off there: one thread per input keeps executions fast and
# reproducible (the thread pool is covered by the concurrency tests).
fuzz-build:
	@./scripts/bootstrap.sh build fuzz
	@cmake -S . -B $(FUZZ_BUILD) -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DATTN_FUZZ=ON -DATTN_OPENMP=OFF -DATTN_WERROR=ON -DATTN_BUILD_TESTS=OFF \
		-DATTN_BUILD_TOOLS=OFF -DATTN_BUILD_BENCH=OFF $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(FUZZ_BUILD) -j $(JOBS)

fuzz: fuzz-build
	@./scripts/fuzz.sh $(FUZZ_BUILD) $(FUZZ_SECONDS) $(FUZZ_TARGETS)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) build-python $(PY_ASAN_BUILD) $(TSAN_BUILD) $(FUZZ_BUILD) $(INSTALL_BUILD)
