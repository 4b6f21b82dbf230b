"""The launcher for real: a process that execs a recording stand-in for `vllm`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import (
    LAUNCHER,
    SystemHost,
    clean_environ,
    install_recorder,
    make_environment,
    read_record,
    run_launcher,
)

NGRAM = '{"method":"ngram","num_speculative_tokens":3}'
AWKWARD = [
    "",
    "two words",
    " leading and trailing ",
    "new\nline",
    "tab\there",
    "ünïcødé ✓",
    "$HOME",
    "'single' \"double\" \\back",
    "--",
    "-",
    "--speculative-config-lookalike",
    os.fsdecode(b"not-utf8-\xff\xfe"),
]

ZLIB = next(
    p for p in (Path("/lib/x86_64-linux-gnu/libz.so.1"), Path("/usr/lib/libz.so.1")) if p.exists()
)
Launch = Callable[..., tuple[subprocess.CompletedProcess[str], dict[str, object]]]


def start(args: list[str], environ: dict[str, str]) -> tuple[int, subprocess.CompletedProcess[str]]:
    """Start the launcher and report the PID it started with and how it ended."""
    process = subprocess.Popen(
        [*LAUNCHER, *args], env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = process.communicate(timeout=120)
    return process.pid, subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_exec_keeps_pid_argv_and_maps_real_libiomp(
    tmp_path: Path, vllm_env: Path, record_file: Path, system_host: SystemHost
) -> None:
    vllm_args = ["serve", "model dir", "--speculative-config", NGRAM, *AWKWARD]
    environ = clean_environ(tmp_path, RECORD_TO=str(record_file))
    pid, result = start(["--vllm", str(vllm_env / "bin" / "vllm"), *vllm_args], environ)
    assert result.returncode == 0, result.stderr
    record = read_record(record_file)
    assert record["pid"] == pid  # exec: the launcher's process became vLLM
    assert record["argv"] == vllm_args
    library = str(vllm_env / "lib" / "libiomp5.so")
    assert record["LD_PRELOAD"] == system_host.preload(library)
    assert record["KMP_BLOCKTIME"] == "5"
    assert library in record["mapped"]  # type: ignore[operator]
    assert not any("libgomp" in m for m in record["mapped"])  # type: ignore[attr-defined]
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("vllm-cpu-launch: speculative decoding requested by")


def test_target_environment_beats_the_launchers_own(
    launch: Launch, vllm_env: Path, system_host: SystemHost
) -> None:
    """The launcher's venv has the wheel's libiomp5 too; vLLM's environment comes first."""
    own = Path(sys.prefix) / "lib" / "libiomp5.so"
    assert own.is_file()
    _, record = launch(["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m", "-sc", NGRAM])
    assert record["LD_PRELOAD"] == system_host.preload(vllm_env / "lib" / "libiomp5.so")


def test_launcher_environment_is_used_when_vllms_has_none(
    launch: Launch, tmp_path: Path, system_host: SystemHost
) -> None:
    environment = make_environment(tmp_path / "bare-env")
    vllm = install_recorder(environment)
    result, record = launch(["--vllm", str(vllm), "serve", "m", "-sc", NGRAM])
    assert result.returncode == 0, result.stderr
    assert record["LD_PRELOAD"] == system_host.preload(Path(sys.prefix) / "lib" / "libiomp5.so")


def test_callers_preload_and_blocktime_are_respected(
    launch: Launch, vllm_env: Path, tmp_path: Path, system_host: SystemHost
) -> None:
    # A real, harmless library of the caller's, under a name vLLM does not look for.
    other = shutil.copy2(ZLIB, tmp_path / "libcaller.so")
    result, record = launch(
        ["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m", "-sc", NGRAM],
        LD_PRELOAD=str(other),
        KMP_BLOCKTIME="200",
    )
    assert result.returncode == 0, result.stderr
    assert record["LD_PRELOAD"] == system_host.preload(vllm_env / "lib" / "libiomp5.so", other)
    assert record["KMP_BLOCKTIME"] == "200"
    assert str(other) in record["mapped"]  # type: ignore[operator]


def test_launching_the_launcher_through_itself_adds_nothing_twice(
    launch: Launch, vllm_env: Path, system_host: SystemHost
) -> None:
    vllm = str(vllm_env / "bin" / "vllm")
    inner = [*LAUNCHER, "--vllm", vllm, "serve", "m", "-sc", NGRAM]
    result, record = launch(["--vllm", vllm, "exec", "--", *inner])
    assert result.returncode == 0, result.stderr
    # The outer launch preloads the library of the program it starts (the launcher's own
    # Python); the inner one finds it in LD_PRELOAD and keeps it, adding no second one.
    assert record["LD_PRELOAD"] == system_host.preload(Path(sys.prefix) / "lib" / "libiomp5.so")
    assert record["argv"] == ["serve", "m", "-sc", NGRAM]


def test_without_sd_nothing_is_preloaded(launch: Launch, vllm_env: Path) -> None:
    result, record = launch(["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m"])
    assert result.returncode == 0, result.stderr
    assert record["LD_PRELOAD"] is None and record["KMP_BLOCKTIME"] is None
    assert not any("libiomp" in m for m in record["mapped"])  # type: ignore[attr-defined]
    assert "no speculative decoding requested" in result.stderr


def test_quiet_prints_nothing(launch: Launch, vllm_env: Path) -> None:
    result, record = launch(
        ["-q", "--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m", "-sc", NGRAM]
    )
    assert (result.returncode, result.stderr, result.stdout) == (0, "", "")
    assert record["LD_PRELOAD"]


def test_vllm_beside_the_launchers_python_is_found(tmp_path: Path, record_file: Path) -> None:
    """Default target: `vllm` in the launcher's own bin/ (same venv), before PATH."""
    environment = make_environment(tmp_path / "env")
    install_recorder(environment)
    environ = clean_environ(tmp_path, RECORD_TO=str(record_file), PATH="/usr/bin:/bin")
    python = environment / "bin" / "python"
    result = run_launcher(
        ["serve", "m", "-sc", NGRAM], environ, launcher=[str(python), "-m", "vllm_cpu_launch"]
    )
    assert result.returncode == 0, result.stderr
    assert read_record(record_file)["argv"] == ["serve", "m", "-sc", NGRAM]


def test_vllm_on_path(tmp_path: Path, vllm_env: Path, record_file: Path) -> None:
    environ = clean_environ(
        tmp_path, RECORD_TO=str(record_file), PATH=f"{vllm_env / 'bin'}:/usr/bin:/bin"
    )
    pid, result = start(["serve", "m", "-sc", NGRAM], environ)
    assert result.returncode == 0, result.stderr
    assert read_record(record_file)["pid"] == pid


def test_console_script(
    tmp_path: Path, vllm_env: Path, record_file: Path, system_host: SystemHost
) -> None:
    script = Path(sys.executable).parent / "vllm-cpu-launch"
    if not script.exists():
        pytest.fail(f"{script} missing: install the package (pip install -e .)")
    environ = clean_environ(tmp_path, RECORD_TO=str(record_file))
    args = ["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m", "-sc", NGRAM]
    result = run_launcher(args, environ, launcher=[str(script)])
    assert result.returncode == 0, result.stderr
    library = vllm_env / "lib" / "libiomp5.so"
    assert read_record(record_file)["LD_PRELOAD"] == system_host.preload(library)


def test_exit_status_is_vllms(launch: Launch, vllm_env: Path) -> None:
    result, _ = launch(["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m"], RECORD_EXIT="42")
    assert result.returncode == 42


def test_vllm_help_goes_to_vllm(launch: Launch, vllm_env: Path) -> None:
    result, record = launch(["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "--help"])
    assert result.returncode == 0
    assert record["argv"] == ["serve", "--help"]
