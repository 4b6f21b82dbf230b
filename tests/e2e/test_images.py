"""End to end: vLLM's plugin added to a vLLM environment that stays as it is, the way
docs/examples/plugin-volume.yaml adds it to an image you do not own.

The recipe's commands run here with its paths mapped onto this machine (/opt/vllm: the
cached vLLM 0.32.0 CPU environment after the README's plugin step, where plain `vllm` runs
as in vLLM's own CPU image: conftest's doctored_env; /wheels: a wheel of this checkout built
by `python -m build --wheel`; /plugins: an empty directory; /models/model: the tiny model):
the init container's `pip install --no-deps --no-index --target /plugins WHEEL`, by the vLLM
environment's own pip; then the vLLM container's plain `vllm serve` with the recipe's
speculative config and PYTHONPATH, from a working directory with nothing in it; then the
liveness probe's `verify`. The tests' probe plugin, installed in a directory of its own
listed after the recipe's on PYTHONPATH, records what each vLLM process started with and
where vLLM imported our plugin from. One vLLM start. Set VLLMCPULAUNCH_SKIP_E2E=1 to skip
this module.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm_server import (
    REQUEST_LIMIT_S,
    Server,
    killed_on_exit,
    start_server,
)

from tests.test_containers import PLUGIN_VOLUME, build_wheel
from vllm_cpu_launch import __version__
from vllm_cpu_launch.handoff import stands_down

from .conftest import (
    MAX_TOKENS,
    PLUGIN_INSTALL_LIMIT_S,
    PROBE_VARIABLE,
    REAL_VLLM,
    RUN_CACHE,
    complete,
    isolated_environment,
    model_processes,
    plugin_lines,
    probe_copy,
    probe_records,
    run_script,
    tree_views,
    wait_for_drafts,
    wait_for_health,
)

pytestmark = REAL_VLLM

# What the recipe's pip leaves in /plugins: the plugin, its metadata, its console script.
DIST_INFO = f"vllm_cpu_launch-{__version__}.dist-info"
INSTALLED = {"bin", "vllm_cpu_launch", DIST_INFO}


def pod_spec() -> dict[str, Any]:
    """The recipe's pod template."""
    recipe = yaml.safe_load(PLUGIN_VOLUME.read_text(encoding="utf-8"))
    spec: dict[str, Any] = recipe["spec"]["template"]["spec"]
    return spec


def mapped(value: str, places: Mapping[str, Path]) -> str:
    """A value of the recipe with each of its paths (`places`' keys) moved onto this machine."""
    for path, here in places.items():
        if value == path or value.startswith(f"{path}/"):
            return str(here) + value[len(path) :]
    return value


@pytest.fixture(scope="module")
def places(doctored_env: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The recipe's paths on this machine, /plugins filled by the init container's command."""
    wheel = build_wheel(tmp_path_factory.mktemp("wheel"))
    places = {
        "/opt/vllm": doctored_env,
        "/wheels": wheel.parent,
        "/plugins": tmp_path_factory.mktemp("plugins"),
    }
    (init,) = pod_spec()["initContainers"]
    run_script([mapped(part, places) for part in init["command"]], PLUGIN_INSTALL_LIMIT_S)
    return places


@pytest.fixture(scope="module")
def probe_path(doctored_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' probe plugin, installed by vLLM's pip into a directory of its own."""
    target = tmp_path_factory.mktemp("probe")
    command = [str(doctored_env / "bin" / "python"), "-m", "pip", "install", "--no-deps"]
    run_script(
        [*command, "--no-input", "--target", str(target), str(probe_copy(tmp_path_factory))],
        PLUGIN_INSTALL_LIMIT_S,
    )
    return target


def container_environment(scratch: Path, places: Mapping[str, Path]) -> dict[str, str]:
    """The vLLM container's PYTHONPATH (mapped) in the tests' environment without OpenMP or
    launcher settings."""
    env = isolated_environment(
        scratch,
        ("LD_PRELOAD", "PYTHONPATH"),
        ("KMP_", "VLLM_CPU_", "VLLMCPULAUNCH_"),
        RUN_CACHE["vllm"],
    )
    (vllm,) = pod_spec()["containers"]
    values = {entry["name"]: entry["value"] for entry in vllm["env"]}
    env["PYTHONPATH"] = mapped(values["PYTHONPATH"], places)
    return env


@pytest.fixture(scope="module")
def served(
    places: dict[str, Path],
    probe_path: Path,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Server, Path]]:
    """The recipe's `vllm serve` with its speculative config, the tiny model as its model,
    healthy; the probe's records."""
    scratch = tmp_path_factory.mktemp("served")
    (vllm,) = pod_spec()["containers"]
    args = vllm["args"]
    speculative = args[args.index("--speculative-config") + 1]
    env = container_environment(scratch, places)
    env["PYTHONPATH"] += os.pathsep + str(probe_path)
    env[PROBE_VARIABLE] = str(scratch / "probe.jsonl")
    prefix = [mapped(part, places) for part in vllm["command"]]
    assert args[:2] == ["serve", "/models/model"]
    server = start_server(
        prefix, tiny_model, scratch, env, cwd=scratch, speculative_config=speculative
    )
    with killed_on_exit(server):
        print(
            f"vllm serve, the plugin on PYTHONPATH, healthy after {wait_for_health(server):.0f} s"
        )
        yield server, scratch / "probe.jsonl"


def vllm_python(doctored_env: Path, code: str, cwd: Path, **variables: str) -> str:
    """`python -c CODE` of the vLLM environment; its stdout."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [str(doctored_env / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**env, **variables},
        timeout=REQUEST_LIMIT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


FIND_PLUGIN = (
    "import importlib.metadata as m, json; print(json.dumps("
    "[str(e.dist._path) for e in m.entry_points(group='vllm.general_plugins')"
    " if e.name == 'vllm_cpu_launch']))"
)

DISTRIBUTIONS = (
    "import importlib.metadata as m, json;"
    " print(json.dumps([d.metadata['Name'] for d in m.distributions()]))"
)


def test_the_plugin_is_only_in_the_target_directory(
    places: dict[str, Path], doctored_env: Path, tmp_path: Path
) -> None:
    plugins = places["/plugins"]
    assert {path.name for path in plugins.iterdir()} == INSTALLED  # no dependency copied
    assert json.loads(vllm_python(doctored_env, FIND_PLUGIN, tmp_path)) == []
    found = vllm_python(doctored_env, FIND_PLUGIN, tmp_path, PYTHONPATH=str(plugins))
    assert json.loads(found) == [str(plugins / DIST_INFO)]


def test_vllms_environment_meets_the_plugins_requirements(
    places: dict[str, Path], doctored_env: Path, tmp_path: Path
) -> None:
    """`--no-deps` is safe: with the plugin on PYTHONPATH (importlib.metadata lists it),
    `pip check` finds its requirements met by what vLLM installed."""
    plugins = str(places["/plugins"])
    listed = vllm_python(doctored_env, DISTRIBUTIONS, tmp_path, PYTHONPATH=plugins)
    assert "vllm-cpu-launch" in json.loads(listed)
    result = subprocess.run(
        [str(doctored_env / "bin" / "python"), "-m", "pip", "check"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": plugins},
        timeout=REQUEST_LIMIT_S,
        check=False,
    )
    assert "vllm-cpu-launch" not in result.stdout, result.stdout


def test_doctor_in_the_container_finds_the_plugin_vllm_will_load(
    places: dict[str, Path], tmp_path: Path
) -> None:
    """`kubectl exec ... -- /plugins/bin/vllm-cpu-launch --vllm /opt/vllm/bin/vllm doctor`,
    as docs/operating.md gives it, in the container's environment."""
    command = ["/plugins/bin/vllm-cpu-launch", "--vllm", "/opt/vllm/bin/vllm", "doctor"]
    result = subprocess.run(
        [*(mapped(part, places) for part in command), "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=container_environment(tmp_path, places),
        timeout=REQUEST_LIMIT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    plugin = json.loads(result.stdout)["plugin"]
    assert plugin["installed"] == str(places["/plugins"] / DIST_INFO)
    assert plugin["loads"] is True, plugin


def test_engine_core_and_workers_map_libiomp5(
    served: tuple[Server, Path], doctored_env: Path
) -> None:
    server, _ = served
    views = tree_views(server)
    models = model_processes(views)
    titles = " ".join(view.title for view in models)
    assert "VLLM::EngineCore" in titles and "VLLM::Worker" in titles, titles
    for view in views:
        runtimes = sorted(path for path in view.mapped if "omp" in Path(path).name)
        print(f"{view.title[:40]!r} maps {runtimes}")
    library = os.path.realpath(doctored_env / "lib" / "libiomp5.so")
    assert {str(view): os.path.realpath(view.iomp() or "-") for view in models} == {
        str(view): library for view in models
    }
    assert not views[0].maps_iomp()  # the API server: torch's libgomp, loaded before plugins


def recipe_plan(places: Mapping[str, Path], model: Path, scratch: Path) -> dict[str, Any]:
    """The plan for the recipe's `vllm serve` (the tiny model as its model), read as data:
    `/plugins/bin/vllm-cpu-launch --vllm /opt/vllm/bin/vllm --dry-run --json serve ...` in
    the container's environment, as an operator would ask it there (the plugin makes the
    same plan, docs/design.md "The plugin")."""
    (vllm,) = pod_spec()["containers"]
    arguments = [str(model) if part == "/models/model" else part for part in vllm["args"]]
    command = ["/plugins/bin/vllm-cpu-launch", "--vllm", "/opt/vllm/bin/vllm"]
    result = subprocess.run(
        [*(mapped(part, places) for part in command), "--dry-run", "--json", *arguments],
        capture_output=True,
        text=True,
        cwd=scratch,
        env=container_environment(scratch, places),
        timeout=REQUEST_LIMIT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    plan: dict[str, Any] = json.loads(result.stdout)
    return plan


def test_every_process_loads_the_plugin_from_pythonpath_and_only_the_front_end_plans(
    served: tuple[Server, Path],
    places: dict[str, Path],
    doctored_env: Path,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """The model processes start with the plan's LD_PRELOAD, read as data (whatever the
    host adds before vLLM's libiomp5), and stand down; the front end plans, once."""
    server, probe = served
    views = tree_views(server)
    records = probe_records(probe)
    front, models = views[0], model_processes(views)
    plugin = str(places["/plugins"] / "vllm_cpu_launch" / "plugin.py")
    library = str(doctored_env / "lib" / "libiomp5.so")
    preload = recipe_plan(places, tiny_model, tmp_path)["env"]["LD_PRELOAD"]
    assert preload.split(":")[-1] == library and "libgomp" not in preload, preload
    for view in [front, *models]:
        record = records[view.pid]
        assert record["plugin_file"] == plugin, (str(view), record)
        inherited = {
            name: record[name]
            for name in ("LD_PRELOAD", "VLLMCPULAUNCH_PLANNED")
            if record[name] is not None
        }
        if view is front:
            assert stands_down(inherited, "x86_64", spawned=False) is None, record
        else:
            assert record["LD_PRELOAD"] == preload, (str(view), record)
            assert stands_down(inherited, "x86_64", spawned=True) is not None, (str(view), record)
    lines = plugin_lines(server.log_text())
    assert [(process, level) for process, level, _ in lines] == [("APIServer", "INFO")], lines
    assert "libiomp5.so (intel, from vllm-environment)" in lines[0][2]


def test_a_completion_answers_with_drafts(served: tuple[Server, Path]) -> None:
    server, _ = served
    answer = complete(server)
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert wait_for_drafts(server) > 0


def test_the_liveness_probe_passes(served: tuple[Server, Path], places: dict[str, Path]) -> None:
    """The recipe's exec probe, `verify 1` with vLLM as PID 1, run with the server's PID
    and the container's environment."""
    server, _ = served
    (vllm,) = pod_spec()["containers"]
    command = [mapped(part, places) for part in vllm["livenessProbe"]["exec"]["command"]]
    assert command[-1] == "1"
    result = subprocess.run(
        [*command[:-1], str(server.process.pid)],
        capture_output=True,
        text=True,
        env=container_environment(server.log.parent, places),
        timeout=REQUEST_LIMIT_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
