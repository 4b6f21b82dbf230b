"""What every module says and makes: records, closed sets, the user-facing error and its
exit codes, and the one-line messages on stderr (with journald priorities under systemd).

`record` is the one way the package makes a value that flows between modules: a frozen
class of its annotated fields, with keyword or positional construction, equality, hashing
and a readable repr, as `dataclass(frozen=True)` makes, without its cost at start-up.
A closed set of words (a mode, an origin, a verdict) is a `StrEnum`: its members are the
words the user sees, in text and JSON alike.
"""

from __future__ import annotations

import enum
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any, Literal, TypeVar

    from typing_extensions import dataclass_transform

    _T = TypeVar("_T")
else:

    def dataclass_transform(**_kwargs):
        return lambda decorator: decorator


# Records


# Not dataclasses: importing it (with inspect) and the six functions it compiles for each
# class took 23 ms of a 49 ms launch (issue 35, Python 3.11); the exec path makes 30 records.
NOT_A_PARAMETER: Any = object()


def field(*, init: Literal[False]) -> Any:
    """A field that the record's `__post_init__` sets, not a parameter of its constructor."""
    return NOT_A_PARAMETER


class FrozenRecordError(AttributeError):
    """Assigning to a record's field: records are values."""


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def record(cls: type[_T]) -> type[_T]:
    """Make `cls` a frozen record of its annotated fields (its bases' first)."""
    names = [
        name for base in reversed(cls.__mro__) for name in vars(base).get("__annotations__", {})
    ]
    fields = tuple(dict.fromkeys(names))
    defaults = {name: getattr(cls, name) for name in fields if hasattr(cls, name)}
    parameters = tuple(name for name in fields if defaults.get(name) is not NOT_A_PARAMETER)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(parameters):
            raise TypeError(f"{cls.__name__}() takes {len(parameters)} positional arguments")
        values = {**defaults, **dict(zip(parameters, args, strict=False))}
        for name, value in kwargs.items():
            if name not in parameters or parameters.index(name) < len(args):
                raise TypeError(f"{cls.__name__}() got an unexpected argument {name!r}")
            values[name] = value
        missing = [name for name in parameters if name not in values]
        if missing:
            raise TypeError(f"{cls.__name__}() missing arguments: {', '.join(missing)}")
        self.__dict__.update(values)
        if hasattr(self, "__post_init__"):
            self.__post_init__()

    def values(self: Any) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in fields)

    def __eq__(self: Any, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return bool(values(self) == values(other))

    def __repr__(self: Any) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in fields)
        return f"{cls.__qualname__}({shown})"

    def frozen(self: Any, name: str, *_value: Any) -> None:
        raise FrozenRecordError(f"cannot assign to field {name!r}")

    def __hash__(self: Any) -> int:
        return hash(values(self))

    made: dict[str, object] = {
        "__init__": __init__,
        "__eq__": __eq__,
        "__hash__": __hash__,
        "__repr__": __repr__,
    }
    made.update(__setattr__=frozen, __delattr__=frozen, __match_args__=parameters)
    for name, value in made.items():
        if vars(cls).get(name) is None:  # what the class defines itself stays
            setattr(cls, name, value)
    return cls


def replace(item: _T, /, **changes: Any) -> _T:
    """A copy of the record `item` with `changes` to its fields."""
    parameters: tuple[str, ...] = type(item).__match_args__  # type: ignore[attr-defined]
    kept = {name: getattr(item, name) for name in parameters}
    return type(item)(**{**kept, **changes})


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
