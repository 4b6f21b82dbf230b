"""systemd's unit-file syntax, for the unit systemd-unit writes and `env --format systemd`.

Escaping follows systemd.service(5) "Command lines" and systemd.syntax(7): a word is
double-quoted when it holds anything but plain characters, with C-style escapes inside
(`\\\\`, `\\"`, `\\n`, `\\xNN`); `%` becomes `%%` (specifiers) and, in ExecStart's
arguments (systemd substitutes variables there, not in the executable), `$` becomes `$$`.
`EnvironmentFile=` values (used by `env --format systemd`) follow systemd.exec(5): double
quotes, with `\\` before `"`, `\\`, `` ` `` and `$`; everything else, newlines included, is
literal there.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError

if TYPE_CHECKING:
    from collections.abc import Sequence

# Characters that need no quoting in a unit file's command line word (after `%` and `$`
# are doubled): nothing that splits, quotes, escapes, or starts a comment or separator.
PLAIN = frozenset(string.ascii_letters + string.digits + "_@%+=:,./-$")
C_ESCAPES = {
    "\\": "\\\\",
    '"': '\\"',
    "\n": "\\n",
    "\t": "\\t",
    "\r": "\\r",
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\v": "\\v",
}


def c_escape(text: str) -> str:
    """C-style escapes as systemd's unescaper reads them; raw bytes (surrogates) as \\xNN."""
    out = []
    for char in text:
        code = ord(char)
        if char in C_ESCAPES:
            out.append(C_ESCAPES[char])
        elif 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
            out.append(f"\\x{code - 0xDC00:02x}")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        else:
            out.append(char)
    return "".join(out)


def quote_word(text: str) -> str:
    """One word as systemd's word splitter reads it back (quotes only when needed)."""
    if text and all(char in PLAIN for char in text):
        return text
    return f'"{c_escape(text)}"'


def exec_word(argument: str) -> str:
    """One ExecStart= argument: specifiers and variable substitution disarmed, quoted."""
    return quote_word(argument.replace("%", "%%").replace("$", "$$"))


# What systemd's string_is_safe() refuses in ExecStart's executable (src/basic/string-util.c,
# called from config_parse_exec): quotes, backslashes, control characters.
UNSAFE_IN_EXECUTABLE = frozenset("\"'\\\x7f" + "".join(map(chr, range(1, 0x20))))


def exec_program(path: str) -> str:
    """ExecStart's executable: specifiers disarmed, `$` left alone (systemd substitutes
    variables only in the arguments: a doubled `$` would stay doubled in the path)."""
    if any(char in UNSAFE_IN_EXECUTABLE for char in path):
        raise LaunchError(
            EXIT_USAGE,
            f"systemd refuses to start an executable whose path holds a quote, a backslash "
            f"or a control character ({printable(path)}): install vllm-cpu-launch where its "
            "path has none of them",
        )
    return quote_word(path.replace("%", "%%"))


def exec_line(argv: Sequence[str]) -> str:
    """The value of ExecStart= that systemd turns back into exactly `argv`."""
    program, *arguments = argv
    return " ".join([exec_program(program), *(exec_word(argument) for argument in arguments)])


def environment_word(name: str, value: str) -> str:
    """One Environment= assignment (`$` has no meaning there; `%` is a specifier)."""
    return quote_word(f"{name}={value}".replace("%", "%%"))


def environment_file_line(name: str, value: str) -> str:
    """`NAME="value"` for an EnvironmentFile= (systemd.exec(5), double-quoted form)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise LaunchError(
            EXIT_USAGE, f"{name}'s value is not UTF-8 text, which an EnvironmentFile must be"
        ) from None
    escaped = "".join("\\" + char if char in '"\\`$' else char for char in value)
    return f'{name}="{escaped}"'


def printable(text: str) -> str:
    """`text` on one line, every line break or other unprintable character as `?`."""
    return "".join(char if char.isprintable() else "?" for char in text)


def plain_text(text: str) -> str:
    """Free text for a unit setting such as Description=: one line, no specifiers."""
    return printable(text).replace("%", "%%").rstrip("\\")


UID_MAX = 2**32 - 1


def numeric_id(name: str) -> bool:
    """A uid/gid as systemd's parse_uid takes it: decimal, no sign, no leading zero, and
    neither (uid_t) -1 nor the 16-bit -1 (65535)."""
    plain = name.isascii() and name.isdigit() and (name == "0" or not name.startswith("0"))
    return plain and int(name) < UID_MAX and int(name) != 0xFFFF


def user_group_problem(name: str) -> str | None:
    """Why systemd refuses `name` in User= or Group=, or None: valid_user_group_name() of
    systemd's src/basic/user-util.c, as unit files are read (relaxed, numeric ids allowed)."""
    if not name:
        return "it is empty"
    if numeric_id(name):
        return None
    if name != name.strip(" "):
        return "it starts or ends with a space"
    if any(ord(char) < 0x20 or ord(char) == 0x7F or 0xDC80 <= ord(char) <= 0xDCFF for char in name):
        return "it holds a control character or a byte that is not UTF-8"
    if ":" in name or "/" in name:
        return "it holds ':' or '/'"
    digits = name.removeprefix("-")
    if digits == "" or (digits.isascii() and digits.isdigit()):
        return "it is all digits but no valid uid (0 to 4294967294, not 65535, no leading zero)"
    if name in (".", ".."):
        return "it is '.' or '..'"
    return None


def setting_value(text: str) -> str:
    """A User=/Group= value: written as is (systemd takes it whole, quotes and all), only
    `%` doubled, since specifiers are expanded there."""
    return text.replace("%", "%%")
