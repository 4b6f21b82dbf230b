"""What the launcher and the plugin share: the OpenMP runtimes by name, and the mark a vLLM
process inherits that tells the plugin to leave it alone.

One classifier of a library file's name, as vLLM tells the runtimes apart, serves
`verify` (the files a process maps) and the plugin (the library that serves
`GOMP_parallel` inside a vLLM process, inside.py). The plugin runs in every vLLM process;
in all but the front end it must stop at once, with nothing imported: stands_down()
decides that from the environment, the machine and whether multiprocessing started the
process (doctor asks it too), and the plans write the mark it reads (docs/design.md,
"The plugin").
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping


# The OpenMP runtimes, by a library file's name

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


def names_openmp_runtime(ld_preload: str) -> bool:
    """vLLM's own test (CpuPlatform.check_and_update_config): with any of these in
    LD_PRELOAD it adds no libgomp, so an OpenMP runtime has been chosen already, by the
    launcher, the user, or vLLM itself for a process it started."""
    return "libomp" in ld_preload or "libgomp" in ld_preload or "libiomp" in ld_preload


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
    if spawned and names_openmp_runtime(environ.get("LD_PRELOAD", "")):
        return "a process vLLM started: LD_PRELOAD names the runtime its front end chose"
    if machine not in IOMP_MACHINES:
        return f"this host is {machine}, not x86-64"
    return None
