"""Broken environments: each gives its exit code and one clear error line, no traceback."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .conftest import AS_NOBODY
from .hardening_support import (
    ERROR_PREFIX,
    GUARD,
    LAUNCHER,
    NGRAM,
    base_environ,
    fake_vllm,
    isolated_environ,
    isolated_launcher,
    public_directory,
    read_record,
    record_argv,
    run,
    single_error,
    text,
)

# ------------------------------------------------------------------ the target


def test_no_vllm_anywhere_exits_127(tmp_path: Path) -> None:
    launcher = isolated_launcher(tmp_path / "launcher")
    (tmp_path / "empty").mkdir()
    environ = isolated_environ(tmp_path / "home", PATH=str(tmp_path / "empty"))
    line = single_error(run(["serve", "m"], environ, launcher), 127)
    assert "vllm not found" in line
    assert str(tmp_path / "launcher" / "bin" / "vllm") in line  # beside the launcher
    assert f"PATH ({tmp_path / 'empty'})" in line
    assert "--vllm" in line  # the way out


def test_a_long_path_is_named_briefly_in_the_error_and_in_doctor(tmp_path: Path) -> None:
    """A real PATH runs to hundreds of bytes: the places looked in, not all of it."""
    launcher = isolated_launcher(tmp_path / "launcher")
    path = ":".join(f"/nonexistent/dir{index}" for index in range(40))
    environ = isolated_environ(tmp_path / "home", PATH=path)
    line = single_error(run(["serve", "m"], environ, launcher), 127)
    assert "PATH (/nonexistent/dir0, /nonexistent/dir1, /nonexistent/dir2 and 37 more)" in line
    assert "dir39" not in line and len(line) < 300
    doctor = run(["doctor"], environ, launcher)
    assert doctor.returncode == 0, doctor.stderr
    report = text(doctor.stdout)
    assert "dir39" not in report and report.count("dir2 and 37 more") == 2


@pytest.mark.parametrize("path", [".", "bin:/nonexistent/dir0"])
def test_a_relative_path_entry_is_named_as_skipped_and_why(tmp_path: Path, path: str) -> None:
    """A relative PATH entry names whatever directory the launch runs in: never searched,
    even where it holds the program, and the not-found error says so."""
    for directory in (tmp_path, tmp_path / "bin"):
        directory.mkdir(exist_ok=True)
        (directory / "vllm").write_text(f"#!/bin/sh\ntouch {tmp_path / 'record'}\n")
        (directory / "vllm").chmod(0o755)
    environ = isolated_environ(tmp_path / "home", PATH=path)
    result = run(["exec", "--", "vllm"], environ, cwd=tmp_path)
    line = single_error(result, 127)
    relative = [entry for entry in path.split(":") if not entry.startswith("/")]
    assert f"skipped {relative[0]} as relative" in line
    assert "never searched" in line
    assert ("/nonexistent/dir0" in line) == ("/nonexistent/dir0" in path)
    assert not (tmp_path / "record").exists()


def test_no_vllm_with_path_unset_names_the_default_path(tmp_path: Path) -> None:
    if any(os.path.exists(os.path.join(d, "vllm")) for d in os.defpath.split(os.pathsep) if d):
        pytest.skip(f"a vllm is installed on the default path {os.defpath}")
    launcher = isolated_launcher(tmp_path / "launcher")
    environ = isolated_environ(tmp_path / "home")
    del environ["PATH"]
    line = single_error(run(["serve", "m"], environ, launcher), 127)
    assert "vllm not found" in line
    assert os.defpath in line


def non_executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o644)
    return path


def test_vllm_not_executable_given_with_option_exits_126(tmp_path: Path) -> None:
    vllm = non_executable(tmp_path / "env" / "bin" / "vllm")
    result = run(["--vllm", str(vllm), "serve", "m"], base_environ(tmp_path / "home"))
    line = single_error(result, 126)
    assert f"{vllm} is not executable" in line
    assert f"chmod +x {vllm}" in line


def test_vllm_not_executable_on_path_exits_126(tmp_path: Path) -> None:
    """As in a shell: the file found on PATH is named, not 'command not found'."""
    launcher = isolated_launcher(tmp_path / "launcher")
    vllm = non_executable(tmp_path / "path" / "vllm")
    environ = isolated_environ(tmp_path / "home", PATH=str(vllm.parent))
    line = single_error(run(["serve", "m"], environ, launcher), 126)
    assert f"{vllm} is not executable" in line


def test_vllm_not_executable_beside_the_launcher_exits_126(tmp_path: Path) -> None:
    launcher = isolated_launcher(tmp_path / "launcher")
    vllm = non_executable(tmp_path / "launcher" / "bin" / "vllm")
    environ = isolated_environ(tmp_path / "home")
    line = single_error(run(["serve", "m"], environ, launcher), 126)
    assert f"{vllm} is not executable" in line


def test_directory_named_vllm_exits_126(tmp_path: Path) -> None:
    directory = tmp_path / "env" / "bin" / "vllm"
    directory.mkdir(parents=True)
    result = run(["--vllm", str(directory), "serve", "m"], base_environ(tmp_path / "home"))
    assert f"{directory} is not a regular file" in single_error(result, 126)

    launcher = isolated_launcher(tmp_path / "launcher")
    (tmp_path / "launcher" / "bin" / "vllm").mkdir()
    result = run(["serve", "m"], isolated_environ(tmp_path / "home"), launcher)
    assert "is not a regular file" in single_error(result, 126)


def test_directory_named_vllm_on_path_is_skipped_like_a_shell_does(tmp_path: Path) -> None:
    launcher = isolated_launcher(tmp_path / "launcher")
    (tmp_path / "path" / "vllm").mkdir(parents=True)
    environ = isolated_environ(tmp_path / "home", PATH=str(tmp_path / "path"))
    assert "vllm not found" in single_error(run(["serve", "m"], environ, launcher), 127)


@pytest.mark.parametrize(
    ("interpreter", "expected"),
    [
        ("/nonexistent/bin/python3", "interpreter /nonexistent/bin/python3, which does not exist"),
        ("{tmp}/text-file", "interpreter {tmp}/text-file, which is not an executable file"),
        ("{tmp}", "interpreter {tmp}, which is not an executable file"),  # a directory
        # neither ELF nor #!: refused before the exec, which would only say ENOEXEC
        (None, "is neither a #! script nor an ELF executable, so the kernel cannot run it"),
    ],
    ids=["missing-interpreter", "interpreter-not-executable", "interpreter-directory", "no-#!"],
)
def test_unrunnable_script_exits_126(
    tmp_path: Path, interpreter: str | None, expected: str
) -> None:
    (tmp_path / "text-file").write_text("not a program\n")
    (tmp_path / "text-file").chmod(0o644)
    vllm = tmp_path / "env" / "bin" / "vllm"
    vllm.parent.mkdir(parents=True)
    first_line = f"#!{interpreter.format(tmp=tmp_path)}" if interpreter else ""
    vllm.write_text(f"{first_line}\nprint('started')\n")
    vllm.chmod(0o755)
    result = run(["--vllm", str(vllm), "serve", "m", "-sc", NGRAM], base_environ(tmp_path))
    # -q is not given: the INFO line may precede the error, but no second error.
    stderr = text(result.stderr)
    assert "Traceback" not in stderr
    assert result.returncode == 126, stderr
    errors = [line for line in stderr.splitlines() if line.startswith(ERROR_PREFIX)]
    assert len(errors) == 1, stderr
    assert expected.format(tmp=tmp_path) in errors[0]
    assert str(vllm) in errors[0]
    assert result.stdout == b""  # nothing ran


def test_env_shebang_naming_a_missing_program_is_the_programs_own_127(tmp_path: Path) -> None:
    """`#!/usr/bin/env NAME` with no NAME on PATH: 127, as env would exit, naming NAME."""
    vllm = tmp_path / "env" / "bin" / "vllm"
    vllm.parent.mkdir(parents=True)
    vllm.write_text("#!/usr/bin/env no-such-python-hardening\n")
    vllm.chmod(0o755)
    result = run(["-q", "--vllm", str(vllm), "serve", "m"], base_environ(tmp_path))
    stderr = text(result.stderr)
    assert result.returncode == 127
    assert "no-such-python-hardening" in stderr
    assert "Traceback" not in stderr


# ------------------------------------------------------------------ PATH, HOME, closed fds


@pytest.fixture
def vllm(tmp_path: Path) -> Path:
    return fake_vllm(tmp_path / "env")


def test_path_unset_still_starts_an_explicit_vllm(tmp_path: Path, vllm: Path) -> None:
    record = tmp_path / "record.json"
    environ = base_environ(tmp_path / "home", HARDENING_RECORD=str(record))
    del environ["PATH"]
    result = run(["--vllm", str(vllm), "serve", "m", "-sc", NGRAM], environ)
    assert result.returncode == 0, text(result.stderr)
    data = read_record(record)
    assert record_argv(data) == [b"serve", b"m", b"-sc", NGRAM.encode()]
    assert data["env"]["PATH"] is None  # not invented for the target either
    assert data["env"]["LD_PRELOAD"] == str(vllm.parent.parent / "lib" / "libiomp5.so")


def test_home_and_xdg_unset_still_start(tmp_path: Path, vllm: Path) -> None:
    record = tmp_path / "record.json"
    environ = base_environ(tmp_path / "home", HARDENING_RECORD=str(record))
    del environ["HOME"], environ["XDG_CONFIG_HOME"]
    result = run(["--vllm", str(vllm), "serve", "m", "-sc", NGRAM], environ)
    assert result.returncode == 0, text(result.stderr)
    assert "Traceback" not in text(result.stderr)
    assert record_argv(read_record(record))[:2] == [b"serve", b"m"]


CLOSE = {"stdin+stdout": "0<&- 1>&-", "all three": "0<&- 1>&- 2>&-"}


@pytest.mark.parametrize("closed", list(CLOSE))
def test_closed_standard_streams_still_exec(tmp_path: Path, vllm: Path, closed: str) -> None:
    """Started with fds closed, as some service managers do: the target still starts,
    with the same fds closed (the launcher leaves nothing of its own on them)."""
    record = tmp_path / "record.json"
    environ = base_environ(tmp_path / "home", HARDENING_RECORD=str(record))
    command = [
        "sh",
        "-c",
        f'exec {CLOSE[closed]} "$@"',
        "sh",
        *LAUNCHER,
        "--vllm",
        str(vllm),
        "serve",
        "m",
        "-sc",
        NGRAM,
    ]
    result = subprocess.run(command, env=environ, capture_output=True, timeout=GUARD, check=False)
    assert result.returncode == 0, text(result.stderr)
    data = read_record(record)
    assert record_argv(data) == [b"serve", b"m", b"-sc", NGRAM.encode()]
    assert data["env"]["LD_PRELOAD"] == str(vllm.parent.parent / "lib" / "libiomp5.so")
    assert data["fds"]["0"] is None
    assert data["fds"]["1"] is None
    if closed == "all three":
        assert data["fds"]["2"] is None
    else:
        assert b"preloading" in result.stderr  # the INFO line still reached stderr


def test_closed_stderr_keeps_the_exit_code_of_an_error(tmp_path: Path) -> None:
    command = ["sh", "-c", 'exec 2>&- "$@"', "sh", *LAUNCHER, "--vllm", str(tmp_path / "nope")]
    result = subprocess.run(
        [*command, "serve", "m"],
        env=base_environ(tmp_path / "home"),
        capture_output=True,
        timeout=GUARD,
        check=False,
    )
    assert result.returncode == 127
    assert result.stdout == b""


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


# ------------------------------------------------------------------ config files

PROBLEMS = {
    # problem: (content or a marker, what the message must say, the key it must name)
    "invalid-yaml": (b"iomp: [auto\nstrict: yes\n", "invalid YAML", None),
    "wrong-type": (b"iomp: 5\n", "is not one of auto, always, never", "iomp"),
    "wrong-type-list": (b"kmp-blocktime: [5]\n", "is not a KMP_BLOCKTIME", "kmp-blocktime"),
    "unknown-key": (b"iomp_mode: auto\n", "unknown key", "iomp_mode"),
    "not-a-mapping": (b"- iomp\n- always\n", "must be a mapping", None),
    "not-utf8": (b"iomp: \xff\xfeauto\n", "not UTF-8", None),
    "directory": (b"<directory>", "is a directory", None),
    "unreadable": (b"<unreadable>", "Permission denied", None),
    "missing": (b"<missing>", "not found", None),
}
SOURCES = ("--launcher-config", "VLLMCPULAUNCH_CONFIG", "XDG_CONFIG_HOME", "HOME/.config")


def place_config(path: Path, content: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if content == b"<directory>":
        path.mkdir()
    elif content == b"<unreadable>":
        path.write_text("iomp: always\n")
        path.chmod(0o000 if os.geteuid() != 0 else 0o600)  # root reads anything: see below
    elif content != b"<missing>":
        path.write_bytes(content)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_bad_config_file_exits_2_naming_file_and_key(
    source: str, problem: str, request: pytest.FixtureRequest
) -> None:
    content, message, key = PROBLEMS[problem]
    as_nobody = problem == "unreadable" and os.geteuid() == 0
    # Root reads everything: an unreadable file needs another user.
    launcher = request.getfixturevalue("nobody_launcher") if as_nobody else LAUNCHER
    with public_directory() as root:  # uid 65534 must reach it in the "unreadable" case
        vllm = fake_vllm(root / "env")
        (root / "env" / "bin" / "python").unlink()
        (root / "env" / "bin" / "python").symlink_to("/bin/sh")  # uid 65534 can stat it
        record = root / "record.json"
        environ = base_environ(root / "home", HARDENING_RECORD=str(record))
        args = ["--vllm", str(vllm), "--dry-run", "serve", "m"]
        if source == "--launcher-config":
            path = root / "launcher.yaml"
            args = ["--launcher-config", str(path), *args]
        elif source == "VLLMCPULAUNCH_CONFIG":
            path = root / "from-variable.yaml"
            environ["VLLMCPULAUNCH_CONFIG"] = str(path)
        elif source == "XDG_CONFIG_HOME":
            path = root / "xdg" / "vllm-cpu-launch" / "config.yaml"
            environ["XDG_CONFIG_HOME"] = str(root / "xdg")
        else:
            path = root / "home" / ".config" / "vllm-cpu-launch" / "config.yaml"
            del environ["XDG_CONFIG_HOME"]
        place_config(path, content)
        result = run(args, environ, launcher, prefix=AS_NOBODY if as_nobody else ())
        if problem == "missing" and source in ("XDG_CONFIG_HOME", "HOME/.config"):
            # The user file is optional: without it the launcher plans as usual.
            assert result.returncode == 0, text(result.stderr)
            assert "Traceback" not in text(result.stderr)
            assert text(result.stdout).startswith("command:")
            return
        line = single_error(result, 2)
        assert str(path) in line
        assert message in line
        if key is not None:
            assert f"key {key!r}" in line
        if problem == "unknown-key":
            assert "allowed keys: iomp, iomp-path" in line
