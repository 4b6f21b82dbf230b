"""Which program to exec (usually `vllm`), and the Python environment it runs in."""

from __future__ import annotations

import os
import stat

from vllm_cpu_launch.errors import EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, LaunchError
from vllm_cpu_launch.records import record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

SHEBANG_BYTES = 1024


@record
class Target:
    """The program to exec and the environment whose libraries should serve it."""

    executable: str  # absolute path
    found_via: str  # "--vllm", "launcher-environment" or "PATH"
    interpreter: str | None = None  # from the `#!` line, when it is a script
    prefix: str | None = None  # that interpreter's environment (venv or conda root)


def search_path(name: str, path_variable: str | None) -> str | None:
    """The first executable `name` on PATH (like the shell), else None."""
    for directory in (path_variable or os.defpath).split(os.pathsep):
        if not directory or not os.path.isabs(directory):
            continue  # the current directory is no place to pick a server from
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def check_path_files(name: str, path_variable: str | None, described: str) -> None:
    """Before saying `name` is not on PATH: a file there that cannot be executed is the
    real problem, as for a shell ('Permission denied', exit 126)."""
    for directory in (path_variable or os.defpath).split(os.pathsep):
        candidate = os.path.join(directory, name)
        if os.path.isabs(directory) and os.path.isfile(candidate):
            check_executable(candidate, described)


def describe_path(path_variable: str | None) -> str:
    """PATH for a message; unset, it is the default the search used."""
    if path_variable is None:
        return f"PATH (unset, so {os.defpath})"
    return f"PATH={path_variable}"


def check_executable(path: str, described: str) -> None:
    """Raise the exit code a shell would give when `path` cannot be executed."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise LaunchError(EXIT_NOT_FOUND, f"{described} {path} does not exist") from None
    except OSError as error:
        raise LaunchError(
            EXIT_NOT_EXECUTABLE, f"{described} {path} cannot be used: {error.strerror}"
        ) from None
    if not stat.S_ISREG(status.st_mode):
        raise LaunchError(EXIT_NOT_EXECUTABLE, f"{described} {path} is not a regular file")
    if not os.access(path, os.X_OK):
        raise LaunchError(
            EXIT_NOT_EXECUTABLE,
            f"{described} {path} is not executable; fix it with: chmod +x {path}",
        )


def read_interpreter(executable: str, path_variable: str | None) -> str | None:
    """The interpreter a script's `#!` line names, following pip's two forms.

    pip writes `#!/abs/python` or, for paths too long or with spaces,
    `#!/bin/sh` followed by `'''exec' "/abs/python" "$0" "$@"`.
    """
    try:
        with open(executable, "rb") as stream:
            head = stream.read(SHEBANG_BYTES)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    lines = head.decode("utf-8", "surrogateescape").splitlines()
    words = lines[0][2:].split()
    if not words:
        return None
    interpreter = words[0]
    if os.path.basename(interpreter) == "env":
        names = [word for word in words[1:] if not word.startswith("-")]
        return search_path(names[0], path_variable) if names else None
    if os.path.basename(interpreter) == "sh" and len(lines) > 1:
        second = lines[1]
        if second.startswith("'''exec' \""):
            return second[len("'''exec' \"") :].partition('"')[0]
    return interpreter


def environment_prefix(interpreter: str) -> str | None:
    """`/env/bin/python3` -> `/env`: venvs and conda keep the interpreter in `bin/`.

    The path is not resolved: a venv's `bin/python` links to the base interpreter,
    whose prefix is not the venv's.
    """
    directory = os.path.dirname(os.path.abspath(interpreter))
    if os.path.basename(directory) != "bin":
        return None
    return os.path.dirname(directory)


def describe_target(executable: str, found_via: str, path_variable: str | None) -> Target:
    """Check that the executable can run and read its environment from the `#!` line."""
    check_executable(executable, "vLLM executable" if found_via != "program" else "program")
    interpreter = read_interpreter(executable, path_variable)
    if interpreter is not None and not os.path.exists(interpreter):
        raise LaunchError(
            EXIT_NOT_EXECUTABLE,
            f"{executable} starts with #!{interpreter}, which does not exist; reinstall "
            "it in a working environment or choose another with --vllm",
        )
    if interpreter is not None and not (
        os.path.isfile(interpreter) and os.access(interpreter, os.X_OK)
    ):
        raise LaunchError(  # execve would only say "Exec format error" about the script
            EXIT_NOT_EXECUTABLE,
            f"{executable} starts with #!{interpreter}, which is not an executable file",
        )
    # A script's environment is its interpreter's; a program's own `bin/` names one too
    # (`exec -- /venv/bin/python ...`).
    prefix = environment_prefix(interpreter or executable)
    return Target(executable, found_via, interpreter, prefix)


def locate(name: str, found_via: str, path_variable: str | None, not_found: str) -> Target:
    """`name` as a path, else the first executable `name` on PATH; 127/126 as a shell."""
    if os.sep in name:
        return describe_target(os.path.abspath(name), found_via, path_variable)
    found = search_path(name, path_variable)
    if found is None:
        described = "program" if found_via == "program" else "vLLM executable"
        check_path_files(name, path_variable, described)
        raise LaunchError(EXIT_NOT_FOUND, not_found)
    return describe_target(found, found_via, path_variable)


def resolve_vllm(
    requested: str | None, environ: Mapping[str, str], launcher_executable: str
) -> Target:
    """`--vllm`, else `vllm` beside the launcher's interpreter, else `vllm` on PATH."""
    path_variable = environ.get("PATH")
    searched = describe_path(path_variable)
    if requested is not None:
        message = f"--vllm {requested}: no such executable on {searched}"
        return locate(requested, "--vllm", path_variable, message)
    beside = os.path.join(os.path.dirname(launcher_executable), "vllm")
    if launcher_executable and os.path.exists(beside):  # a dangling link: go on to PATH
        return describe_target(beside, "launcher-environment", path_variable)
    message = (
        f"vllm not found: looked beside the launcher's Python ({beside}) and on "
        f"{searched}; install vLLM there or pass --vllm /path/to/vllm"
    )
    return locate("vllm", "PATH", path_variable, message)


def resolve_program(program: str, environ: Mapping[str, str]) -> Target:
    """The PROGRAM of `vllm-cpu-launch exec -- PROGRAM`: a path, or a name on PATH."""
    path_variable = environ.get("PATH")
    message = f"{program}: no such executable on {describe_path(path_variable)}"
    return locate(program, "program", path_variable, message)
