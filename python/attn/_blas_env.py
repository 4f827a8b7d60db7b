"""OpenBLAS's kernels for this CPU, chosen before OpenBLAS is loaded.

A DYNAMIC_ARCH OpenBLAS picks its kernels once, when it is loaded, from the
CPU's family and model. A release older than the CPU (Debian 12's 0.3.21 on
Emerald Rapids, say) does not know the model and falls back to its SSE3
"Prescott" kernels, several times slower for MHA's projections. The CPU's
feature flags say which kernels it can run, so while the extension (and with
it OpenBLAS) is imported, OPENBLAS_CORETYPE names them, unless the user set
it. The variable is restored afterwards: nothing else in the process sees it.
"""
import contextlib
import os


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def core_for_flags(flags):
    """The OpenBLAS core whose sgemm/dgemm kernels these x86 flags can run
    (Linux lists a flag only when the OS saves its registers), or None."""
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


@contextlib.contextmanager
def openblas_core_for_this_cpu():
    core = None if "OPENBLAS_CORETYPE" in os.environ else core_for_flags(_cpu_flags())
    if core is not None:
        os.environ["OPENBLAS_CORETYPE"] = core
    try:
        yield
    finally:
        if core is not None:
            del os.environ["OPENBLAS_CORETYPE"]
