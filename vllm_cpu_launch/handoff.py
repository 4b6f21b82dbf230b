"""What the launcher and the plugin share: the mark that tells the plugin to leave a process
alone, its switch and its /metrics names. The plugin runs in every vLLM process and
must stop at once in all but the front end, with nothing imported (stands_down)."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from vllm_cpu_launch.runtimes import preloaded_on, vllm_reads

if TYPE_CHECKING:
    from collections.abc import Mapping

LD_PRELOAD = "LD_PRELOAD"  # the loader's variable, which vLLM reads too


# The word in the plugin's /metrics series where no OpenMP runtime serves (a family's word
# where one does).
NONE = "none"
METRIC = "vllm_cpu_launch_openmp"
INFO_METRIC = f"{METRIC}_info"  # prometheus_client appends `_info` to an info family's name


# The plan's mark: tells vLLM's plugin a process was started with a plan already, and
# `verify` why libgomp is loaded. Its value is who planned, alone where the plan keeps
# libgomp by the user's word (`iomp: never`), else with one of the suffixes below.
PLANNED_VARIABLE = "VLLMCPULAUNCH_PLANNED"


class Planner(enum.Enum):
    """Who planned: the mark's value, before a suffix."""

    LAUNCHER = "launcher"
    PLUGIN = "plugin"


# libgomp kept because no usable Intel OpenMP was found: `verify` does not count it chosen.
NOT_FOUND_MARK = ":not-found"
# The launcher hands over an LD_PRELOAD naming a runtime: the plugin, which plans a front
# end whose LD_PRELOAD names one (vLLM's CPU image), leaves the launcher's exec alone.
STARTED_MARK = ":started"
PLUGIN_VARIABLE = "VLLMCPULAUNCH_PLUGIN"  # the plugin's off switch (also the config key)
DEPRECATED_PLUGIN_VARIABLE = "VLLM_CPU_LAUNCH_PLUGIN"  # its name before, still obeyed
PLUGIN_NAME = "vllm_cpu_launch"  # the entry point (setup.cfg) vLLM's VLLM_PLUGINS names
TRUE_WORDS = ("1", "true", "yes", "on")  # a yes/no setting's words, in any case
FALSE_WORDS = ("0", "false", "no", "off")


def already_planned(environ: Mapping[str, str]) -> str | None:
    """Why this process needs no plan: the mark of a plan it was started with; else None."""
    planner = environ.get(PLANNED_VARIABLE)
    return f"{PLANNED_VARIABLE}={planner}: started with a plan already" if planner else None


def switched_off(environ: Mapping[str, str]) -> str | None:
    """`VARIABLE=VALUE` of the off switch set to a no, the current name's first; else None."""
    for variable in (PLUGIN_VARIABLE, DEPRECATED_PLUGIN_VARIABLE):
        if switch := environ.get(variable):  # empty is unset
            return f"{variable}={switch}" if switch.lower() in FALSE_WORDS else None
    return None


def stands_down(environ: Mapping[str, str], machine: str, spawned: bool) -> str | None:
    """Why the plugin leaves this process alone, read at no cost; None if it may plan.
    `spawned` (vLLM's engine cores, workers, API servers) inherit their front end's runtime."""
    if switch := switched_off(environ):
        return f"switched off by {switch}"
    if planned := already_planned(environ):
        return planned
    if spawned and vllm_reads(environ.get(LD_PRELOAD, "")):
        return "a process vLLM started: LD_PRELOAD names the runtime its front end chose"
    if not preloaded_on(machine):
        return f"this host is {machine}, not x86-64"
    return None
