"""What a vLLM process inherits that tells the plugin to leave it alone.

The plugin runs in every vLLM process; in all but the front end it must stop at once,
with nothing imported. stands_down() decides that from the environment and the machine
alone (doctor asks it too), and the launcher's plan writes the mark it reads
(docs/design.md, "The plugin").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

# Set by a plan that keeps libgomp although SD is requested or Intel OpenMP is refused
# (value: who planned: launcher, plugin), the one choice LD_PRELOAD does not show, so that
# a process started with that plan, and its children, are left as planned.
PLANNED_VARIABLE = "VLLMCPULAUNCH_PLANNED"
# Appended to the planner where the plan keeps libgomp only because no usable Intel OpenMP
# was found: the plugin still leaves those processes alone (the warning was said once), but
# `verify` does not count that libgomp as chosen.
NOT_FOUND_MARK = ":not-found"
# The launcher's off switch for the plugin (also the config key `plugin`).
PLUGIN_VARIABLE = "VLLMCPULAUNCH_PLUGIN"
# Its name before our variables left vLLM's VLLM_* namespace, still obeyed
# (settings.with_current_names says it is deprecated).
DEPRECATED_PLUGIN_VARIABLE = "VLLM_CPU_LAUNCH_PLUGIN"
# The plugin's entry point name (setup.cfg), which vLLM's VLLM_PLUGINS allowlist names.
PLUGIN_NAME = "vllm_cpu_launch"
IOMP_MACHINES = ("x86_64",)  # vLLM looks for libiomp in LD_PRELOAD on x86 only
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
    """Why this process needs no plan, from its environment alone; None if it may."""
    planner = environ.get(PLANNED_VARIABLE)
    if planner:
        return f"{PLANNED_VARIABLE}={planner}: started with a plan already"
    if names_openmp_runtime(environ.get("LD_PRELOAD", "")):
        return "LD_PRELOAD names an OpenMP runtime already"
    return None


def stands_down(environ: Mapping[str, str], machine: str) -> str | None:
    """Why the plugin leaves this process alone, from what costs nothing to read; None if
    it may plan. Every process vLLM starts inherits LD_PRELOAD with an OpenMP runtime in
    it (vLLM's libgomp or the plan's libiomp5), so they all stop here."""
    for variable in (PLUGIN_VARIABLE, DEPRECATED_PLUGIN_VARIABLE):
        switch = environ.get(variable)
        if switch:  # empty is unset
            if switch.lower() in FALSE_WORDS:
                return f"switched off by {variable}={switch}"
            break
    planned = already_planned(environ)
    if planned:
        return planned
    if machine not in IOMP_MACHINES:
        return f"this host is {machine}, not x86-64"
    return None
