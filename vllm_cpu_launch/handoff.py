"""What the launcher and the plugin share: what a library is by its file's name, the name
of the variable that preloads it, and the mark a vLLM process inherits that tells the
plugin to leave it alone.

One classifier of a library's file name (library_of) serves every reader: the plan (the
caller's LD_PRELOAD entries, read once into libraries.Host.preload), `verify` (the files a
process maps), doctor, tune and the plugin (the library that serves `GOMP_parallel`
inside a vLLM process, inside.py). vLLM reads LD_PRELOAD otherwise, by substrings of its
whole text; where the launcher predicts what vLLM does, it reads it as vLLM does
(vllm_reads). The plugin runs in every vLLM process; in all but the front end it must stop
at once, with nothing imported: stands_down() decides that from the environment, the
machine and whether multiprocessing started the process (doctor asks it too), and the
plans write the mark it reads (docs/design.md, "The plugin").
"""

from __future__ import annotations

import enum
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping


# What a library is, by its file's name

LD_PRELOAD = "LD_PRELOAD"  # the loader's variable, which vLLM reads too


class Library(enum.Enum):
    """What a library is, by its file's name; the value is its kind in verify's JSON."""

    INTEL = "iomp"  # Intel's OpenMP runtime, libiomp5 (Debian's libiomp5.so alias of LLVM's too)
    LLVM = "llvm"  # LLVM's libomp: the same KMP_* interface as Intel's
    GNU = "gomp"  # GNU libgomp (torch's, sentencepiece's renamed copy)
    TCMALLOC = "tcmalloc"  # gperftools' tcmalloc (libtcmalloc, libtcmalloc_minimal)
    MALLOC = "malloc"  # another malloc: jemalloc, mimalloc
    OTHER = "other"

    @property
    def runtime(self) -> bool:
        """An OpenMP runtime."""
        return self in (Library.INTEL, Library.LLVM, Library.GNU)

    @property
    def kmp(self) -> bool:
        """A runtime of Intel's interface (KMP_* variables), Intel's or LLVM's: what vLLM
        takes for Intel OpenMP."""
        return self in (Library.INTEL, Library.LLVM)

    @property
    def allocator(self) -> bool:
        """A malloc: tcmalloc or another."""
        return self in (Library.TCMALLOC, Library.MALLOC)

    @property
    def title(self) -> str:
        """The library's name for people (verify's and doctor's text)."""
        return TITLES[self]


TITLES = {
    Library.INTEL: "Intel OpenMP",
    Library.LLVM: "LLVM OpenMP",
    Library.GNU: "GNU libgomp",
    Library.TCMALLOC: "tcmalloc",
    Library.MALLOC: "another malloc",
    Library.OTHER: "another library",
}
MALLOC_NAMES = ("libjemalloc", "libmimalloc")
# The word each runtime has in the plugin's /metrics series (docs/operating.md); NONE where
# no OpenMP runtime serves.
METRIC_WORDS = {Library.INTEL: "intel", Library.LLVM: "llvm", Library.GNU: "gnu"}
NONE = "none"
# The plugin's info metric (prometheus_client appends `_info` to an info family's name).
METRIC = "vllm_cpu_launch_openmp"
INFO_METRIC = f"{METRIC}_info"


def library_of(path: str) -> Library:
    """What the library at `path` (an LD_PRELOAD entry, a mapped file) is, by its file's
    name: the file the loader loads. A directory's name says nothing (`/opt/libomp-17/`),
    nor does LLVM's offloading library (libomptarget), which is no runtime."""
    name = os.path.basename(path)
    if "libiomp" in name:
        return Library.INTEL
    if "libgomp" in name:
        return Library.GNU
    if name.startswith("libomp") and not name.startswith("libomptarget"):
        return Library.LLVM
    if "libtcmalloc" in name:
        return Library.TCMALLOC
    return Library.MALLOC if any(m in name for m in MALLOC_NAMES) else Library.OTHER


def vllm_reads(ld_preload: str) -> frozenset[Library]:
    """The OpenMP runtimes vLLM finds in an LD_PRELOAD text (the whole value, or one entry):
    Library.INTEL where its `libiomp` or `libomp` test holds, Library.GNU where `libgomp`
    does (vllm/utils/ompmultiprocessing.py, use_iomp and use_gomp: it asserts not both;
    CpuPlatform.check_and_update_config adds its libgomp only where it finds neither).

    The one other reading, kept where the launcher predicts what vLLM does: vLLM tests
    substrings of the whole text, so a directory's name counts (`/opt/libomp-17/libgomp.so.1`
    is both to vLLM, a GNU libgomp to library_of) and so does libomptarget (Intel's to
    vLLM, no runtime to library_of)."""
    found = set()
    if "libiomp" in ld_preload or "libomp" in ld_preload:
        found.add(Library.INTEL)
    if "libgomp" in ld_preload:
        found.add(Library.GNU)
    return frozenset(found)


# The mark the plugin reads

# The plan's mark, which tells vLLM's plugin that a process was started with a plan
# already, and `verify` why libgomp is loaded. Its value is who planned (launcher, plugin),
# alone where the plan keeps libgomp by the user's word (`iomp: never`), the one choice
# LD_PRELOAD does not show; else with one of the suffixes below. The plugin marks only
# where it keeps libgomp for SD: the processes vLLM spawns after it carry their runtime in
# LD_PRELOAD, and stand down on that.
PLANNED_VARIABLE = "VLLMCPULAUNCH_PLANNED"
LAUNCHER, PLUGIN = "launcher", "plugin"  # who planned
# Appended to the planner where the plan keeps libgomp only because no usable Intel OpenMP
# was found: the plugin still leaves those processes alone (the warning was said once), but
# `verify` does not count that libgomp as chosen.
NOT_FOUND_MARK = ":not-found"
# Appended to the launcher where the LD_PRELOAD it hands over names an OpenMP runtime
# (Intel OpenMP it preloads, or the caller's runtime, kept) and no other mark is due:
# vLLM's plugin plans a front end whose LD_PRELOAD names one (vLLM's CPU image), but not
# the process the launcher execs, whose plan the launcher has said.
STARTED_MARK = ":started"
# The launcher's off switch for the plugin (also the config key `plugin`).
PLUGIN_VARIABLE = "VLLMCPULAUNCH_PLUGIN"
# Its name before our variables left vLLM's VLLM_* namespace, still obeyed
# (settings.with_current_names says it is deprecated).
DEPRECATED_PLUGIN_VARIABLE = "VLLM_CPU_LAUNCH_PLUGIN"
# The plugin's entry point name (setup.cfg), which vLLM's VLLM_PLUGINS allowlist names.
PLUGIN_NAME = "vllm_cpu_launch"
IOMP_MACHINES = ("x86_64",)  # vLLM looks for libiomp in LD_PRELOAD on x86 only
# Where LLVM's libomp is the one KMP-style runtime built (intel-openmp has no wheel there):
# preloaded with `--iomp always` alone until measured on such a host (docs/design.md).
LLVM_OPT_IN_MACHINES = ("aarch64",)
# The words a yes/no setting accepts (settings.parse_bool), in any case. An empty
# variable of ours is the same as an unset one (docs/design.md).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def already_planned(environ: Mapping[str, str]) -> str | None:
    """Why this process needs no plan: the mark of a plan it was started with; else None."""
    planner = environ.get(PLANNED_VARIABLE)
    if planner:
        return f"{PLANNED_VARIABLE}={planner}: started with a plan already"
    return None


def switched_off(environ: Mapping[str, str]) -> str | None:
    """`VARIABLE=VALUE` of the off switch that is set here to a no, the current name's
    over the deprecated one's; else None."""
    for variable in (PLUGIN_VARIABLE, DEPRECATED_PLUGIN_VARIABLE):
        switch = environ.get(variable)
        if switch:  # empty is unset
            return f"{variable}={switch}" if switch.lower() in FALSE_WORDS else None
    return None


def stands_down(environ: Mapping[str, str], machine: str, spawned: bool) -> str | None:
    """Why the plugin leaves this process alone, from what costs nothing to read; None if
    it may plan. `spawned`: started by Python's multiprocessing, as vLLM starts its engine
    cores, workers and extra API servers; each inherits LD_PRELOAD with the OpenMP runtime
    its front end chose in it (vLLM's libgomp, the plan's libiomp5, the caller's), so they
    all stop here. A front end whose LD_PRELOAD names a runtime (vLLM's CPU image sets one
    for every process) does not: the plan keeps it and says so."""
    switch = switched_off(environ)
    if switch:
        return f"switched off by {switch}"
    planned = already_planned(environ)
    if planned:
        return planned
    if spawned and vllm_reads(environ.get(LD_PRELOAD, "")):
        return "a process vLLM started: LD_PRELOAD names the runtime its front end chose"
    if machine not in IOMP_MACHINES:
        return f"this host is {machine}, not x86-64"
    return None
