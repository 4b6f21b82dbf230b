"""Intel's OpenMP runtime, libiomp5: the intel-openmp wheel's, conda's, oneAPI's."""

from __future__ import annotations

from vllm_cpu_launch.runtimes.family import Family


class Intel(Family):
    value, word, title = "iomp", "intel", "Intel OpenMP"
    # Its stub and debugger libraries are no runtime to preload, but Intel's (libraries.py).
    sonames = ("libiomp5", "libiompstubs5", "libiomp5_db")
    prefixes = ("libiomp",)
    banner = b"Intel(R) OMP version"
    kmp = True
    vllm_names = ("libiomp", "libomp")  # libomptarget too, though no runtime
    files = ("libiomp5.so",)
    wheel = "intel-openmp"
    machines = ("x86_64",)  # vLLM looks for libiomp in LD_PRELOAD on x86 only


FAMILY: Family = Intel()
