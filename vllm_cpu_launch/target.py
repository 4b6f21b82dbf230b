"""Which program to exec (usually `vllm`), and the Python environment it runs in, read from
the wrapper its installer wrote (docs/installers.md): `#!/env/bin/python`, `#!/usr/bin/env
python3.11`, or `#!/bin/sh` then `'''exec' WORD "$0" "$@"`, WORD evaluated here, not by a
shell: quoting and the `dirname`/`realpath` substitutions of `uv venv --relocatable` only;
anything else leaves the interpreter unknown rather than guessed."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, LaunchError
from vllm_cpu_launch.records import record

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

HEAD_BYTES = 4096  # a wrapper's first two lines; a long venv path fits many times
TRAMPOLINE = "'''exec' "
SHELLS = ("sh", "bash", "dash")
PYTHON_NAMES = ("python", "pypy")  # how the names of Python interpreters begin
MAX_NESTING = 8  # `$(` within `$(`: installers nest two; deeper is not theirs
SUBSTITUTIONS: dict[str, Callable[[str], str]] = {
    "dirname": os.path.dirname,
    "realpath": os.path.realpath,
}


@record
class Wrapper:
    """What a script's first lines say about the interpreter that runs it."""

    form: str  # "direct", "env", "sh-trampoline", "not-a-script", "unreadable", "unknown"
    interpreter: str | None  # the program the script runs: a Python, or a shell
    # A name looked up on PATH ("env", a bare trampoline word), or what was not understood.
    detail: str = ""


class WordError(ValueError):
    """A shell word this reader does not evaluate (it never guesses)."""


def read_word(text: str, index: int, script: str, depth: int = 0) -> tuple[str, int]:
    """The value of the shell word at `text[index:]`, inside `depth` `$(`, and its end."""
    ends = " \t)" if depth else " \t"  # unquoted, these end a word (`)` only inside `$(`)
    value: list[str] = []
    quote = ""
    while index < len(text) and (quote or text[index] not in ends):
        char = text[index]
        index += 1
        if char == "'" and quote != '"':
            quote = "" if quote else "'"
        elif quote == "'":
            value.append(char)
        elif char == '"':
            quote = "" if quote else '"'
        elif char == "\\":
            if index >= len(text):
                raise WordError("a trailing backslash")
            if quote and text[index] not in '"\\$`':
                value.append(char)
            value.append(text[index])
            index += 1
        elif char == "$" and text.startswith("(", index):
            substituted, index = substitute(text, index + 1, script, depth + 1)
            value.append(substituted)
        elif char == "$" and text.startswith("0", index):
            value.append(script)
            index += 1
        elif char in "$`":
            raise WordError(f"shell expansion {char + text[index : index + 1]!r}")
        else:
            value.append(char)
    if quote:
        raise WordError("an unterminated quote")
    return "".join(value), index


def substitute(text: str, start: int, script: str, depth: int) -> tuple[str, int]:
    """The output of the `$(` whose command starts at `start`, and the index after its `)`."""
    if depth > MAX_NESTING:
        raise WordError(f"$( nested more than {MAX_NESTING} deep")
    if ")" not in text[start:]:
        raise WordError("an unterminated $(")
    words: list[str] = []
    index = start
    while index < len(text) and text[index] != ")":
        if text[index] in " \t":
            index += 1
        else:
            word, index = read_word(text, index, script, depth)
            words.append(word)
    if index >= len(text):
        raise WordError("an unterminated $(")
    words = [word for word in words if word != "--"]
    command = os.path.basename(words[0]) if words else ""
    if command not in SUBSTITUTIONS or len(words) != 2:
        raise WordError(f"the command substitution $({text[start:index]})")
    return SUBSTITUTIONS[command](words[1]), index + 1


def path_files(name: str, path_variable: str | None) -> Iterator[str]:
    """`name` in PATH's absolute directories (unset: the shell's default; never the cwd)."""
    for directory in (path_variable or os.defpath).split(os.pathsep):
        candidate = os.path.join(directory, name)
        if os.path.isabs(directory) and os.path.isfile(candidate):
            yield candidate


def executable_on_path(name: str, path_variable: str | None) -> str | None:
    return next((f for f in path_files(name, path_variable) if os.access(f, os.X_OK)), None)


def read_wrapper(script: str, path_variable: str | None) -> Wrapper:
    """The interpreter `script` runs, as the kernel and its `#!` line would pick it."""
    try:
        with open(script, "rb") as stream:
            head = stream.read(HEAD_BYTES)
    except OSError as error:
        return Wrapper("unreadable", None, error.strerror or str(error))
    if not head.startswith(b"#!"):
        return Wrapper("not-a-script", None)
    # Lines end at b"\n" only, and the kernel splits the #! line at spaces and tabs only
    # (a path may hold any other white space, U+00A0 included).
    first, second = (
        line.decode("utf-8", "surrogateescape") for line in [*head.split(b"\n", 2), b""][:2]
    )
    words = [word for word in first[2:].replace("\t", " ").split(" ") if word]
    if not words:
        return Wrapper("unknown", None, "an empty #! line")
    interpreter = words[0]
    if not interpreter.startswith("/"):
        return Wrapper("unknown", None, f"a relative #! interpreter {interpreter!r}")
    if os.path.basename(interpreter) == "env":
        # `env [-S] [-i] [NAME=VALUE...] PROGRAM`: the first word that is neither.
        names = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        if not names:
            return Wrapper("unknown", None, first)
        return Wrapper("env", executable_on_path(names[0], path_variable), names[0])
    shell = os.path.basename(interpreter) in SHELLS and len(words) == 1
    if not (shell and second.startswith(TRAMPOLINE)):
        return Wrapper("direct", interpreter)  # not a trampoline: the #! program runs it
    try:
        python, _ = read_word(second, len(TRAMPOLINE), script)
    except WordError as error:  # MAX_NESTING bounds the recursion
        return Wrapper("unknown", None, f"{second.strip()} ({error})")
    if "/" not in python:  # a bare name: the shell looks it up on PATH
        return Wrapper("sh-trampoline", executable_on_path(python, path_variable), python)
    return Wrapper("sh-trampoline", os.path.abspath(python))


ENVIRONMENT_MARKERS = ("pyvenv.cfg", "conda-meta")  # venv/virtualenv/uv/pipx; conda


@record
class Target:
    """The program to exec and its Python environment, from what installers leave on disk."""

    executable: str  # absolute path
    found_via: str  # "--vllm", "launcher-environment", "PATH" or "program"
    interpreter: str | None = None  # the Python that runs vLLM, when the evidence names one
    prefix: str | None = None  # that interpreter's environment (venv, conda or base prefix)
    user_base: str | None = None  # set for a `pip install --user` script: its user base
    evidence: str = ""  # what decided the environment
    disagreement: str | None = None  # where two pieces of evidence named different ones
    runner: str | None = None  # what the #! line runs (the Python, or a shell), checked too


def python_libraries(prefix: str) -> list[str]:
    """`<prefix>/lib/python3.N` directories (a handful of names, not a listing of lib/)."""
    libraries = (os.path.join(prefix, "lib", f"python3.{minor}") for minor in range(8, 20))
    return [directory for directory in libraries if os.path.isdir(directory)]


def site_packages(prefix: str | None) -> list[str]:
    """`lib/python3.N/site-packages` of a prefix (or user base), for every N it has."""
    return (
        [os.path.join(lib, "site-packages") for lib in python_libraries(prefix)] if prefix else []
    )


def environment_of(path: str) -> tuple[str | None, str]:
    """(prefix, marker) of the environment whose `bin/` holds `path`, unresolved: a venv's
    `bin/python` links to the base interpreter."""
    prefix, bin_name = os.path.split(os.path.dirname(os.path.abspath(path)))
    if bin_name != "bin":
        return None, ""
    markers = (m for m in ENVIRONMENT_MARKERS if os.path.exists(os.path.join(prefix, m)))
    return prefix, next(markers, "")


def location_environment(executable: str) -> tuple[str | None, str]:
    """The marked environment the script lies in, or behind its links (pipx, `uv tool`)."""
    for path in dict.fromkeys((executable, os.path.realpath(executable))):
        prefix, marker = environment_of(path)
        if marker:
            return prefix, marker
    return None, ""


def python_user_base(environ: Mapping[str, str]) -> str | None:
    """The user base as Python computes it on Linux: PYTHONUSERBASE, else `~/.local`."""
    home = environ.get("HOME")
    return environ.get("PYTHONUSERBASE") or (os.path.join(home, ".local") if home else None)


HOW_NAMED = {"direct": "its #! line", "env": "its #!/usr/bin/env line (on PATH)"}


def describe_target(executable: str, found_via: str, environ: Mapping[str, str]) -> Target:
    """Check that it runs; its environment is the Python's it runs, else the one it lies in."""
    check_executable(executable, found_via)
    wrapper = read_wrapper(executable, environ.get("PATH"))
    check_interpreter(executable, wrapper, environ)
    located, located_marker = location_environment(executable)
    python = wrapper.interpreter
    user_base = disagreement = None
    if python and os.path.basename(python).startswith(PYTHON_NAMES):
        prefix, marker = environment_of(python)
        how = HOW_NAMED.get(wrapper.form, "its /bin/sh trampoline")
        evidence = f"{how} names {python}"
        evidence += f", in an environment marked by {marker}" if marker else ""
        if located and located != prefix:
            disagreement = (
                f"{executable} lies in the environment {located}, but {how} runs "
                f"{python} (environment {prefix or '?'}); using the latter, which is what will run"
            )
        base = python_user_base(environ)
        if not marker and base and os.path.dirname(executable) == os.path.join(base, "bin"):
            user_base = base  # a `pip install --user` script (venvs have no user site)
            evidence += f"; a user install in {base}"
    elif located:
        beside = os.path.join(located, "bin", "python")
        prefix = located
        python = beside if os.path.exists(beside) else None
        evidence = f"the {located_marker} of the environment it lies in"
    else:
        python = None
        prefix, _ = environment_of(executable)
        evidence = "its own bin/ directory" if prefix else "none"
    runner = wrapper.interpreter
    return Target(executable, found_via, python, prefix, user_base, evidence, disagreement, runner)


PATH_SHOWN = 3  # directories of PATH a message names; a real PATH runs to hundreds of bytes


def describe_path(path_variable: str | None) -> str:
    """PATH for a message, briefly, with the relative entries the search skipped."""
    if path_variable is None:
        return f"PATH (unset, so {os.defpath})"
    entries = list(dict.fromkeys(d for d in path_variable.split(os.pathsep) if d))
    if not entries:
        return "PATH (empty)"
    directories = [entry for entry in entries if os.path.isabs(entry)]
    relative = [entry for entry in entries if not os.path.isabs(entry)]
    shown = ", ".join(directories[:PATH_SHOWN]) or "no absolute directory"
    more = len(directories) - PATH_SHOWN
    skipped = (
        f"; skipped {', '.join(relative[:PATH_SHOWN])} as relative: a relative entry names "
        "whatever directory the launch runs in, so it is never searched; write it absolute"
    )
    return f"PATH ({shown}{f' and {more} more' if more > 0 else ''}{skipped if relative else ''})"


# What to name instead of a file that is no program, by what the messages call the target.
PROGRAM_FIX = {
    "vLLM executable": "give --vllm the vllm script of the environment vLLM is installed "
    "in, e.g. /venv/bin/vllm",
    "program": "name a program, e.g. vllm-cpu-launch exec -- /venv/bin/python script.py",
}


def check_executable(path: str, found_via: str) -> None:
    """Raise the exit code a shell would give when `path` cannot be executed."""
    described = "program" if found_via == "program" else "vLLM executable"  # exec's, or ours
    try:
        status = os.stat(path)
    except FileNotFoundError:  # no subject: nothing was found (doctor says so)
        raise LaunchError(EXIT_NOT_FOUND, f"{described} {path} does not exist") from None
    except OSError as error:
        problem = f"cannot be used: {error.strerror}"
    else:
        executable = os.access(path, os.X_OK)
        if not stat.S_ISREG(status.st_mode):
            problem = "is not a regular file"
        elif not is_program(path):  # a data file named by mistake: execve says only ENOEXEC
            cannot = "the kernel cannot run it" if executable else "no chmod makes it run"
            problem = (
                f"is neither a #! script nor an ELF executable, so {cannot}; "
                f"{PROGRAM_FIX[described]}"
            )
        elif not executable:
            problem = f"is not executable; fix it with: chmod +x {path}"
        else:
            return
    raise LaunchError(EXIT_NOT_EXECUTABLE, f"{described} {path} {problem}", subject=path)


def is_program(path: str) -> bool:
    """Whether the file starts as the kernel runs it (one unread is given the doubt)."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(4)
    except OSError:
        return True
    return head.startswith(b"#!") or head == b"\x7fELF"


def check_interpreter(executable: str, wrapper: Wrapper, environ: Mapping[str, str]) -> None:
    """Fail as the kernel or the wrapper would, but say why."""
    interpreter = wrapper.interpreter
    if wrapper.detail and interpreter is None and wrapper.form in ("env", "sh-trampoline"):
        raise LaunchError(
            EXIT_NOT_FOUND,
            f"{executable} runs {wrapper.detail!r} from PATH, but "
            f"{describe_path(environ.get('PATH'))} has none; put its environment's bin/ "
            "first on PATH, or choose another vLLM with --vllm",
            subject=executable,
        )
    if interpreter is None or (os.path.isfile(interpreter) and os.access(interpreter, os.X_OK)):
        return
    problem = "is not an executable file"  # where execve would say only "Exec format error"
    if not os.path.lexists(interpreter):
        located, _ = location_environment(executable)
        moved = (
            f"its environment {located} was moved or its Python removed after install "
            "(a venv cannot be moved): recreate the environment where it now lives"
            if located
            else "reinstall it in a working environment"
        )
        problem = f"does not exist: {moved}, or choose another vLLM with --vllm"
    raise LaunchError(
        EXIT_NOT_EXECUTABLE,
        f"{executable} runs the interpreter {interpreter}, which {problem}",
        subject=executable,
    )


def locate(name: str, found_via: str, environ: Mapping[str, str], not_found: str) -> Target:
    """`name` as a path, else the first executable `name` on PATH; 127/126 as a shell."""
    if os.sep in name:
        return describe_target(os.path.abspath(name), found_via, environ)
    found = executable_on_path(name, environ.get("PATH"))
    if found is None:
        # A file on PATH that cannot be executed is the real problem, as for a shell (126).
        for candidate in path_files(name, environ.get("PATH")):
            check_executable(candidate, found_via)
        raise LaunchError(EXIT_NOT_FOUND, not_found)
    return describe_target(found, found_via, environ)


def resolve_vllm(
    requested: str | None, environ: Mapping[str, str], launcher_executable: str
) -> Target:
    """`--vllm`, else `vllm` beside the launcher's interpreter, else `vllm` on PATH."""
    searched = describe_path(environ.get("PATH"))
    if requested is not None:
        message = f"--vllm {requested}: no such executable on {searched}"
        return locate(requested, "--vllm", environ, message)
    beside = os.path.join(os.path.dirname(launcher_executable), "vllm")
    if launcher_executable and os.path.exists(beside):  # a dangling link: go on to PATH
        return describe_target(beside, "launcher-environment", environ)
    message = (
        f"vllm not found: looked beside the launcher's Python ({beside}) and on "
        f"{searched}; install vLLM there or pass --vllm /path/to/vllm"
    )
    return locate("vllm", "PATH", environ, message)


def resolve_program(program: str, environ: Mapping[str, str]) -> Target:
    """The PROGRAM of `vllm-cpu-launch exec -- PROGRAM`: a path, or a name on PATH."""
    message = f"{program}: no such executable on {describe_path(environ.get('PATH'))}"
    return locate(program, "program", environ, message)
