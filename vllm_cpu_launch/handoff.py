"""What a vLLM process inherits that tells the plugin a plan is already in place.

The plugin runs in every vLLM process; in all but the front end it must stop at once,
with nothing imported. These two tests decide that from the environment alone, and the
launcher's plan writes the mark the first one reads (docs/design.md, "The plugin").
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

# Set by every plan the launcher or the plugin applies (value: who planned), so that a
# process started with that plan, and its children, are left as planned.
PLANNED_VARIABLE = "VLLM_CPU_LAUNCH_PLANNED"
# The launcher's off switch for the plugin (also the config key `plugin`).
PLUGIN_VARIABLE = "VLLM_CPU_LAUNCH_PLUGIN"
# The plugin's entry point name (setup.cfg), which vLLM's VLLM_PLUGINS allowlist names.
PLUGIN_NAME = "vllm_cpu_launch"


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
