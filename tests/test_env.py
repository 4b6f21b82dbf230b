"""`env` (vllm_cpu_launch/verbs/env.py): the plan's environment as shell, EnvironmentFile,
Dockerfile ENV and JSON.

Each format is read back: shell output by real shells (`eval`), EnvironmentFile lines
by systemd's own env-file parser (the environment.d generator) and by a faithful
parser of systemd.exec(5), Dockerfile lines by a lexer of Docker's documented rules.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import SystemHost, clean_environ, run_launcher
from vllm_cpu_launch.verbs.env import docker_value

SD = '{"method": "ngram", "num_speculative_tokens": 3}'
GENERATOR = "/usr/lib/systemd/user-environment-generators/30-systemd-environment-d-generator"
GOMP = "/usr/lib/x86_64-linux-gnu/libgomp.so.1"


def env_command(vllm_env: Path, *args: str) -> list[str]:
    return ["--vllm", str(vllm_env / "bin" / "vllm"), "env", *args]


def run_env(
    tmp_path: Path, vllm_env: Path, *args: str, **extra: str
) -> subprocess.CompletedProcess[str]:
    return run_launcher(env_command(vllm_env, *args), clean_environ(tmp_path, **extra))


def plan_env(tmp_path: Path, vllm_env: Path, *args: str, **extra: str) -> dict[str, str]:
    result = run_env(tmp_path, vllm_env, "--format", "json", *args, **extra)
    assert result.returncode == 0, result.stderr
    environment: dict[str, str] = json.loads(result.stdout)["env"]
    return environment


# ---------------------------------------------------------------- shell


@pytest.mark.parametrize("shell", ["sh", "bash", "dash"])
def test_shell_exports_eval_to_the_plan(
    tmp_path: Path, vllm_env: Path, weird_iomp: Path, shell: str, system_host: SystemHost
) -> None:
    if shutil.which(shell) is None:
        pytest.fail(f"{shell} missing")
    args = ("--iomp-path", str(weird_iomp), "serve", "m", "--speculative-config", SD)
    result = run_env(tmp_path, vllm_env, *args)
    assert result.returncode == 0, result.stderr
    expected = plan_env(tmp_path, vllm_env, *args)
    preload = system_host.preload(weird_iomp)
    assert expected["LD_PRELOAD"] == preload and expected["KMP_BLOCKTIME"] == "5"
    script = 'eval "$EXPORTS"; printf "%s\\0%s" "$LD_PRELOAD" "$KMP_BLOCKTIME"'
    environ = {"EXPORTS": result.stdout, "PATH": "/usr/bin:/bin"}
    shown = subprocess.run(
        [shell, "-c", script], env=environ, capture_output=True, timeout=60, check=True
    )
    assert os.fsdecode(shown.stdout).split("\0") == [preload, "5"]
    assert all(line.startswith("export ") for line in result.stdout.splitlines())
    assert "preloading" in result.stderr  # the INFO line goes to stderr, never to eval


def test_nothing_to_set_is_a_comment(tmp_path: Path, vllm_env: Path) -> None:
    result = run_env(tmp_path, vllm_env, "serve", "m")
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout == "# vllm-cpu-launch: nothing to set (no speculative decoding requested)\n"
    )
    for output_format in ("systemd", "docker", "kubernetes"):
        other = run_env(tmp_path, vllm_env, "--format", output_format, "serve", "m")
        assert other.stdout == result.stdout


def test_caller_values_the_plan_keeps_are_carried(tmp_path: Path, vllm_env: Path) -> None:
    """A unit or an image does not inherit the caller's KMP_BLOCKTIME/LD_PRELOAD."""
    iomp = str(vllm_env / "lib" / "libiomp5.so")
    extra = {"KMP_BLOCKTIME": "20", "LD_PRELOAD": iomp}
    args = ("serve", "m", "--speculative-config", SD)
    # The plan changes nothing but its mark, which the unit carries.
    assert plan_env(tmp_path, vllm_env, *args, **extra) == {
        "VLLMCPULAUNCH_PLANNED": "launcher:started"
    }
    result = run_env(tmp_path, vllm_env, "--format", "systemd", *args, **extra)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f'LD_PRELOAD="{iomp}"',
        'KMP_BLOCKTIME="20"',
        'VLLMCPULAUNCH_PLANNED="launcher:started"',
    ]


def test_gnu_openmp_entry_is_dropped_with_a_warning_on_stderr(
    tmp_path: Path, vllm_env: Path, system_host: SystemHost
) -> None:
    iomp = system_host.preload(vllm_env / "lib" / "libiomp5.so")
    result = run_env(tmp_path, vllm_env, "serve", "m", "--speculative-config", SD, LD_PRELOAD=GOMP)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"export LD_PRELOAD={iomp}",
        "export KMP_BLOCKTIME=5",
        "export VLLMCPULAUNCH_PLANNED=launcher:started",  # the plan's mark: every format's
    ]
    assert f"warning: removed {GOMP} from LD_PRELOAD" in result.stderr


# ---------------------------------------------------------------- systemd EnvironmentFile


def parse_environment_file(text: str) -> dict[str, str]:
    """systemd.exec(5) EnvironmentFile= rules for the forms: unquoted, '...' and "..."."""
    result: dict[str, str] = {}
    index = 0
    while index < len(text):
        end = text.find("\n", index)
        line_end = len(text) if end < 0 else end
        line = text[index:line_end].lstrip(" \t")
        if not line or line[0] in "#;" or "=" not in line:
            index = line_end + 1
            continue
        start = index + (len(text[index:line_end]) - len(line))
        key, _, _ = line.partition("=")
        position = start + len(key) + 1
        while position < len(text) and text[position] in " \t":
            position += 1
        value: list[str] = []
        if position < len(text) and text[position] == '"':
            position += 1
            while text[position] != '"':
                if text[position] == "\\":
                    following = text[position + 1]
                    if following == "\n":
                        position += 2
                        continue
                    value.append(following if following in '"\\`$' else "\\" + following)
                    position += 2
                else:
                    value.append(text[position])
                    position += 1
            position += 1
        elif position < len(text) and text[position] == "'":
            closing = text.index("'", position + 1)
            value.append(text[position + 1 : closing])
            position = closing + 1
        else:
            while position < len(text) and text[position] != "\n":
                if text[position] == "\\" and position + 1 < len(text):
                    if text[position + 1] != "\n":
                        value.append(text[position + 1])
                    position += 2
                else:
                    value.append(text[position])
                    position += 1
            value = list("".join(value).rstrip(" \t\r"))
        result[key.strip()] = "".join(value)
        next_line = text.find("\n", position)
        index = len(text) if next_line < 0 else next_line + 1
    return result


def decode_generator_value(value: str) -> str:
    """The environment.d generator writes values back double-quoted with `\\` escapes."""
    if not value.startswith('"'):
        return value
    out, index = [], 1
    while index < len(value) - 1:
        if value[index] == "\\":
            following = value[index + 1]
            out.append("\n" if following == "n" else following)
            index += 2
        else:
            out.append(value[index])
            index += 1
    return "".join(out)


def systemd_reads(lines: list[str], tmp_path: Path) -> dict[str, str]:
    """What systemd's env-file parser (load_env_file, shared by EnvironmentFile=) reads.

    The environment.d generator then expands `$NAME`, which EnvironmentFile= does not:
    values given to it must not hold a `$` followed by a name or `{`.
    """
    directory = tmp_path / "config" / "environment.d"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "50-test.conf").write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = subprocess.run(
        [GENERATOR],
        env={"XDG_CONFIG_HOME": str(tmp_path / "config")},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    parsed = {}
    wanted = {line.partition("=")[0].strip() for line in lines}
    for line in result.stdout.splitlines():
        key, _, value = line.partition("=")
        if key in wanted:  # not what /etc/environment.d adds
            parsed[key] = decode_generator_value(value)
    return parsed


def test_faithful_parser_agrees_with_systemd(tmp_path: Path) -> None:
    """The parser below is checked against the real one on hand-written lines too."""
    handmade = [
        "A=plain\\ value  ",
        "B='single \\ kept'",
        'C="esc \\" \\\\ \\z"',
        'D="multi\nline"',
        "  E = spaced",
        "# comment",
    ]
    text = "\n".join(handmade) + "\n"
    assert parse_environment_file(text) == systemd_reads(handmade, tmp_path) | {}


def test_systemd_format_with_weird_path_reads_back(
    tmp_path: Path, vllm_env: Path, weird_iomp: Path, system_host: SystemHost
) -> None:
    args = ("--iomp-path", str(weird_iomp), "serve", "m", "--speculative-config", SD)
    result = run_env(tmp_path, vllm_env, "--format", "systemd", *args)
    assert result.returncode == 0, result.stderr
    assert parse_environment_file(result.stdout) == {
        "LD_PRELOAD": system_host.preload(weird_iomp),
        "KMP_BLOCKTIME": "5",
        "VLLMCPULAUNCH_PLANNED": "launcher:started",
    }


# ---------------------------------------------------------------- Dockerfile


def docker_word(text: str) -> str:
    """A Dockerfile ENV value as Docker's word lexer reads it (default escape `\\`):
    in double quotes `\\` escapes only `"`, `$` and `\\`; an unescaped `$` expands."""
    assert text.startswith('"') and text.endswith('"'), text
    out, index = [], 1
    while index < len(text) - 1:
        char = text[index]
        if char == "\\" and text[index + 1] in '"$\\':
            out.append(text[index + 1])
            index += 2
            continue
        assert char != "$", f"unescaped $ would expand: {text}"
        assert char != '"', f"unescaped quote ends the word: {text}"
        out.append(char)
        index += 1
    return "".join(out)


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(exclude_categories=["Cs", "Cc"]), max_size=30))
def test_docker_value_round_trips(value: str) -> None:
    assert docker_word(docker_value("X", value)) == value


def test_docker_format_with_weird_path(
    tmp_path: Path, vllm_env: Path, weird_iomp: Path, system_host: SystemHost
) -> None:
    args = ("--iomp-path", str(weird_iomp), "serve", "m", "--speculative-config", SD)
    result = run_env(tmp_path, vllm_env, "--format", "docker", *args)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split("=", 1)[0] for line in lines] == [
        "ENV LD_PRELOAD",
        "ENV KMP_BLOCKTIME",
        "ENV VLLMCPULAUNCH_PLANNED",
    ]
    assert docker_word(lines[0].split("=", 1)[1]) == system_host.preload(weird_iomp)
    assert lines[1] == 'ENV KMP_BLOCKTIME="5"'


def test_docker_refuses_a_control_character(tmp_path: Path, vllm_env: Path) -> None:
    directory = tmp_path / "control\x01character"
    directory.mkdir()
    shutil.copy2(vllm_env / "lib" / "libiomp5.so", directory / "libiomp5.so")
    args = ("--iomp-path", str(directory / "libiomp5.so"), "serve", "m", "-sc", SD)
    result = run_env(tmp_path, vllm_env, "--format", "docker", *args)
    assert result.returncode == 2 and result.stdout == ""
    assert "LD_PRELOAD's value holds a control character" in result.stderr


# ---------------------------------------------------------------- JSON and errors


def test_json_is_the_dry_run_plan(tmp_path: Path, vllm_env: Path) -> None:
    args = ["serve", "m", "--speculative-config", SD]
    environ = clean_environ(tmp_path)
    as_env = run_launcher(env_command(vllm_env, "--format", "json", *args), environ)
    dry_run = run_launcher(
        ["--vllm", str(vllm_env / "bin" / "vllm"), "--dry-run", "--json", *args], environ
    )
    assert as_env.returncode == dry_run.returncode == 0, as_env.stderr
    assert json.loads(as_env.stdout) == json.loads(dry_run.stdout)
    assert json.loads(as_env.stdout)["env"]["KMP_BLOCKTIME"] == "5"


def test_launcher_options_after_the_verb(tmp_path: Path, vllm_env: Path) -> None:
    result = run_launcher(
        [
            "env",
            "--format=shell",
            "--vllm",
            str(vllm_env / "bin" / "vllm"),
            "--kmp-blocktime",
            "50",
            "--",
            "serve",
            "m",
            "-sc",
            SD,
        ],
        clean_environ(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    assert "export KMP_BLOCKTIME=50" in result.stdout.splitlines()


def test_strict_without_iomp_exits_3(tmp_path: Path, vllm_env: Path) -> None:
    result = run_env(
        tmp_path,
        vllm_env,
        "--iomp",
        "always",
        "--iomp-path",
        "/nonexistent/libiomp5.so",
        "serve",
        "m",
    )
    assert result.returncode == 2  # an explicit path that cannot be preloaded is a usage error
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "yaml", "serve", "m"], "--format 'yaml': use one of shell, systemd"),
        (["--format"], "--format needs a value"),
        (["--dry-run", "serve", "m"], "--dry-run does not apply"),
        (["--json", "--format", "shell", "serve", "m"], "--json contradicts --format shell"),
        ([], "env needs the vLLM command line"),
    ],
)
def test_usage_errors(tmp_path: Path, vllm_env: Path, args: list[str], message: str) -> None:
    result = run_env(tmp_path, vllm_env, *args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
