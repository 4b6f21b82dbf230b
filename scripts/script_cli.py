"""What every script here does the same way as a command-line program.

Progress goes to stderr as `NAME: MESSAGE` lines (stdout is kept for the result). What can
go wrong outside the script's control (a set-up step fails, a server does not start) is a
ScriptError; main() runs the work through exit_code(), which turns one into a single line
`NAME: error: MESSAGE` and exit code 1, and an interrupt (Ctrl-C, or a SIGTERM the script
turned into KeyboardInterrupt) into one line and exit code 130. Anything else is a bug and
keeps its traceback. Standard library only; scripts import it as a sibling module.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any


class ScriptError(Exception):
    """An expected failure: printed as one line, exit code 1."""


def narrator(program: str) -> Callable[[str], None]:
    """say(message): a progress line `PROGRAM: MESSAGE` on stderr, shown at once."""

    def say(message: str) -> None:
        print(f"{program}: {message}", file=sys.stderr, flush=True)

    return say


def exit_code(program: str, work: Callable[[], object], interrupted: str = "interrupted") -> int:
    """Run work(); 0, or 1 after `PROGRAM: error: ...` for a ScriptError, or 130 after
    `PROGRAM: INTERRUPTED` for a KeyboardInterrupt."""
    try:
        work()
    except ScriptError as error:
        print(f"{program}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{program}: {interrupted}", file=sys.stderr)
        return 130
    return 0


def bounded_run(
    command: Sequence[str], what: str, limit_s: float, **options: Any
) -> subprocess.CompletedProcess[Any]:
    """subprocess.run(command, **options) with stdin closed, whatever its exit code; a
    ScriptError naming `what` when it cannot run or does not finish within limit_s."""
    try:
        return subprocess.run(
            list(command), stdin=subprocess.DEVNULL, timeout=limit_s, check=False, **options
        )
    except subprocess.TimeoutExpired:
        raise ScriptError(f"{what}: no result within {limit_s:.0f} s") from None
    except OSError as error:
        raise ScriptError(f"{what} failed: {error}") from None


def checked_output(command: Sequence[str], what: str, limit_s: float, **options: Any) -> str:
    """bounded_run() of a set-up step, output captured as text; its stdout. A ScriptError
    also when it fails, with the last line of its stderr (else of its stdout)."""
    completed = bounded_run(command, what, limit_s, capture_output=True, text=True, **options)
    if completed.returncode != 0:
        lines = (completed.stderr or completed.stdout).strip().splitlines() or ["no output"]
        raise ScriptError(f"{what} failed (exit {completed.returncode}): {lines[-1]}")
    return str(completed.stdout)


def last_line(command: Sequence[str], what: str, limit_s: float, **options: Any) -> str:
    """The last line checked_output() printed: the result of a helper script."""
    lines = checked_output(command, what, limit_s, **options).strip().splitlines()
    if not lines:
        raise ScriptError(f"{what} printed nothing")
    return lines[-1]
