"""The launcher's settings (vllm_cpu_launch/settings.py) from its config files: each broken
file, from each place it is read, gives exit 2 and one clear error line naming the file
and the key, no traceback (the config files section of tests/test_hardening_environment.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .conftest import AS_NOBODY
from .hardening import (
    LAUNCHER,
    base_environ,
    fake_vllm,
    public_directory,
    run,
    single_error,
    text,
)

PROBLEMS = {
    # problem: (content or a marker, what the message must say, the key it must name)
    "invalid-yaml": (b"iomp: [auto\nstrict: yes\n", "invalid YAML", None),
    "wrong-type": (b"iomp: 5\n", "is not one of auto, always, never", "iomp"),
    "wrong-type-list": (b"kmp-blocktime: [5]\n", "is not a KMP_BLOCKTIME", "kmp-blocktime"),
    "unknown-key": (b"iomp_mode: auto\n", "unknown key", "iomp_mode"),
    "not-a-mapping": (b"- iomp\n- always\n", "must be a mapping", None),
    "not-utf8": (b"iomp: \xff\xfeauto\n", "not UTF-8", None),
    "directory": (b"<directory>", "is a directory", None),
    "unreadable": (b"<unreadable>", "Permission denied", None),
    "missing": (b"<missing>", "not found", None),
}
SOURCES = ("--launcher-config", "VLLMCPULAUNCH_CONFIG", "XDG_CONFIG_HOME", "HOME/.config")


def place_config(path: Path, content: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if content == b"<directory>":
        path.mkdir()
    elif content == b"<unreadable>":
        path.write_text("iomp: always\n")
        path.chmod(0o000 if os.geteuid() != 0 else 0o600)  # root reads anything: see below
    elif content != b"<missing>":
        path.write_bytes(content)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_bad_config_file_exits_2_naming_file_and_key(
    source: str, problem: str, request: pytest.FixtureRequest
) -> None:
    content, message, key = PROBLEMS[problem]
    as_nobody = problem == "unreadable" and os.geteuid() == 0
    # Root reads everything: an unreadable file needs another user.
    launcher = request.getfixturevalue("nobody_launcher") if as_nobody else LAUNCHER
    with public_directory() as root:  # uid 65534 must reach it in the "unreadable" case
        vllm = fake_vllm(root / "env")
        (root / "env" / "bin" / "python").unlink()
        (root / "env" / "bin" / "python").symlink_to("/bin/sh")  # uid 65534 can stat it
        record = root / "record.json"
        environ = base_environ(root / "home", HARDENING_RECORD=str(record))
        args = ["--vllm", str(vllm), "--dry-run", "serve", "m"]
        if source == "--launcher-config":
            path = root / "launcher.yaml"
            args = ["--launcher-config", str(path), *args]
        elif source == "VLLMCPULAUNCH_CONFIG":
            path = root / "from-variable.yaml"
            environ["VLLMCPULAUNCH_CONFIG"] = str(path)
        elif source == "XDG_CONFIG_HOME":
            path = root / "xdg" / "vllm-cpu-launch" / "config.yaml"
            environ["XDG_CONFIG_HOME"] = str(root / "xdg")
        else:
            path = root / "home" / ".config" / "vllm-cpu-launch" / "config.yaml"
            del environ["XDG_CONFIG_HOME"]
        place_config(path, content)
        result = run(args, environ, launcher, prefix=AS_NOBODY if as_nobody else ())
        if problem == "missing" and source in ("XDG_CONFIG_HOME", "HOME/.config"):
            # The user file is optional: without it the launcher plans as usual.
            assert result.returncode == 0, text(result.stderr)
            assert "Traceback" not in text(result.stderr)
            assert text(result.stdout).startswith("command:")
            return
        line = single_error(result, 2)
        assert str(path) in line
        assert message in line
        if key is not None:
            assert f"key {key!r}" in line
        if problem == "unknown-key":
            assert "allowed keys: iomp, iomp-path" in line


def alias_bomb(levels: int) -> str:
    """A YAML list whose each level is nine aliases of the one before: about 300 bytes that
    expand to 9**levels items (8 levels: 43 million, 3.4 GB as one repr)."""
    parts = ["&l0 [x, x, x, x, x, x, x, x, x]"]
    parts += [f"&l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, levels)]
    return f"[{', '.join(parts)}]"


BOMBED = {
    key: f"{key}: {{bomb}}\n"
    for key in ("iomp", "tcmalloc", "kmp-blocktime", "strict", "plugin", "vllm")
}
RECORD = "when: '2026-01-01', iomp: always, result: r, rounds: 1, command: serve m"
BOMBED["tuned"] = f"tuned: [{{{{{RECORD}, scope: {{bomb}}}}}}]\n"
BOMBED["tuned-concurrency"] = f"tuned: {{{{{RECORD}, concurrency: {{{{1: {{bomb}}}}}}}}}}\n"


@pytest.mark.parametrize("levels", [5, 8])
@pytest.mark.parametrize("key", list(BOMBED))
def test_a_yaml_alias_is_refused_in_one_short_line(key: str, levels: int) -> None:
    """A config holding an alias bomb hung the launcher (8 levels: 3.4 GB, 38 s) or made
    an error line of 481,706 characters (5 levels), whichever key held it (issue 45). A
    config needs no aliases: the first one is refused, naming the file, line and column."""
    with public_directory() as root:
        config = root / "launcher.yaml"
        content = "# an alias bomb\n" + BOMBED[key].format(bomb=alias_bomb(levels))
        config.write_text(content)
        column = content.splitlines()[1].index("*l0") + 1
        args = ["--launcher-config", str(config), "--vllm", str(fake_vllm(root / "env"))]
        result = run([*args, "--dry-run", "serve", "m"], base_environ(root / "home"))
        line = single_error(result, 2)
        assert line == (
            f"vllm-cpu-launch: error: {config}:2:{column}: holds a YAML alias (of anchor 'l0'); "
            "write each value out: a config file takes none"
        )


@pytest.mark.parametrize(
    ("content", "quoted"),
    [
        ("iomp: " + "a" * 500_000, "key 'iomp': 'aaaa"),
        ("tuned: [[" + "1, " * 100_000 + "1]]", "must be a mapping of when"),
        (f"? {'k' * 500_000}\n: 1", "unknown key 'kkkk"),
    ],
    ids=["long-scalar", "long-list", "long-key"],
)
def test_an_error_quotes_a_value_cut_short(content: str, quoted: str) -> None:
    """A value an error line quotes is cut to 80 characters, not the whole file's."""
    with public_directory() as root:
        config = root / "launcher.yaml"
        config.write_text(content + "\n")
        args = ["--launcher-config", str(config), "--vllm", str(fake_vllm(root / "env"))]
        result = run([*args, "--dry-run", "serve", "m"], base_environ(root / "home"))
        line = single_error(result, 2)
        assert str(config) in line and quoted in line and "..." in line
        assert len(line) < 400 + 2 * len(str(config))
