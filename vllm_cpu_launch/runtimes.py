"""Which OpenMP runtime a library file is, by its name, as vLLM tells them apart: one
classifier for `verify` (the files a process maps) and the plugin (the library that serves
`GOMP_parallel` inside a vLLM process, vllm_cpu_launch/inside.py)."""

from __future__ import annotations

import os

INTEL = "iomp"  # Intel's libiomp5
LLVM = "llvm"  # LLVM's libomp (Debian's libiomp5.so resolves to it): the same KMP_* interface
GNU = "gomp"
# The word each runtime has in the plugin's /metrics series (docs/operating.md); NONE where
# no OpenMP runtime serves.
METRIC_WORDS = {INTEL: "intel", LLVM: "llvm", GNU: "gnu"}
NONE = "none"
# The plugin's info metric (prometheus_client appends `_info` to an info family's name).
METRIC = "vllm_cpu_launch_openmp"
INFO_METRIC = f"{METRIC}_info"


def runtime_of(path: str) -> str | None:
    """Which OpenMP runtime a mapped file is, by its name (as vLLM tells them apart)."""
    name = os.path.basename(path)
    if "libiomp" in name:
        return INTEL
    if "libgomp" in name:
        return GNU
    if name.startswith("libomp") and not name.startswith("libomptarget"):
        return LLVM
    return None
