"""The target (vllm_cpu_launch/target.py): its wrapper reader on what no installer writes
(it never guesses and never raises), and a vllm not found or not runnable (127 or 126,
one clear error line: the last section).

The forms installers do write are made by the installers themselves in
tests/test_installers.py; here are the others: hand-written trampolines with shell
expansions the reader does not evaluate, malformed quoting, and arbitrary bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_cpu_launch.target import read_wrapper

from .conftest import RECORDER, SystemHost, clean_environ, read_record, run_launcher
from .hardening import (
    ERROR_PREFIX,
    NGRAM,
    base_environ,
    isolated_environ,
    isolated_launcher,
    run,
    single_error,
    text,
)


def write_script(path: Path, text: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    path.chmod(0o755)
    return path


def test_an_expansion_it_does_not_evaluate_leaves_the_interpreter_unknown(tmp_path: Path) -> None:
    """`$(command -v python3)` would need a shell: the launcher says nothing it cannot
    know, decides the environment from the script's place, and /bin/sh still runs it."""
    python = Path(sys.executable)
    env = tmp_path / "env"
    (env / "pyvenv.cfg").parent.mkdir(parents=True)
    (env / "pyvenv.cfg").write_text("home = /usr/bin\n")
    script = write_script(
        env / "bin" / "vllm",
        b"#!/bin/sh\n'''exec' \"$(command -v python3)\" \"$0\" \"$@\"\n' '''\n" + RECORDER.encode(),
    )
    wrapper = read_wrapper(str(script), None)
    assert (wrapper.form, wrapper.interpreter) == ("unknown", None)
    assert "$(command -v python3)" in wrapper.detail

    record = tmp_path / "record.json"
    environ = clean_environ(tmp_path, RECORD_TO=str(record), PATH=f"{python.parent}:/usr/bin:/bin")
    plan = run_launcher(["--dry-run", "--vllm", str(script), "serve", "m"], environ)
    assert plan.returncode == 0, plan.stderr
    assert f"vLLM's environment: {env} (the pyvenv.cfg of the environment it lies in)" in (
        plan.stdout
    )
    ran = run_launcher(["-q", "--vllm", str(script), "serve", "m"], environ)
    assert ran.returncode == 0, ran.stderr
    assert read_record(record)["argv"] == ["serve", "m"]


@given(second=st.binary(max_size=200))
def test_any_second_line_of_a_sh_wrapper_is_read_without_raising(second: bytes) -> None:
    with tempfile.TemporaryDirectory() as directory:
        script = write_script(Path(directory) / "vllm", b"#!/bin/sh\n'''exec' " + second)
        wrapper = read_wrapper(str(script), "/usr/bin:/bin")
        assert wrapper.form in ("sh-trampoline", "unknown", "direct")
        assert wrapper.interpreter is None or wrapper.interpreter.startswith("/")


def test_deeply_nested_substitutions_leave_the_interpreter_unknown(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "env" / "bin" / "vllm", b"#!/bin/sh\n'''exec' \"" + b"$(" * 1500 + b"\n"
    )
    wrapper = read_wrapper(str(script), None)
    assert (wrapper.form, wrapper.interpreter) == ("unknown", None)
    result = run_launcher(
        ["--dry-run", "--vllm", str(script), "serve", "m"], clean_environ(tmp_path)
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


def test_a_bare_trampoline_name_is_looked_up_on_path_as_the_shell_does(tmp_path: Path) -> None:
    """`'''exec' python3 "$0" "$@"`: sh runs the python3 on PATH, and so does the plan."""
    python = Path(sys.executable)
    record = tmp_path / "record.json"
    script = write_script(
        tmp_path / "bin" / "vllm",
        f"#!/bin/sh\n'''exec' {python.name} \"$0\" \"$@\"\n' '''\n{RECORDER}".encode(),
    )
    environ = clean_environ(tmp_path, RECORD_TO=str(record), PATH=f"{python.parent}:/usr/bin:/bin")
    wrapper = read_wrapper(str(script), environ["PATH"])
    assert (wrapper.form, wrapper.interpreter) == ("sh-trampoline", str(python))
    ran = run_launcher(["-q", "--vllm", str(script), "serve", "m"], environ)
    assert ran.returncode == 0, ran.stderr
    assert read_record(record)["argv"] == ["serve", "m"]
    gone = run_launcher(["--vllm", str(script), "serve", "m"], {**environ, "PATH": "/usr/bin:/bin"})
    assert gone.returncode == 127 and f"runs {python.name!r} from PATH" in gone.stderr


def test_a_shell_script_wrapper_is_served_by_the_environment_it_lies_in(
    tmp_path: Path, real_iomp: Path, system_host: SystemHost
) -> None:
    """An operator's `#!/bin/sh` script in a real venv's bin/: the shell is no Python, so
    the venv it lies in decides; its library is chosen and mapped, and no warning says
    that /bin/sh is the environment."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    shutil.copy2(real_iomp, venv / "lib" / "libiomp5.so")
    (venv / "bin" / "record.py").write_text(RECORDER)
    script = write_script(
        venv / "bin" / "vllm",
        b'#!/bin/sh\nexec "$(dirname -- "$0")/python" "$(dirname -- "$0")/record.py" "$@"\n',
    )
    record = tmp_path / "record.json"
    environ = clean_environ(tmp_path, RECORD_TO=str(record))
    args = [
        "--vllm",
        str(script),
        "serve",
        "m",
        "-sc",
        '{"method":"ngram","num_speculative_tokens":3}',
    ]
    plan = json.loads(run_launcher(["--dry-run", "--json", *args], environ).stdout)
    host = [p["path"] for p in system_host.preloaded()]
    assert [p["path"] for p in plan["preload"]] == [*host, str(venv / "lib" / "libiomp5.so")]
    assert plan["warnings"] == []
    ran = run_launcher(["-q", *args], environ)
    assert ran.returncode == 0, ran.stderr
    assert os.path.realpath(venv / "lib" / "libiomp5.so") in read_record(record)["mapped"]  # type: ignore[operator]


# -------------------- The target not found or not runnable: tests/test_hardening_environment.py
# Broken environments: each gives its exit code and one clear error line, no traceback.


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
