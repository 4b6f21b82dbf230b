"""`systemd-unit`: units that systemd itself accepts, and ExecStart that round-trips.

Three checks of the escaping: `systemd-analyze verify` on the generated and shipped
units (it also checks that ExecStart's binary exists); the real systemd parsing the unit
in test mode (`systemd --test`, run unprivileged as systemd demands, prints the argv
it parsed); and a faithful unescaper of systemd.service(5) for generated inputs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.conftest import (
    AS_NOBODY,
    HOST_CPUS_VARIABLE,
    REPO,
    clean_environ,
    install_recorder,
    make_environment,
    outside_tmp,
    run_launcher,
)
from vllm_cpu_launch.systemd_syntax import quote_word

SYSTEMD = "/lib/systemd/systemd"


def unit_environ(tmp_path: Path, **extra: str) -> dict[str, str]:
    """clean_environ without the CPUs' use the tests tell every plan: systemd-unit warns of
    each launcher variable set where the service will not see it, and these tests count its
    lines (no rule is asserted here)."""
    environ = clean_environ(tmp_path, **extra)
    environ.pop(HOST_CPUS_VARIABLE)
    return environ


SHIPPED = REPO / "scripts"
CONSOLE_SCRIPT = Path(sys.executable).parent / "vllm-cpu-launch"
TRICKY_ARGUMENTS = [
    "",
    " ",
    "two words",
    "100%",
    "%n%%",
    "$HOME",
    "${HOME}",
    "$$",
    'say "hi"',
    "it's",
    "back\\slash",
    "trailing\\",
    "new\nline",
    "tab\there",
    ";",
    "\\;",
    "a;b",
    "#not-a-comment",
    "é ü 日本",
    '{"method": "ngram", "num_speculative_tokens": 3}',
    "--speculative-config.method=ngram",
    "\x01control",
]


def need(tool: str) -> str:
    found = shutil.which(tool) or (tool if os.path.exists(tool) else None)
    if found is None:
        pytest.fail(f"{tool} missing: scripts/test installs systemd (apt-get install systemd)")
    return found


def generate(args: Sequence[str], tmp_path: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return run_launcher(["systemd-unit", *args], unit_environ(tmp_path, **extra))


def verify_unit(path: Path, root: Path | None = None) -> subprocess.CompletedProcess[str]:
    command = [need("systemd-analyze"), "verify"]
    if root is not None:
        command.append(f"--root={root}")
    return subprocess.run(
        [*command, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=path.parent,
    )


# ---------------------------------------------------------------- systemd's own parse


def decode_dump_word(text: str, index: int) -> tuple[bytes, int]:
    """One word of systemd's `Command Line:` dump (quote_command_line) -> bytes."""
    simple = {"t": b"\t", "n": b"\n", "r": b"\r", "a": b"\a", "b": b"\b", "f": b"\f", "v": b"\v"}
    if text[index] != '"':
        end = text.find(" ", index)
        end = len(text) if end < 0 else end
        return os.fsencode(text[index:end]), end
    out = bytearray()
    index += 1
    while text[index] != '"':
        char = text[index]
        if char != "\\":
            out += os.fsencode(char)
            index += 1
            continue
        following = text[index + 1]
        if following in simple:
            out += simple[following]
            index += 2
        elif following in "01234567":
            out.append(int(text[index + 1 : index + 4], 8))
            index += 4
        else:  # \\ \" \$ \`
            out += os.fsencode(following)
            index += 2
    return bytes(out), index + 1


def systemd_dump(unit: Path) -> str:
    """The unit as the real systemd loaded it (test mode, no manager): its part of the
    dump, with the settings in effect after systemd's own implications."""
    environ = {"SYSTEMD_UNIT_PATH": f"{unit.parent}:/lib/systemd/system", "LANG": "C.UTF-8"}
    result = subprocess.run(
        [*AS_NOBODY, need(SYSTEMD), "--test", "--system", f"--unit={unit.name}"],
        env=environ,
        capture_output=True,
        timeout=120,
        check=False,
    )
    output = os.fsdecode(result.stdout)
    assert result.returncode == 0, os.fsdecode(result.stderr)
    problems = [
        entry
        for entry in os.fsdecode(result.stderr).splitlines()
        if str(unit) in entry and ("Ignoring" in entry or "rror" in entry)
    ]
    assert not problems, problems
    section = output.split(f"-> Unit {unit.name}:", 1)[1]
    return re.split(r"\n\t?-> (?:Unit |By jobs)", section, maxsplit=1)[0]


def effective(dump: str, setting: str) -> str:
    """A setting's value in systemd's dump of a unit (`\t\tPrivateTmp: yes`)."""
    found = re.search(rf"^\t+{setting}: (.*)$", dump, re.MULTILINE)
    assert found is not None, f"{setting} missing from the dump"
    return found[1]


def systemd_parsed_argv(unit: Path) -> list[bytes]:
    """ExecStart's argv as the real systemd parses the unit (test mode, no manager)."""
    dump = systemd_dump(unit)
    line = dump.split("-> ExecStart:", 1)[1].split("Command Line: ", 1)[1].split("\n", 1)[0]
    words, index = [], 0
    while index < len(line):
        word, index = decode_dump_word(line, index)
        words.append(word)
        index += 1  # the separating space
    return words


def substitute_dollars(word: bytes) -> bytes:
    """What systemd does to ExecStart words at exec time (every `$` was doubled)."""
    return word.replace(b"$$", b"$")


def test_execstart_round_trips_through_real_systemd(tmp_path: Path, unit_dir: Path) -> None:
    arguments = ["serve", "/models/my model", *TRICKY_ARGUMENTS]
    result = generate(
        ["--name", "roundtrip", "--user", "vllm", "--", *arguments], tmp_path, PATH="/usr/bin:/bin"
    )
    assert result.returncode == 0, result.stderr
    unit = unit_dir / "roundtrip.service"
    unit.write_text(result.stdout)
    parsed = [substitute_dollars(w) for w in systemd_parsed_argv(unit)]
    assert parsed == [os.fsencode(w) for w in (str(CONSOLE_SCRIPT), "--", *arguments)], (
        result.stdout
    )


def test_non_utf8_argument_round_trips(tmp_path: Path, unit_dir: Path) -> None:
    raw = b"caf\xe9-\xff"  # Latin-1 bytes: not UTF-8
    command = [sys.executable, "-m", "vllm_cpu_launch", "systemd-unit", "--user", "vllm", "--"]
    result = subprocess.run(
        [*command, "serve", "m", raw],
        env=unit_environ(tmp_path),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert b"\\xe9" in result.stdout  # the unit itself stays UTF-8 text
    result.stdout.decode("utf-8")
    unit = unit_dir / "bytes.service"
    unit.write_bytes(result.stdout)
    assert systemd_parsed_argv(unit)[-1] == raw


# ---------------------------------------------------------------- a faithful unescaper


def exec_time(word: str) -> str:
    """systemd's substitution at exec time: `$$` is `$`, `$NAME`/`${NAME}` a variable."""
    return re.sub(r"\$(\$|\{|[A-Za-z_])", lambda m: "$" if m[1] == "$" else "<VARIABLE>", word)


def systemd_words(line: str) -> list[str]:
    """extract_first_word(EXTRACT_UNQUOTE|EXTRACT_CUNESCAPE) over a whole ExecStart value,
    then specifiers (`%%`) per word, then `$$` at exec time (systemd.service(5))."""
    escapes = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "f": "\f", "v": "\v"}
    words: list[str] = []
    index = 0
    while True:
        while index < len(line) and line[index] in " \t\n":
            index += 1
        if index >= len(line):
            return [exec_time(w.replace("%%", "%")) for w in words]
        word: list[str] = []
        quote: str | None = None
        while index < len(line) and (quote or line[index] not in " \t\n"):
            char = line[index]
            if char == "\\":
                following = line[index + 1]
                if following == "x":
                    code = int(line[index + 2 : index + 4], 16)
                    word.append(chr(code) if code < 0x80 else chr(0xDC00 + code))
                    index += 4
                    continue
                word.append(escapes.get(following, following))
                index += 2
                continue
            if quote is None and char in "\"'":
                quote = char
            elif char == quote:
                quote = None
            else:
                word.append(char)
            index += 1
        words.append(
            "".join(word).encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape")
        )


# ---------------------------------------------------------------- the unit itself


def test_generated_unit_passes_systemd_analyze_verify(tmp_path: Path, vllm_env: Path) -> None:
    result = generate(
        [
            "--name",
            "vllm-qwen",
            "--user",
            "vllm",
            "--group",
            "vllm",
            "--env",
            "VLLM_CPU_KVCACHE_SPACE=4",
            "--env",
            "NOTE=50% of $HOME",
            "--vllm",
            str(vllm_env / "bin" / "vllm"),
            "--kmp-blocktime",
            "10",
            "--strict",
            "--",
            "serve",
            "/models/qwen",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3}',
            "--shutdown-timeout",
            "45",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    unit = tmp_path / "vllm-qwen.service"
    unit.write_text(result.stdout)
    checked = verify_unit(unit)
    assert checked.returncode == 0, checked.stderr
    assert checked.stderr == "" and checked.stdout == ""
    text = result.stdout
    execstart = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert systemd_words(execstart.removeprefix("ExecStart=")) == [
        str(CONSOLE_SCRIPT),
        "--kmp-blocktime",
        "10",
        "--vllm",
        str(vllm_env / "bin" / "vllm"),
        "--strict",
        "--",
        "serve",
        "/models/qwen",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}',
        "--shutdown-timeout",
        "45",
    ]
    for setting in (
        "Type=exec",
        "User=vllm",
        "Group=vllm",
        "Environment=VLLM_CPU_KVCACHE_SPACE=4",
        'Environment="NOTE=50%% of $HOME"',
        "CacheDirectory=vllm-qwen",
        "StateDirectory=vllm-qwen",
        "Environment=HOME=%S/vllm-qwen",
        "Environment=HF_HOME=%C/vllm-qwen/huggingface",
        "Environment=VLLM_CACHE_ROOT=%C/vllm-qwen/vllm",
        "ProtectSystem=strict",
        "ProtectHome=read-only",
        "NoNewPrivileges=yes",
        "Restart=on-failure",
        "KillMode=mixed",
        "TimeoutStopSec=105s",  # vLLM's 45 s drain plus a margin
        "WantedBy=multi-user.target",
    ):
        assert setting in text.splitlines(), setting
    limit = next(line for line in text.splitlines() if line.startswith("LimitNOFILE="))
    assert int(limit.partition("=")[2]) >= 65535
    assert "DynamicUser=yes" not in text


def test_private_tmp_is_left_out_for_a_deployment_under_tmp(
    tmp_path: Path, vllm_env: Path, unit_dir: Path
) -> None:
    """PrivateTmp=yes gives the service an empty /tmp: a vLLM there would vanish. So does
    DynamicUser=yes, which implies PrivateTmp=yes whatever the unit says (systemd.exec(5)):
    without --user that is an error naming the fix; the fix, run, gives a unit whose
    sandbox in effect (systemd's own loader) sees /tmp."""
    if not str(vllm_env).startswith("/tmp/"):
        pytest.skip(f"pytest's temporary directory {tmp_path} is not under /tmp")
    vllm = str(vllm_env / "bin" / "vllm")
    refused = generate(["--vllm", vllm, "--", "serve", "/m"], tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert vllm in refused.stderr and "give --user USER" in refused.stderr
    result = generate(["--user", "vllm", "--vllm", vllm, "--", "serve", "/m"], tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "PrivateTmp=yes" not in lines and "DynamicUser=yes" not in lines
    assert "ProtectSystem=strict" in lines
    assert any(line.startswith("# No PrivateTmp=yes:") for line in lines)
    (warning,) = (w for w in result.stderr.splitlines() if "PrivateTmp" in w)
    assert vllm in warning and "left out of the unit" in warning
    unit = unit_dir / "vllm-tmp.service"
    unit.write_text(result.stdout)
    assert verify_unit(unit).returncode == 0
    dump = systemd_dump(unit)
    assert effective(dump, "PrivateTmp") == "no"
    assert effective(dump, "DynamicUser") == "no"
    assert effective(dump, "User") == "vllm"
    assert effective(dump, "ProtectSystem") == "strict"  # the rest of the sandbox stays
    assert effective(dump, "ProtectHome") == "read-only"


@pytest.fixture
def env_outside_tmp(real_iomp: Path) -> Iterator[Path]:
    """A vLLM-like environment (real libiomp5.so, recording `vllm`) where a private /tmp
    would not hide it."""
    outside = outside_tmp()
    try:
        environment = make_environment(outside / "env", real_iomp)
        install_recorder(environment)
        yield environment
    finally:
        shutil.rmtree(outside)


def test_private_tmp_is_kept_when_nothing_the_service_needs_is_under_tmp(
    tmp_path: Path, env_outside_tmp: Path
) -> None:
    """The launcher as `python -m` of an interpreter outside /tmp, vLLM outside it too."""
    vllm = env_outside_tmp / "bin" / "vllm"
    python = getattr(sys, "_base_executable", sys.executable)
    assert not python.startswith(("/tmp/", "/var/tmp/"))
    command = [python, "-m", "vllm_cpu_launch", "systemd-unit", "--vllm", str(vllm)]
    result = run_launcher(
        ["--", "serve", "/m", "-sc", '{"method":"ngram"}'],
        unit_environ(tmp_path),
        command,
    )
    assert result.returncode == 0, result.stderr
    assert "PrivateTmp=yes" in result.stdout.splitlines()
    assert "PrivateTmp" not in result.stderr


def test_defaults_dynamic_user_and_python_m_when_no_console_script(
    tmp_path: Path, env_outside_tmp: Path
) -> None:
    # The vLLM-like environment has no console script: `python -m vllm_cpu_launch`. It lies
    # outside /tmp, which DynamicUser=yes (implying PrivateTmp=yes) would hide.
    python = env_outside_tmp / "bin" / "python"
    result = run_launcher(
        ["--vllm", str(env_outside_tmp / "bin" / "vllm"), "systemd-unit", "serve", "m"],
        unit_environ(tmp_path),
        launcher=(str(python), "-m", "vllm_cpu_launch"),
    )
    assert result.returncode == 0, result.stderr
    assert "DynamicUser=yes" in result.stdout.splitlines()
    assert "TimeoutStopSec=120s" in result.stdout.splitlines()
    execstart = next(x for x in result.stdout.splitlines() if x.startswith("ExecStart="))
    assert systemd_words(execstart.removeprefix("ExecStart="))[:3] == [
        str(python),
        "-m",
        "vllm_cpu_launch",
    ]
    unit = tmp_path / "vllm-cpu-launch.service"
    unit.write_text(result.stdout)
    checked = verify_unit(unit)
    assert checked.returncode == 0 and checked.stderr == "", checked.stderr


def test_vllm_found_on_path_is_pinned_by_absolute_path(tmp_path: Path, vllm_env: Path) -> None:
    path = f"{vllm_env / 'bin'}:/usr/bin:/bin"
    result = generate(["--user", "vllm", "serve", "m"], tmp_path, PATH=path)
    assert result.returncode == 0, result.stderr
    execstart = next(x for x in result.stdout.splitlines() if x.startswith("ExecStart="))
    words = systemd_words(execstart.removeprefix("ExecStart="))
    assert words[1:3] == ["--vllm", str(vllm_env / "bin" / "vllm")]


def test_vllm_from_a_variable_or_user_config_is_pinned_too(tmp_path: Path, vllm_env: Path) -> None:
    """The service sees neither the caller's variables nor their config file."""
    vllm = str(vllm_env / "bin" / "vllm")
    result = generate(["--user", "vllm", "serve", "m"], tmp_path, VLLMCPULAUNCH_VLLM=vllm)
    assert result.returncode == 0, result.stderr
    execstart = next(x for x in result.stdout.splitlines() if x.startswith("ExecStart="))
    assert systemd_words(execstart.removeprefix("ExecStart="))[1:3] == ["--vllm", vllm]
    user_config = tmp_path / "xdg" / "vllm-cpu-launch" / "config.yaml"
    user_config.parent.mkdir(parents=True)
    user_config.write_text(f"vllm: {vllm}\niomp: always\n")
    result = generate(
        ["--user", "vllm", "serve", "m"], tmp_path, XDG_CONFIG_HOME=str(tmp_path / "xdg")
    )
    assert result.returncode == 0, result.stderr
    execstart = next(x for x in result.stdout.splitlines() if x.startswith("ExecStart="))
    assert systemd_words(execstart.removeprefix("ExecStart="))[1:3] == ["--vllm", vllm]
    assert f"settings from {user_config} apply here but not to the service" in result.stderr


def test_missing_vllm_and_unseen_variables_are_warned(tmp_path: Path) -> None:
    result = generate(
        ["--user", "vllm", "serve", "m"],
        tmp_path,
        PATH="/usr/bin:/bin",
        VLLMCPULAUNCH_IOMP="always",
    )
    assert result.returncode == 0, result.stderr
    assert "vllm not found" in result.stderr
    assert "VLLMCPULAUNCH_IOMP is set here but the service will not see it" in result.stderr
    assert result.stdout.startswith("# vllm-cpu-launch.service")


def test_exec_unit_for_ray(tmp_path: Path, vllm_env: Path) -> None:
    ray = vllm_env / "bin" / "ray"
    ray.write_text(f"#!{vllm_env / 'bin' / 'python'}\n")
    ray.chmod(0o755)
    path = f"{vllm_env / 'bin'}:/usr/bin:/bin"
    result = generate(
        ["--name", "ray-head", "--user", "vllm", "exec", "--", "ray", "start", "--head", "--block"],
        tmp_path,
        PATH=path,
    )
    assert result.returncode == 0, result.stderr
    execstart = next(x for x in result.stdout.splitlines() if x.startswith("ExecStart="))
    assert systemd_words(execstart.removeprefix("ExecStart=")) == [
        str(CONSOLE_SCRIPT),
        "exec",
        "--",
        str(ray),
        "start",
        "--head",
        "--block",
    ]
    unit = tmp_path / "ray-head.service"
    unit.write_text(result.stdout)
    checked = verify_unit(unit)
    assert checked.returncode == 0 and checked.stderr == "", checked.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--name", "bad name", "serve", "m"], "--name 'bad name'"),
        (["--env", "NOEQUALS", "serve", "m"], "expected KEY=VALUE"),
        (["--env", "1X=y", "serve", "m"], "expected KEY=VALUE"),
        (["--user"], "--user needs a value"),
        ([], "systemd-unit needs the vLLM command"),
        (["--dry-run", "serve", "m"], "--dry-run does not apply"),
        (["--iomp", "sometimes", "serve", "m"], "--iomp: 'sometimes' is not one of"),
    ],
)
def test_usage_errors_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    result = generate(args, tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


# Names systemd's own loader refuses in User= and Group= (valid_user_group_name, relaxed).
REFUSED_NAMES = ["bad:user", "a/b", "0100", "65535", "4294967295", "-1", "."]


@pytest.mark.parametrize("setting", ["User", "Group"])
@pytest.mark.parametrize("name", REFUSED_NAMES)
def test_a_user_or_group_systemd_refuses_is_refused_with_the_rule(
    tmp_path: Path, unit_dir: Path, setting: str, name: str
) -> None:
    """Refused before anything is planned, as the real systemd refuses the same name."""
    unit = unit_dir / "named.service"
    unit.write_text(f"[Service]\nExecStart=/bin/true\n{setting}={name}\n")
    systemd = verify_unit(unit)
    assert systemd.returncode != 0 and "Invalid user/group name" in systemd.stderr
    option = f"--{setting.lower()}"
    result = generate([option, name, "serve", "m"], tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"vllm-cpu-launch: error: {option} {name!r}: systemd refuses it")
    assert "give a user or group name without ':' or '/', or a numeric id" in line


@pytest.mark.parametrize("name", ["bad user", "john.doe", "a%b", "1000", "Ünï"])
def test_a_user_systemd_accepts_is_the_user_systemd_reads(
    tmp_path: Path, unit_dir: Path, name: str
) -> None:
    """Written as systemd reads User= and Group=: whole, quotes included, `%` a specifier."""
    result = generate(["--name", "named", "--user", name, "--group", name, "serve", "/m"], tmp_path)
    assert result.returncode == 0, result.stderr
    unit = unit_dir / "named.service"
    unit.write_text(result.stdout)
    assert verify_unit(unit).returncode == 0
    dump = systemd_dump(unit)
    assert (effective(dump, "User"), effective(dump, "Group")) == (name, name)


def test_a_user_with_a_space_at_an_end_is_refused_as_systemd_would_read_another(
    tmp_path: Path, unit_dir: Path
) -> None:
    unit = unit_dir / "named.service"
    unit.write_text("[Service]\nExecStart=/bin/true\nUser= vllm \n")
    assert effective(systemd_dump(unit), "User") == "vllm"  # the spaces are gone
    result = generate(["--user", " vllm ", "serve", "m"], tmp_path)
    assert result.returncode == 2 and "starts or ends with a space" in result.stderr


def test_a_unit_name_longer_than_a_file_name_is_refused(tmp_path: Path) -> None:
    result = generate(["--name", "a" * 248, "serve", "m"], tmp_path)
    assert result.returncode == 2 and "over 255 bytes" in result.stderr
    assert generate(["--name", "a" * 247, "--user", "vllm", "serve", "m"], tmp_path).returncode == 0


def test_help(tmp_path: Path) -> None:
    result = generate(["--help"], tmp_path)
    assert result.returncode == 0 and "usage: vllm-cpu-launch systemd-unit" in result.stdout


# ---------------------------------------------------------------- the shipped units


@pytest.fixture
def system_root(tmp_path: Path) -> Path:
    """A root with systemd's own units and an executable /usr/local/bin/vllm-cpu-launch."""
    root = tmp_path / "root"
    (root / "usr" / "lib" / "systemd").mkdir(parents=True)
    shutil.copytree(
        "/lib/systemd/system", root / "usr" / "lib" / "systemd" / "system", symlinks=True
    )
    (root / "usr" / "local" / "bin").mkdir(parents=True)
    launcher = root / "usr" / "local" / "bin" / "vllm-cpu-launch"
    launcher.write_text("#!/bin/sh\n")
    launcher.chmod(0o755)
    (root / "etc" / "systemd" / "system").mkdir(parents=True)
    return root


@pytest.mark.parametrize("name", ["vllm-cpu-launch.service", "vllm-cpu-launch@.service"])
def test_shipped_units_pass_verify(system_root: Path, name: str) -> None:
    need("systemd-analyze")
    units = system_root / "etc" / "systemd" / "system"
    shutil.copy(SHIPPED / name, units / name)
    target = units / name.replace("@.", "@qwen.")
    if target.name != name:
        target.symlink_to(name)
    checked = subprocess.run(
        ["systemd-analyze", "verify", f"--root={system_root}", target.name],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr
    assert checked.stderr == "", checked.stderr


def test_shipped_units_fail_verify_without_the_launcher(system_root: Path) -> None:
    """The check above can fail: verify does look for ExecStart's binary."""
    (system_root / "usr" / "local" / "bin" / "vllm-cpu-launch").unlink()
    units = system_root / "etc" / "systemd" / "system"
    shutil.copy(SHIPPED / "vllm-cpu-launch.service", units)
    checked = subprocess.run(
        ["systemd-analyze", "verify", f"--root={system_root}", "vllm-cpu-launch.service"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert checked.returncode != 0
    assert "vllm-cpu-launch is not executable" in checked.stderr


def test_shipped_unit_execstart_parses_as_documented(unit_dir: Path) -> None:
    unit = unit_dir / "shipped.service"
    shutil.copy(SHIPPED / "vllm-cpu-launch.service", unit)
    unit.chmod(0o644)
    argv = systemd_parsed_argv(unit)
    spec = argv[argv.index(b"--speculative-config") + 1]
    assert re.fullmatch(rb"\{.*\}", spec) and b'"method": "ngram"' in spec
    assert argv[:3] == [b"/usr/local/bin/vllm-cpu-launch", b"--", b"serve"]


@pytest.mark.parametrize("directory", ["a$b", "a$$b", "${HOME}x"])
def test_a_launcher_under_a_path_with_a_dollar_runs_as_systemd_reads_it(
    tmp_path: Path, unit_dir: Path, directory: str
) -> None:
    """systemd substitutes variables in ExecStart's arguments, not in its executable: a
    `$` doubled there stays doubled in the path it runs (issue 35, defect 7)."""
    outside = outside_tmp()
    try:
        environment = make_environment(outside / directory)
        python = environment / "bin" / "python"
        result = run_launcher(
            ["systemd-unit", "--user", "vllm", "serve", "m", "--x", "$HOME"],
            unit_environ(tmp_path, PATH="/usr/bin:/bin"),
            launcher=(str(python), "-m", "vllm_cpu_launch"),
        )
        assert result.returncode == 0, result.stderr
        unit = unit_dir / "dollar.service"
        unit.write_text(result.stdout)
        checked = verify_unit(unit)
        assert "not executable" not in checked.stderr, checked.stderr
        program, *arguments = systemd_parsed_argv(unit)
        assert program == os.fsencode(python)  # as systemd runs it: no substitution there
        assert substitute_dollars(arguments[-1]) == b"$HOME"
    finally:
        shutil.rmtree(outside)


@pytest.mark.parametrize("directory", ["back\\slash", "quo'te", 'double"quote', "bell\a"])
def test_a_launcher_under_a_path_systemd_refuses_is_one_line_not_a_unit(
    tmp_path: Path, unit_dir: Path, directory: str
) -> None:
    """systemd refuses an executable path holding a quote, a backslash or a control character
    ("Executable name contains special characters"), however quoted: no unit it would refuse
    is printed with exit 0 (issue 35, defect 7). The rule is systemd's own, shown first."""
    outside = outside_tmp()
    try:
        environment = make_environment(outside / directory)
        install_recorder(environment)  # vLLM beside the launcher: no warning about it
        python = environment / "bin" / "python"
        by_hand = unit_dir / "by-hand.service"
        by_hand.write_text(f"[Service]\nExecStart={quote_word(str(python))} x\n")
        assert "special characters" in verify_unit(by_hand).stderr
        result = run_launcher(
            ["systemd-unit", "--user", "vllm", "serve", "m"],
            unit_environ(tmp_path, PATH="/usr/bin:/bin"),
            launcher=(str(python), "-m", "vllm_cpu_launch"),
        )
        assert result.returncode == 2, result.stdout
        assert result.stdout == ""
        assert result.stderr.count("\n") == 1, result.stderr
        assert "vllm-cpu-launch: error: systemd refuses to start an executable" in result.stderr
        assert "install vllm-cpu-launch where its path has none of them" in result.stderr
    finally:
        shutil.rmtree(outside)
