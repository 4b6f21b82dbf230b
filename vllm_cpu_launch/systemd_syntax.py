"""systemd's unit-file syntax, for the unit systemd-unit writes and `env --format systemd`.

Command lines follow systemd.service(5) "Command lines" and systemd.syntax(7) (C-style
escapes in double quotes, `%` doubled as specifiers are expanded); `EnvironmentFile=` values
follow systemd.exec(5): only `"`, `\\`, `` ` `` and `$` escaped, newlines kept literal.
"""

from __future__ import annotations

import re
import string
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError

if TYPE_CHECKING:
    from collections.abc import Sequence

# Characters that need no quoting in a unit file's command line word (after `%` and `$`
# are doubled): nothing that splits, quotes, escapes, or starts a comment or separator.
PLAIN = frozenset(string.ascii_letters + string.digits + "_@%+=:,./-$")
# C-style escapes as systemd's unescaper reads them: its named ones, and \xNN for any other
# control character and for a raw byte that was not UTF-8 (surrogateescape).
NAMED_ESCAPES = dict(zip('\\"\n\t\r\a\b\f\v', '\\"ntrabfv', strict=True))
C_ESCAPES = {code: f"\\x{code:02x}" for code in [*range(0x20), 0x7F]}
C_ESCAPES |= {0xDC00 + byte: f"\\x{byte:02x}" for byte in range(0x80, 0x100)}
C_ESCAPES |= {ord(char): f"\\{letter}" for char, letter in NAMED_ESCAPES.items()}
# What systemd's string_is_safe() refuses in ExecStart's executable (src/basic/string-util.c,
# called from config_parse_exec): quotes, backslashes, control characters.
UNSAFE_IN_EXECUTABLE = frozenset("\"'\\\x7f" + "".join(map(chr, range(1, 0x20))))
UID_MAX = 2**32 - 1


def quote_word(text: str) -> str:
    """One word as systemd's word splitter reads it back (quotes only when needed)."""
    if text and all(char in PLAIN for char in text):
        return text
    return f'"{text.translate(C_ESCAPES)}"'


def exec_line(argv: Sequence[str]) -> str:
    """The value of ExecStart= that systemd turns back into exactly `argv`: specifiers
    disarmed everywhere, variables only in the arguments (the path takes `$` literally)."""
    program, *arguments = argv
    if any(char in UNSAFE_IN_EXECUTABLE for char in program):
        raise LaunchError(
            EXIT_USAGE,
            "systemd refuses to start an executable whose path holds a quote, a backslash or a "
            f"control character ({printable(program)}): install vllm-cpu-launch where its path "
            "has none of them",
        )
    words = [quote_word(word.replace("%", "%%").replace("$", "$$")) for word in arguments]
    return " ".join([quote_word(program.replace("%", "%%")), *words])


def environment_word(name: str, value: str) -> str:
    """One Environment= assignment (`$` has no meaning there; `%` is a specifier)."""
    return quote_word(f"{name}={value}".replace("%", "%%"))


def check_utf8(name: str, value: str) -> None:
    """Refuse a value holding raw bytes (surrogateescape), which no text file can hold."""
    if any("\ud800" <= char <= "\udfff" for char in value):
        raise LaunchError(EXIT_USAGE, f"{name}'s value is not UTF-8 text")


def environment_file_line(name: str, value: str) -> str:
    """`NAME="value"` for an EnvironmentFile= (systemd.exec(5), double-quoted form)."""
    check_utf8(name, value)
    escaped = "".join("\\" + char if char in '"\\`$' else char for char in value)
    return f'{name}="{escaped}"'


def printable(text: str) -> str:
    """`text` on one line, every line break or other unprintable character as `?`."""
    return "".join(char if char.isprintable() else "?" for char in text)


def plain_text(text: str) -> str:
    """Free text for a unit setting such as Description=: one line, no specifiers."""
    return printable(text).replace("%", "%%").rstrip("\\")


def user_group_problem(name: str) -> str | None:
    """Why systemd refuses `name` in User= or Group=, or None: valid_user_group_name() of
    systemd's src/basic/user-util.c, as unit files are read (relaxed, numeric ids allowed)."""
    if not name:
        return "it is empty"
    if name != name.strip(" "):
        return "it starts or ends with a space"
    if any(ord(char) < 0x20 or ord(char) == 0x7F or 0xDC80 <= ord(char) <= 0xDCFF for char in name):
        return "it holds a control character or a byte that is not UTF-8"
    if ":" in name or "/" in name:
        return "it holds ':' or '/'"
    if re.fullmatch(r"-?[0-9]*", name):
        # parse_uid: decimal, no sign, no leading zero, neither (uid_t) -1 nor 16-bit -1
        if re.fullmatch(r"0|[1-9][0-9]*", name) and int(name) < UID_MAX and int(name) != 0xFFFF:
            return None
        return "it is all digits but no valid uid (0 to 4294967294, not 65535, no leading zero)"
    return "it is '.' or '..'" if name in (".", "..") else None
