"""LLVM's OpenMP runtime, libomp: the same KMP_* interface as Intel's; the cmeel-libomp
wheel's libiomp5.so alias (its SONAME libomp.so), Debian's libomp.so.5."""

from __future__ import annotations

from vllm_cpu_launch.runtimes.family import Family


class LLVM(Family):
    value, word, title = "llvm", "llvm", "LLVM OpenMP"
    sonames = ("libomp",)
    prefixes = ("libomp",)
    banner = b"LLVM OMP version"
    kmp = True
    files = ("libiomp5.so",)  # vLLM takes its aliases for Intel's
    wheel = "cmeel-libomp"  # x86-64 and aarch64 wheels
    opt_in = ("aarch64",)  # the one KMP runtime built there
    stand_in = True  # preloaded only where no Intel OpenMP is found, by a runtimes rule

    def named(self, name: str) -> bool:
        return super().named(name) and not name.startswith("libomptarget")


FAMILY: Family = LLVM()
