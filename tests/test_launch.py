"""The launch core (vllm_cpu_launch/launch.py) as a fresh launcher process: the option
grammar (parse_options, unknown_option), what --strict makes of a plan (plan_from_options),
what a launch says (report) and writes (write_stdout). The dispatch, help, the exec and its
exit codes: tests/test_cli.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from . import test_cli as command_line
from .conftest import LAUNCHER, clean_environ, install_recorder, make_environment, run_launcher
from .hardening import GUARD, base_environ, single_error
from .test_cli import NGRAM, Launch, assert_one_error, launcher

vllm = command_line.vllm  # the fixture: a fake vLLM (tests/hardening.py)


# ---------------------------------------------------------------- the option grammar


@pytest.mark.parametrize(
    ("verb", "after"),
    [
        ("doctor", []),
        ("env", ["serve", "m"]),
        ("verify", ["1"]),
        ("systemd-unit", ["serve", "m"]),
        ("exec", ["--", "true"]),
        ("tune", ["serve", "m"]),
    ],
)
def test_a_typo_in_a_verbs_options_names_the_verb_and_its_help(
    tmp_path: Path, vllm_env: Path, verb: str, after: list[str]
) -> None:
    """`doctor --mesure` is no vLLM option put too early: it is unknown to doctor."""
    vllm = str(vllm_env / "bin" / "vllm")
    result = launcher(tmp_path, [verb, "--mesure", *after], VLLMCPULAUNCH_VLLM=vllm)
    help_line = f"; see vllm-cpu-launch {verb} --help"
    assert_one_error(result, 2, f"unknown option '--mesure' for {verb}", help_line)
    assert "vLLM's options" not in result.stderr
    helped = launcher(tmp_path, [verb, "--help"])
    assert helped.returncode == 0 and f"usage: vllm-cpu-launch {verb}" in helped.stdout


# ---------------------------------------------------------------- --strict and the plan


def bare_python(tmp_path: Path) -> Path:
    """A Python whose environment holds no libiomp5 (unlike the test venv)."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")],
        check=True,
        timeout=120,
    )
    return tmp_path / "bare" / "bin" / "python"


def test_strict_with_missing_library_exits_3(tmp_path: Path) -> None:
    environment = make_environment(tmp_path / "env")
    vllm = install_recorder(environment)
    args = ["--strict", "--vllm", str(vllm), "serve", "m", "-sc", NGRAM]
    result = run_launcher(
        args,
        clean_environ(tmp_path),
        launcher=[str(bare_python(tmp_path)), "-m", "vllm_cpu_launch"],
    )
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert "Intel OpenMP (libiomp5.so) not found" in result.stderr
    assert "--strict: not starting. Fix: " in result.stderr
    assert f"{environment / 'bin' / 'python'} -m pip install intel-openmp" in result.stderr


def test_missing_library_warns_once_and_still_starts(tmp_path: Path, record_file: Path) -> None:
    environment = make_environment(tmp_path / "env")
    vllm = install_recorder(environment)
    result = run_launcher(
        ["--vllm", str(vllm), "serve", "m", "-sc", NGRAM],
        clean_environ(tmp_path, RECORD_TO=str(record_file)),
        launcher=[str(bare_python(tmp_path)), "-m", "vllm_cpu_launch"],
    )
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "not found (searched ld-preload" in warnings[0]
    assert json.loads(record_file.read_text())["LD_PRELOAD"] is None


# ---------------------------------------------------------------- what a launch says


def test_quiet_prints_nothing(launch: Launch, vllm_env: Path) -> None:
    result, record = launch(
        ["-q", "--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m", "-sc", NGRAM]
    )
    assert (result.returncode, result.stderr, result.stdout) == (0, "", "")
    assert record["LD_PRELOAD"]


def test_closed_stdout_with_dry_run_is_a_clear_error(tmp_path: Path, vllm: Path) -> None:
    command = ["sh", "-c", 'exec 1>&- "$@"', "sh", *LAUNCHER, "--vllm", str(vllm), "--dry-run"]
    result = subprocess.run(
        [*command, "serve", "m"],
        env=base_environ(tmp_path / "home"),
        capture_output=True,
        timeout=GUARD,
        check=False,
    )
    assert "standard output: it is closed" in single_error(result, 2)
