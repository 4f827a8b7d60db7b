#!/usr/bin/env bash
# blas_cores.sh — the OpenBLAS kernel sets ("cores", the names
# OPENBLAS_CORETYPE takes) whose sgemm/dgemm this CPU and OS can run, read
# from the flags Linux lists (a flag appears only when the OS saves its
# registers). make test-determinism runs the thread-count tests under each.
set -euo pipefail
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { for f in "$@"; do [[ $flags == *" $f "* ]] || return 1; done; }

cores=(Prescott)
if has avx2 fma; then cores+=(Haswell Zen); fi
if has avx512f avx512bw avx512dq avx512vl avx512cd; then
    cores+=(SkylakeX)
    if has avx512_bf16; then cores+=(Cooperlake); fi
    if has avx512_bf16 avx512_fp16 amx_tile amx_bf16; then cores+=(SapphireRapids); fi
fi
echo "${cores[@]}"
