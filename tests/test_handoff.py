"""What the launcher and vLLM's plugin share (vllm_cpu_launch/handoff.py): the plan's mark,
the plugin's off switch, and `stands_down`, the plugin's first check in every vLLM process.
The plugin acting on them in a fresh interpreter: tests/test_plugin.py.
"""

from __future__ import annotations

import pytest

from vllm_cpu_launch.handoff import PLANNED_VARIABLE, PLUGIN_VARIABLE, stands_down


@pytest.mark.parametrize(
    ("environ", "machine", "spawned", "reason"),
    [
        ({}, "x86_64", False, None),
        ({"LD_PRELOAD": "/x/libtcmalloc.so.4"}, "x86_64", True, None),  # no OpenMP runtime named
        ({PLUGIN_VARIABLE: "1"}, "x86_64", False, None),
        ({}, "aarch64", False, "this host is aarch64, not x86-64"),
        ({}, "ppc64le", False, "this host is ppc64le, not x86-64"),
        ({"LD_PRELOAD": "/l/libomp.so.5"}, "x86_64", True, "LD_PRELOAD names the runtime"),
        ({"LD_PRELOAD": "/l/libomp.so.5"}, "x86_64", False, None),  # a front end: the plan keeps it
        ({PLANNED_VARIABLE: "launcher:started"}, "x86_64", False, "started with a plan already"),
        ({PLUGIN_VARIABLE: "no"}, "x86_64", False, f"switched off by {PLUGIN_VARIABLE}=no"),
        # The name before our variables left vLLM's namespace still switches it off ...
        (
            {"VLLM_CPU_LAUNCH_PLUGIN": "0"},
            "x86_64",
            False,
            "switched off by VLLM_CPU_LAUNCH_PLUGIN=0",
        ),
        # ... unless the current name says otherwise.
        ({PLUGIN_VARIABLE: "1", "VLLM_CPU_LAUNCH_PLUGIN": "0"}, "x86_64", False, None),
    ],
)
def test_standing_down(
    environ: dict[str, str], machine: str, spawned: bool, reason: str | None
) -> None:
    found = stands_down(environ, machine, spawned)
    assert found == reason if reason is None else found is not None and reason in found


@pytest.mark.parametrize("word", ["0", "OFF", "False", "No"])
def test_any_case_of_a_no_switches_the_plugin_off(word: str) -> None:
    """The switch's words are read in any case, as the launcher reads its yes/no settings."""
    assert stands_down({PLUGIN_VARIABLE: word}, "x86_64", spawned=False) == (
        f"switched off by {PLUGIN_VARIABLE}={word}"
    )


@pytest.mark.parametrize("word", ["1", "ON", "True", "Yes"])
def test_any_case_of_a_yes_leaves_the_plugin_on(word: str) -> None:
    assert stands_down({PLUGIN_VARIABLE: word}, "x86_64", spawned=False) is None
