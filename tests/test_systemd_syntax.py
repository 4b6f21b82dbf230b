"""vllm_cpu_launch/systemd_syntax.py: each function's text read back as systemd reads it.

By the real systemd where this host has it: `systemd --test` (the unit loaded in test mode,
its settings dumped), `systemd-analyze verify`, and the environment.d generator for
EnvironmentFile= lines; by faithful parsers of systemd.service(5) and systemd.exec(5)
(tests/test_systemd_unit.py, tests/test_env.py) for generated inputs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_env import GENERATOR, parse_environment_file, systemd_reads
from tests.test_systemd_unit import (
    TRICKY_ARGUMENTS,
    substitute_dollars,
    systemd_dump,
    systemd_parsed_argv,
    systemd_words,
    verify_unit,
)
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.systemd_syntax import (
    environment_file_line,
    environment_word,
    exec_line,
    plain_text,
    printable,
    quote_word,
    user_group_problem,
)


def loaded(unit_dir: Path, text: str) -> str:
    """systemd's dump of a unit holding `text` (test mode, no manager)."""
    unit = unit_dir / "syntax.service"
    unit.write_text(text, encoding="utf-8")
    return systemd_dump(unit)


# ---------------------------------------------------------------- ExecStart=


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(st.characters(exclude_categories=["Cs"]), max_size=12), max_size=6))
def test_exec_line_round_trips_for_any_text(arguments: list[str]) -> None:
    arguments = [a.replace("\0", "") for a in arguments]
    line = exec_line(["/usr/bin/x", *arguments])
    assert "\n" not in line
    assert systemd_words(line) == ["/usr/bin/x", *arguments]


@pytest.mark.parametrize("program", ["/opt/50% off/x y", "/opt/%n%%/é 日本/vllm", "/opt/a;b/x"])
def test_exec_line_is_the_argv_real_systemd_parses(unit_dir: Path, program: str) -> None:
    """The executable keeps its `%` and spaces (specifiers doubled, the word quoted), each
    argument comes back whole; `$` in arguments is doubled for the substitution at exec."""
    unit = unit_dir / "exec.service"
    unit.write_text(f"[Service]\nExecStart={exec_line([program, *TRICKY_ARGUMENTS])}\n")
    parsed = systemd_parsed_argv(unit)
    assert parsed[0] == os.fsencode(program)
    assert [substitute_dollars(word) for word in parsed[1:]] == list(
        map(os.fsencode, TRICKY_ARGUMENTS)
    )


@pytest.mark.parametrize("char", ['"', "'", "\\", "\x7f", "\x01", "\t", "\n"])
def test_exec_line_refuses_an_executable_systemd_refuses(unit_dir: Path, char: str) -> None:
    """systemd refuses these characters in the executable however quoted ("Executable name
    contains special characters"): exec_line says so in one line instead of a unit."""
    program = f"/opt/a{char}b/vllm-cpu-launch"
    unit = unit_dir / "refused.service"
    unit.write_text(f"[Service]\nExecStart={quote_word(program)} x\n")
    assert "special characters" in verify_unit(unit).stderr
    with pytest.raises(LaunchError) as raised:
        exec_line([program, "serve", "m"])
    assert raised.value.code == EXIT_USAGE
    assert "\n" not in raised.value.message and printable(program) in raised.value.message
    assert "install vllm-cpu-launch where its path has none of them" in raised.value.message


@pytest.mark.parametrize("char", [" ", "%", "$", ";", "é", "#"])
def test_exec_line_takes_an_executable_systemd_takes(unit_dir: Path, char: str) -> None:
    program = f"/opt/a{char}b/vllm-cpu-launch"
    unit = unit_dir / "taken.service"
    unit.write_text(f"[Service]\nExecStart={exec_line([program, 'x'])}\n")
    assert "special characters" not in verify_unit(unit).stderr
    assert systemd_parsed_argv(unit) == [os.fsencode(program), b"x"]


# ---------------------------------------------------------------- Environment=


def test_environment_assignment_keeps_dollars_and_doubles_percent(tmp_path: Path) -> None:
    assert environment_word("A", "x y $Z 5%") == '"A=x y $Z 5%%"'
    assert environment_word("A", "plain") == "A=plain"


def test_environment_words_are_the_values_real_systemd_sets(unit_dir: Path) -> None:
    values = ["plain", "x y $Z 5%", "%n%%", 'say "hi"', "back\\slash", "trailing\\", "é 日本"]
    values += ["new\nline", "#not-a-comment", ";", ""]
    words = " ".join(environment_word(f"V{index}", value) for index, value in enumerate(values))
    dump = loaded(unit_dir, f"[Service]\nExecStart=/bin/true\nEnvironment={words}\n")
    for index, value in enumerate(values):
        assert f"\t\tEnvironment: V{index}={value}\n" in dump, (index, value)


# ---------------------------------------------------------------- EnvironmentFile=

TRICKY_VALUES = [
    "/opt/a b/libiomp5.so",
    'quote " double',
    "quote ' single",
    "back\\slash and \\\\ two",
    "trailing\\",
    "back`tick",
    "dollar $ alone and $% and $",
    "50% #not-a-comment ;x",
    "  leading and trailing  ",
    "é ü 日本",
]  # not "": the generator drops empty variables (EnvironmentFile= keeps them)


def test_environment_file_lines_read_back_by_systemd(tmp_path: Path) -> None:
    if not os.path.exists(GENERATOR):
        pytest.fail(f"{GENERATOR} missing: scripts/test installs systemd")
    lines = [environment_file_line(f"V{i}", v) for i, v in enumerate(TRICKY_VALUES)]
    parsed = systemd_reads(lines, tmp_path)
    for index, value in enumerate(TRICKY_VALUES):
        assert parsed.get(f"V{index}") == value, (lines[index], parsed.get(f"V{index}"))


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\0"), max_size=30))
def test_environment_file_line_round_trips_for_any_text(value: str) -> None:
    line = environment_file_line("NAME", value)
    assert parse_environment_file(line + "\n") == {"NAME": value}


def test_an_environment_file_value_of_raw_bytes_is_refused_by_name() -> None:
    """A value os.environ holds as surrogateescape (bytes not UTF-8) fits no text file."""
    raw = os.fsdecode(b"/opt/caf\xe9/libiomp5.so")
    with pytest.raises(LaunchError) as raised:
        environment_file_line("LD_PRELOAD", raw)
    assert raised.value.code == EXIT_USAGE
    assert raised.value.message == "LD_PRELOAD's value is not UTF-8 text"


# ---------------------------------------------------------------- Description=


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("vLLM 50% of %n", "vLLM 50% of %n"),
        ("two\nlines\tand a tab", "two?lines?and a tab"),
        ("ends in a backslash\\\\", "ends in a backslash"),
    ],
)
def test_plain_text_is_the_description_real_systemd_shows(
    unit_dir: Path, text: str, shown: str
) -> None:
    """One line, specifiers disarmed, and no trailing backslash: systemd would join the
    next line (`[Service]`) to the description and lose the section."""
    unit = f"[Unit]\nDescription={plain_text(text)}\n[Service]\nExecStart=/bin/true\n"
    dump = loaded(unit_dir, unit)
    assert f"\t\tDescription: {shown}\n" in dump
    assert "-> ExecStart:" in dump  # the [Service] section was read too


# ---------------------------------------------------------------- User= and Group=

# Names around each of systemd's rules (valid_user_group_name, relaxed, as unit files are
# read): ':' and '/', numeric ids and their bounds, '.' and '..', and names it takes.
NAMES = [
    "vllm",
    "john.doe",
    "bad user",
    "Ünï",
    "-",
    "_x",
    "0",
    "1000",
    "65534",
    "4294967294",
    "bad:user",
    "a/b",
    "0100",
    "00",
    "65535",
    "4294967295",
    "99999999999",
    "-1",
    ".",
    "..",
]


@pytest.mark.parametrize("name", NAMES)
def test_user_group_problem_agrees_with_systemd(unit_dir: Path, name: str) -> None:
    unit = unit_dir / "named.service"
    unit.write_text(f"[Service]\nExecStart=/bin/true\nUser={name}\nGroup={name}\n")
    refused = "Invalid user/group name" in verify_unit(unit).stderr
    problem = user_group_problem(name)
    assert (problem is not None) == refused, (name, problem)
    if problem is None:
        dump = systemd_dump(unit)
        assert f"\t\tUser: {name}\n" in dump and f"\t\tGroup: {name}\n" in dump


def test_user_group_problem_names_the_rule() -> None:
    assert user_group_problem("") == "it is empty"
    assert user_group_problem(" vllm") == "it starts or ends with a space"
    unprintable = "it holds a control character or a byte that is not UTF-8"
    assert user_group_problem("a\x01b") == unprintable
    assert user_group_problem(os.fsdecode(b"caf\xe9")) == unprintable
    assert user_group_problem("a:b") == "it holds ':' or '/'"
    assert "no valid uid" in str(user_group_problem("65535"))
    assert user_group_problem("..") == "it is '.' or '..'"
