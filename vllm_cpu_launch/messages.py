"""What the launcher says: one-line messages on stderr (with journald priorities under
systemd), a value quoted short, a typo's likely word, and the closed sets of words it shows."""

from __future__ import annotations

import enum
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence


class StrEnum(str, enum.Enum):
    """A closed set of words (a mode, an origin, a verdict), each member its word wherever it
    is shown (`f"{member}"`, `str()`, json.dumps): Python 3.11's enum.StrEnum, not in 3.10."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


PREFIX = "vllm-cpu-launch: "
# sd-daemon(3) priority prefixes, which journald turns into log levels.
PRIORITY = {"error": "<3>", "warning": "<4>", "info": "<6>", "debug": "<7>"}


def stderr_is_journal(journal_stream: str | None) -> bool:
    """True when stderr is the journal stream systemd announced in JOURNAL_STREAM."""
    device, _, inode = (journal_stream or "").partition(":")
    try:
        status = os.fstat(2)
        return (status.st_dev, status.st_ino) == (int(device), int(inode))
    except (OSError, ValueError):
        return False


def visible(char: str) -> str:
    code = ord(char)
    return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else ascii(char)[1:-1]


def emit(level: str, text: str) -> None:
    """One message on stderr, one line whatever `text` holds; a closed stderr is no error."""
    priority = PRIORITY[level] if stderr_is_journal(os.environ.get("JOURNAL_STREAM")) else ""
    label = "" if level == "info" else f"{level}: "
    shown = "".join(char if char.isprintable() else visible(char) for char in text)
    try:
        sys.stderr.write(f"{priority}{PREFIX}{label}{shown}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass


def shown(value: object, width: int = 80) -> str:
    """repr(value), cut to about `width` characters: an error line quotes a value, never a
    whole file (reprlib stops at a few items and levels, before the whole repr is made)."""
    import reprlib  # lazy: only for an error

    limits = reprlib.Repr()
    limits.maxstring = limits.maxother = limits.maxlong = width
    text = limits.repr(value)
    return text if len(text) <= width else f"{text[: width - 3]}..."


def did_you_mean(word: str, known: Sequence[str], cutoff: float = 0.6) -> str | None:
    """The one of `known` that `word` is most likely a typo of, or None (difflib's ratio)."""
    from difflib import get_close_matches  # lazy: only for a typo

    close = get_close_matches(word, known, n=1, cutoff=cutoff)
    return close[0] if close else None
