"""Which program to exec (usually `vllm`), and the Python environment it runs in, read from
the console-script wrapper its installer wrote.

Installers write a handful of forms, all seen from the real tools:

- `#!/env/bin/python` (pip/distlib, uv, virtualenv, pipx, conda with a short prefix);
- `#!/usr/bin/env python3.11` (conda with a long prefix, hand-written scripts);
- `#!/bin/sh` then `'''exec' WORD "$0" "$@"`, where WORD is the interpreter as a shell
  word: unquoted or double-quoted (pip, virtualenv: paths too long for the kernel's `#!`
  limit, or with spaces), single-quoted (uv), or relative to the script's real path
  (`uv venv --relocatable`: `"$(dirname -- "$(realpath -- "$0")")"/'python'`).

The word is evaluated here, not by a shell: only quoting and the `dirname`/`realpath`
command substitutions installers use are understood; anything else leaves the
interpreter unknown rather than guessed. No child process is started.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, LaunchError, record

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping


# Which interpreter a console script runs

HEAD_BYTES = 4096  # a wrapper's first two lines; a long venv path fits many times
TRAMPOLINE = "'''exec' "
SHELLS = ("sh", "bash", "dash")
PYTHON_NAMES = ("python", "pypy")  # how the names of Python interpreters begin
MAX_NESTING = 8  # `$(` within `$(`: installers nest two; deeper is not theirs


@record
class Wrapper:
    """What a script's first lines say about the interpreter that runs it."""

    form: str  # "direct", "env", "sh-trampoline", "not-a-script", "unreadable", "unknown"
    interpreter: str | None  # the program the script runs: a Python, or a shell
    # A name looked up on PATH ("env", a bare trampoline word), or what was not understood.
    detail: str = ""

    @property
    def python(self) -> str | None:
        """The interpreter when it is a Python (a shell script names none)."""
        name = os.path.basename(self.interpreter or "")
        return self.interpreter if name.startswith(PYTHON_NAMES) else None


class WordError(ValueError):
    """A shell word this reader does not evaluate (it never guesses)."""


def substitution_end(text: str, start: int, depth: int = 1) -> int:
    """The index after the `)` that closes the `$(` at `start`, with the shell's quoting
    (a nested `$(` inside double quotes is a new quoting context)."""
    if depth > MAX_NESTING:
        raise WordError(f"$( nested more than {MAX_NESTING} deep")
    index, quote = start + 2, ""
    while index < len(text):
        char = text[index]
        if quote == "'":
            quote = "" if char == "'" else quote
        elif char == "\\":
            index += 1
        elif text.startswith("$(", index):
            index = substitution_end(text, index, depth + 1)
            continue
        elif char == '"':
            quote = "" if quote else '"'
        elif char == "'" and not quote:
            quote = "'"
        elif char == ")" and not quote:
            return index + 1
        index += 1
    raise WordError("an unterminated $(")


def read_word(text: str, start: int, script: str) -> tuple[str, int]:
    """Evaluate the shell word at `text[start:]`: its value and the index after it."""
    value: list[str] = []
    index = start
    quote = ""
    while index < len(text):
        char = text[index]
        if not quote and char in " \t":
            break
        if quote == "'":
            if char == "'":
                quote = ""
            else:
                value.append(char)
            index += 1
        elif char == "\\" and quote != "'":
            if index + 1 >= len(text):
                raise WordError("a trailing backslash")
            following = text[index + 1]
            if quote == '"' and following not in '"\\$`':
                value.append(char)
            value.append(following)
            index += 2
        elif char == "'" and not quote:
            quote = "'"
            index += 1
        elif char == '"':
            quote = "" if quote else '"'
            index += 1
        elif text.startswith("$(", index):
            end = substitution_end(text, index)
            value.append(run_substitution(text[index + 2 : end - 1], script))
            index = end
        elif text.startswith("$0", index):
            value.append(script)
            index += 2
        elif char in "$`":
            raise WordError(f"shell expansion {text[index : index + 2]!r}")
        else:
            value.append(char)
            index += 1
    if quote:
        raise WordError("an unterminated quote")
    return "".join(value), index


def read_words(text: str, script: str) -> list[str]:
    words: list[str] = []
    index = 0
    while index < len(text):
        if text[index] in " \t":
            index += 1
            continue
        word, index = read_word(text, index, script)
        words.append(word)
    return words


# The commands installers' trampolines run inside `$( )`, computed without a shell.
SUBSTITUTIONS: dict[str, Callable[[str], str]] = {
    "dirname": os.path.dirname,
    "realpath": os.path.realpath,
}


def run_substitution(body: str, script: str) -> str:
    words = [w for w in read_words(body, script) if w != "--"]
    command = os.path.basename(words[0]) if words else ""
    if command not in SUBSTITUTIONS or len(words) != 2:
        raise WordError(f"the command substitution $({body})")
    return SUBSTITUTIONS[command](words[1])


def path_files(name: str, path_variable: str | None) -> Iterator[str]:
    """The files called `name` in PATH's absolute directories, in order (unset PATH: the
    default a shell uses). The current directory is no place to pick a server from."""
    for directory in (path_variable or os.defpath).split(os.pathsep):
        candidate = os.path.join(directory, name)
        if os.path.isabs(directory) and os.path.isfile(candidate):
            yield candidate


def executable_on_path(name: str, path_variable: str | None) -> str | None:
    """The first executable `name` on PATH (like the shell), else None."""
    return next((f for f in path_files(name, path_variable) if os.access(f, os.X_OK)), None)


def read_wrapper(script: str, path_variable: str | None) -> Wrapper:
    """The interpreter `script` runs, as the kernel and its `#!` line would pick it.

    `script` is the path that will be exec'd (it is `$0` to a trampoline).
    """
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
    if os.path.basename(interpreter) in SHELLS and len(words) == 1:
        if not second.startswith(TRAMPOLINE):
            return Wrapper("direct", interpreter)  # a shell script proper
        try:
            python, _ = read_word(second, len(TRAMPOLINE), script)
        except (WordError, RecursionError) as error:
            return Wrapper("unknown", None, f"{second.strip()} ({error})")
        if "/" not in python:  # a bare name: the shell looks it up on PATH
            return Wrapper("sh-trampoline", executable_on_path(python, path_variable), python)
        return Wrapper("sh-trampoline", os.path.abspath(python))
    return Wrapper("direct", interpreter)


# The program to exec and its environment

ENVIRONMENT_MARKERS = ("pyvenv.cfg", "conda-meta")  # venv/virtualenv/uv/pipx; conda


@record
class Target:
    """The program to exec and the Python environment whose libraries should serve it.

    Decided from what installers leave on disk (see decide_environment), never by
    running Python: `evidence` says what was used, `disagreement` where two pieces of
    evidence pointed at different environments.
    """

    executable: str  # absolute path
    found_via: str  # "--vllm", "launcher-environment", "PATH" or "program"
    interpreter: str | None = None  # the Python that runs vLLM, when the evidence names one
    prefix: str | None = None  # that interpreter's environment (venv, conda or base prefix)
    user_base: str | None = None  # set for a `pip install --user` script: its user base
    evidence: str = ""
    disagreement: str | None = None
    runner: str | None = None  # what the #! line runs (the Python, or a shell), checked too


def python_libraries(prefix: str) -> list[str]:
    """`<prefix>/lib/python3.N` directories (a handful of names, not a listing of lib/)."""
    lib = os.path.join(prefix, "lib")
    return [
        os.path.join(lib, f"python3.{minor}")
        for minor in range(8, 20)
        if os.path.isdir(os.path.join(lib, f"python3.{minor}"))
    ]


def environment_of(path: str) -> tuple[str | None, str]:
    """(prefix, marker) of the environment `path` (an interpreter or a script) lies in.

    Environments keep programs in `<prefix>/bin/`; `pyvenv.cfg` marks a venv (pip,
    virtualenv, uv, pipx), `conda-meta/` a conda prefix. A `bin/` without either is a
    base interpreter's prefix (marker ""). The path is not resolved: a venv's
    `bin/python` links to the base interpreter, whose prefix is not the venv's.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.basename(directory) != "bin":
        return None, ""
    prefix = os.path.dirname(directory)
    for marker in ENVIRONMENT_MARKERS:
        if os.path.exists(os.path.join(prefix, marker)):
            return prefix, marker
    return prefix, ""


def location_environment(executable: str) -> tuple[str | None, str]:
    """The marked environment the script itself lies in, as installed or behind links
    (pipx and `uv tool` link `~/.local/bin/NAME` into their own venvs)."""
    for path in dict.fromkeys((executable, os.path.realpath(executable))):
        prefix, marker = environment_of(path)
        if marker:
            return prefix, marker
    return None, ""


def python_user_base(environ: Mapping[str, str]) -> str | None:
    """The user base as Python computes it on Linux: PYTHONUSERBASE, else `~/.local`."""
    if environ.get("PYTHONUSERBASE"):
        return environ["PYTHONUSERBASE"]
    home = environ.get("HOME")
    return os.path.join(home, ".local") if home else None


def decide_environment(
    executable: str, wrapper: Wrapper, environ: Mapping[str, str]
) -> tuple[str | None, str | None, str | None, str, str | None]:
    """(Python, prefix, user base, evidence, disagreement) for the program at `executable`.

    The Python the wrapper runs decides, since its environment is the one whose
    site-packages vLLM imports; the script's location is the evidence when the wrapper
    names no Python (a shell script, an unreadable form, or no script at all, like
    `exec -- /venv/bin/python`), and then that environment's `bin/python` is its Python.
    """
    located, located_marker = location_environment(executable)
    if wrapper.python is None:
        if located:
            beside = os.path.join(located, "bin", "python")
            python = beside if os.path.exists(beside) else None
            return (
                python,
                located,
                None,
                f"the {located_marker} of the environment it lies in",
                None,
            )
        prefix, _ = environment_of(executable)
        return None, prefix, None, "its own bin/ directory" if prefix else "none", None
    python = wrapper.python
    prefix, marker = environment_of(python)
    how = {"direct": "its #! line", "env": "its #!/usr/bin/env line (on PATH)"}.get(
        wrapper.form, "its /bin/sh trampoline"
    )
    evidence = f"{how} names {python}" + (
        f", in an environment marked by {marker}" if marker else ""
    )
    disagreement = None
    if located and located != prefix:
        disagreement = (
            f"{executable} lies in the environment {located}, but {how} runs "
            f"{python} (environment {prefix or '?'}); using the latter, which is what will run"
        )
    user_base = None
    base = python_user_base(environ)
    if not marker and base and os.path.dirname(executable) == os.path.join(base, "bin"):
        user_base = base  # a `pip install --user` script (venvs have no user site)
        evidence += f"; a user install in {base}"
    return python, prefix, user_base, evidence, disagreement


def check_path_files(name: str, path_variable: str | None, described: str) -> None:
    """Before saying `name` is not on PATH: a file there that cannot be executed is the
    real problem, as for a shell ('Permission denied', exit 126)."""
    for candidate in path_files(name, path_variable):
        check_executable(candidate, described)


def described(found_via: str) -> str:
    """What the messages call the target: exec's PROGRAM, else the vLLM executable."""
    return "program" if found_via == "program" else "vLLM executable"


PATH_SHOWN = 3  # directories of PATH a message names; a real PATH runs to hundreds of bytes


def describe_path(path_variable: str | None) -> str:
    """PATH for a message, briefly: its first directories and how many more, and the
    relative entries the search skipped (path_files); unset, the default used."""
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


def check_executable(path: str, described: str) -> None:
    """Raise the exit code a shell would give when `path` cannot be executed."""
    try:
        status = os.stat(path)
    except FileNotFoundError:  # no subject: nothing was found (doctor says so)
        raise LaunchError(EXIT_NOT_FOUND, f"{described} {path} does not exist") from None
    except OSError as error:
        raise LaunchError(
            EXIT_NOT_EXECUTABLE,
            f"{described} {path} cannot be used: {error.strerror}",
            subject=path,
        ) from None
    if not stat.S_ISREG(status.st_mode):
        raise LaunchError(
            EXIT_NOT_EXECUTABLE, f"{described} {path} is not a regular file", subject=path
        )
    executable = os.access(path, os.X_OK)
    if not is_program(path):  # a data file named by mistake: execve would only say ENOEXEC
        cannot = "the kernel cannot run it" if executable else "no chmod makes it run"
        raise LaunchError(
            EXIT_NOT_EXECUTABLE,
            f"{described} {path} is neither a #! script nor an ELF executable, so {cannot}; "
            f"{PROGRAM_FIX[described]}",
            subject=path,
        )
    if not executable:
        raise LaunchError(
            EXIT_NOT_EXECUTABLE,
            f"{described} {path} is not executable; fix it with: chmod +x {path}",
            subject=path,
        )


# What to name instead of a file that is no program, by what the messages call the target.
PROGRAM_FIX = {
    "vLLM executable": "give --vllm the vllm script of the environment vLLM is installed "
    "in, e.g. /venv/bin/vllm",
    "program": "name a program, e.g. vllm-cpu-launch exec -- /venv/bin/python script.py",
}


def is_program(path: str) -> bool:
    """Whether the file starts as the kernel runs it: `#!` or ELF's magic number. One that
    cannot be read is given the benefit of the doubt."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(4)
    except OSError:
        return True
    return head.startswith(b"#!") or head == b"\x7fELF"


def check_interpreter(executable: str, wrapper: Wrapper, environ: Mapping[str, str]) -> None:
    """Fail as the kernel or the wrapper would, but say why: the interpreter is gone
    (a moved or deleted environment), not executable, or not on PATH."""
    if wrapper.detail and wrapper.interpreter is None and wrapper.form in ("env", "sh-trampoline"):
        raise LaunchError(
            EXIT_NOT_FOUND,
            f"{executable} runs {wrapper.detail!r} from PATH, but "
            f"{describe_path(environ.get('PATH'))} has none; put its environment's bin/ "
            "first on PATH, or choose another vLLM with --vllm",
            subject=executable,
        )
    interpreter = wrapper.interpreter
    if interpreter is None:
        return
    if not os.path.lexists(interpreter):
        located, _ = location_environment(executable)
        moved = (
            f"its environment {located} was moved or its Python removed after install "
            "(a venv cannot be moved): recreate the environment where it now lives"
            if located
            else "reinstall it in a working environment"
        )
        raise LaunchError(
            EXIT_NOT_EXECUTABLE,
            f"{executable} runs the interpreter {interpreter}, which does not exist: "
            f"{moved}, or choose another vLLM with --vllm",
            subject=executable,
        )
    if not (os.path.isfile(interpreter) and os.access(interpreter, os.X_OK)):
        raise LaunchError(  # execve would only say "Exec format error" about the script
            EXIT_NOT_EXECUTABLE,
            f"{executable} runs the interpreter {interpreter}, which is not an executable file",
            subject=executable,
        )


def describe_target(executable: str, found_via: str, environ: Mapping[str, str]) -> Target:
    """Check that the executable can run and decide the environment it runs in."""
    check_executable(executable, described(found_via))
    wrapper = read_wrapper(executable, environ.get("PATH"))
    check_interpreter(executable, wrapper, environ)
    python, prefix, user_base, evidence, disagreement = decide_environment(
        executable, wrapper, environ
    )
    return Target(
        executable,
        found_via,
        python,
        prefix,
        user_base,
        evidence,
        disagreement,
        runner=wrapper.interpreter,
    )


def locate(name: str, found_via: str, environ: Mapping[str, str], not_found: str) -> Target:
    """`name` as a path, else the first executable `name` on PATH; 127/126 as a shell."""
    path_variable = environ.get("PATH")
    if os.sep in name:
        return describe_target(os.path.abspath(name), found_via, environ)
    found = executable_on_path(name, path_variable)
    if found is None:
        check_path_files(name, path_variable, described(found_via))
        raise LaunchError(EXIT_NOT_FOUND, not_found)
    return describe_target(found, found_via, environ)


def resolve_vllm(
    requested: str | None, environ: Mapping[str, str], launcher_executable: str
) -> Target:
    """`--vllm`, else `vllm` beside the launcher's interpreter, else `vllm` on PATH."""
    path_variable = environ.get("PATH")
    searched = describe_path(path_variable)
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
