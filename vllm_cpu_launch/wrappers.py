"""Which interpreter a console script runs: read from the wrapper its installer wrote.

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
from typing import TYPE_CHECKING

from vllm_cpu_launch.records import record

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

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


def search_path(name: str, path_variable: str | None) -> str | None:
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
        return Wrapper("env", search_path(names[0], path_variable), names[0])
    if os.path.basename(interpreter) in SHELLS and len(words) == 1:
        if not second.startswith(TRAMPOLINE):
            return Wrapper("direct", interpreter)  # a shell script proper
        try:
            python, _ = read_word(second, len(TRAMPOLINE), script)
        except (WordError, RecursionError) as error:
            return Wrapper("unknown", None, f"{second.strip()} ({error})")
        if "/" not in python:  # a bare name: the shell looks it up on PATH
            return Wrapper("sh-trampoline", search_path(python, path_variable), python)
        return Wrapper("sh-trampoline", os.path.abspath(python))
    return Wrapper("direct", interpreter)
