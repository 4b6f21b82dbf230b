"""What every module says and makes: records, closed sets, the user-facing error and its
exit codes, and the one-line messages on stderr (with journald priorities under systemd).

`record` is the one way the package makes a value that flows between modules: a frozen
dataclass, with keyword or positional construction, equality, hashing and a readable repr.
A closed set of words (a mode, an origin, a verdict) is a `StrEnum`: its members are the
words the user sees, in text and JSON alike.
"""

from __future__ import annotations

import enum
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import TypeVar

    from typing_extensions import dataclass_transform

    _T = TypeVar("_T")
else:

    def dataclass_transform(**_kwargs):
        return lambda decorator: decorator


# Records


@dataclass_transform(frozen_default=True)
def record(cls: type[_T]) -> type[_T]:
    """Make `cls` a frozen dataclass of its annotated fields."""
    return dataclass(frozen=True)(cls)


class StrEnum(str, enum.Enum):
    """A closed set of words, each member its word wherever it is shown (`f"{member}"`,
    `str()`, json.dumps) and equal to it: Python 3.11's enum.StrEnum, which 3.10 lacks."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


# The user-facing error and its exit codes

# Exit codes of docs/design.md.
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_LIBRARY_MISSING = 3
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127


class LaunchError(Exception):
    """A failure the user can fix: printed as one line, exits with `code`."""

    def __init__(self, code: int, message: str, subject: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.subject = subject  # the file the failure is about, where there is one


# Messages on stderr

PREFIX = "vllm-cpu-launch: "
# sd-daemon(3) priority prefixes, which journald turns into log levels.
PRIORITY = {"error": "<3>", "warning": "<4>", "info": "<6>", "debug": "<7>"}


def stderr_is_journal(journal_stream: str | None) -> bool:
    """True when stderr is the journal stream systemd announced in JOURNAL_STREAM."""
    if not journal_stream:
        return False
    device, _, inode = journal_stream.partition(":")
    try:
        status = os.fstat(2)
        return (status.st_dev, status.st_ino) == (int(device), int(inode))
    except (OSError, ValueError):
        return False


def one_line(text: str) -> str:
    """`text` with each unprintable character (a line break in a path, a byte that is not
    UTF-8) written as its escape, so a message stays one line and says what was given."""
    return "".join(char if char.isprintable() else visible(char) for char in text)


def visible(char: str) -> str:
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    return ascii(char)[1:-1]


def format_message(level: str, text: str, journal: bool) -> str:
    """One line as it is written: priority (under journald), prefix, level word, text."""
    label = "" if level == "info" else f"{level}: "
    priority = PRIORITY[level] if journal else ""
    return f"{priority}{PREFIX}{label}{one_line(text)}"


def emit(level: str, text: str) -> None:
    """Write one message to stderr; a closed stderr is not an error worth dying for."""
    line = format_message(level, text, stderr_is_journal(os.environ.get("JOURNAL_STREAM")))
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass


def did_you_mean(word: str, known: Sequence[str], cutoff: float = 0.6) -> str | None:
    """The one of `known` that `word` is most likely a typo of (difflib's ratio of at least
    `cutoff`), or None: every "did you mean" the launcher says."""
    from difflib import get_close_matches  # lazy: only for a typo

    close = get_close_matches(word, known, n=1, cutoff=cutoff)
    return close[0] if close else None
