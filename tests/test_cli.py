"""The launcher's command line (vllm_cpu_launch/cli.py) as a fresh process: every exit code
with its message, settings precedence, the exec of a recording stand-in for `vllm` (the
launcher becomes the target), and many launches at once. One section per subject; the
sections name the files they were. The launch core below it (launch.py): tests/test_launch.py.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_cpu_launch import settings as settings_module
from vllm_cpu_launch.settings import blocktime_milliseconds, load_settings

from .conftest import (
    AS_NOBODY,
    LAUNCHER,
    NOBODY,
    SystemHost,
    clean_environ,
    install_recorder,
    make_environment,
    read_record,
    run_launcher,
)
from .hardening import (
    GUARD,
    REAL_IOMP,
    base_environ,
    children_of,
    dry_run_plan,
    fake_vllm,
    public_directory,
    record_argv,
    run,
    text,
)
from .hardening import read_record as read_plain_record

NGRAM = '{"method":"ngram","num_speculative_tokens":3}'
NGRAM_TOKENS = NGRAM
# The launcher's mark on a start whose LD_PRELOAD names a runtime: the plugin adds nothing.
STARTED = {"VLLMCPULAUNCH_PLANNED": "launcher:started"}


def sd_launch(vllm_env: Path) -> list[str]:
    """`--vllm <stand-in> serve m -sc <ngram>`: the usual tail of a launch."""
    return ["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m", "-sc", NGRAM]


def launcher(tmp_path: Path, args: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    return run_launcher(args, clean_environ(tmp_path, **extra))


def assert_one_error(result: subprocess.CompletedProcess[str], code: int, *parts: str) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("vllm-cpu-launch: error: ")
    for part in parts:
        assert part in lines[0]


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"VLLMCPULAUNCH_IOMP": "never"}, "VLLMCPULAUNCH_IOMP=never"),
        ({"config": "iomp: never\n"}, "iomp: never in {config}"),
        ({"option": "never"}, "--iomp never"),
    ],
)
def test_the_info_line_names_where_iomp_never_came_from(
    tmp_path: Path, vllm_env: Path, record_file: Path, given: dict[str, str], named: str
) -> None:
    config = tmp_path / "launcher.yaml"
    config.write_text(given.pop("config", ""))
    head = ["--iomp", given.pop("option")] if "option" in given else []
    environ = clean_environ(
        tmp_path, VLLMCPULAUNCH_CONFIG=str(config), RECORD_TO=str(record_file), **given
    )
    result = run_launcher([*head, *sd_launch(vllm_env)], environ)
    assert result.returncode == 0, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"vllm-cpu-launch: {named.format(config=config)}; "), line


@pytest.mark.parametrize(
    ("args", "parts"),
    [
        (["--bogus", "serve", "m"], ("'--bogus'", "after the subcommand")),
        (["--iomp", "maybe", "serve", "m"], ("--iomp", "'maybe'", "auto, always, never")),
        (["--iomp"], ("--iomp needs a value",)),
        (["--kmp-blocktime", "soon", "serve", "m"], ("--kmp-blocktime", "infinite")),
        (["--iomp-path", "lib/libiomp5.so", "serve", "m"], ("relative", "absolute")),
        (["--dry-run"], ("no vLLM subcommand",)),
        (["--json", "serve", "m"], ("--json goes with --dry-run",)),
        (["--strict=yes", "serve", "m"], ("'--strict=yes'",)),
    ],
)
def test_usage_errors_exit_2(
    tmp_path: Path, vllm_env: Path, args: list[str], parts: tuple[str, ...]
) -> None:
    result = launcher(tmp_path, args, VLLMCPULAUNCH_VLLM=str(vllm_env / "bin" / "vllm"))
    assert_one_error(result, 2, *parts)


def test_bad_environment_variable_exits_2(tmp_path: Path, vllm_env: Path) -> None:
    result = launcher(
        tmp_path,
        ["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m"],
        VLLMCPULAUNCH_TCMALLOC="yes",
    )
    assert_one_error(result, 2, "VLLMCPULAUNCH_TCMALLOC", "'yes'")


def test_explicit_library_that_fails_validation_exits_2(tmp_path: Path, vllm_env: Path) -> None:
    text_file = tmp_path / "libiomp5.so"
    text_file.write_text("not a library\n")
    result = launcher(
        tmp_path,
        ["--iomp-path", str(text_file), *sd_launch(vllm_env)],
    )
    assert_one_error(result, 2, str(text_file), "not an ELF file")


@pytest.mark.parametrize(
    ("name", "reason"),
    [("libiompstubs5.so", "serial stub library"), ("libiomp5_db.so", "not an OpenMP runtime")],
)
def test_intel_stub_or_debugger_library_is_refused(
    tmp_path: Path, vllm_env: Path, real_iomp: Path, name: str, reason: str
) -> None:
    """The intel-openmp wheel's other `libiomp` files are an error as --iomp-path."""
    shipped = real_iomp.parent / name
    result = launcher(tmp_path, ["--iomp-path", str(shipped), *sd_launch(vllm_env)])
    assert_one_error(result, 2, f"iomp library {shipped} cannot be preloaded: ", reason)


def test_intel_stub_in_ld_preload_gets_no_runtime_beside_it(
    tmp_path: Path, vllm_env: Path, real_iomp: Path
) -> None:
    """From LD_PRELOAD the stub is no candidate, and a runtime beside it would make two
    OpenMP libraries in one process: nothing is added, one warning with the LD_PRELOAD
    that works (tests/test_plan.py runs that fix). (libiomp5_db.so cannot be
    tried there: preloaded, no Python even starts.)"""
    stub = real_iomp.parent / "libiompstubs5.so"
    result = launcher(tmp_path, ["--dry-run", "--json", *sd_launch(vllm_env)], LD_PRELOAD=str(stub))
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert (plan["preload"], plan["env"], plan["missing"]) == ([], STARTED, ["iomp"])
    (warning,) = (w for w in plan["warnings"] if str(stub) in w)
    assert "serial stub library" in warning and warning.endswith("Fix: unset LD_PRELOAD")


def test_explicit_library_is_used(
    tmp_path: Path, vllm_env: Path, real_iomp: Path, system_host: SystemHost
) -> None:
    result = launcher(
        tmp_path,
        ["--dry-run", "--json", "--iomp-path", str(real_iomp), *sd_launch(vllm_env)],
    )
    plan = json.loads(result.stdout)
    assert plan["preload"] == [
        *system_host.preloaded(),
        {"kind": "iomp", "path": str(real_iomp), "flavor": "intel", "origin": "explicit"},
    ]


def test_target_not_found_exits_127(tmp_path: Path) -> None:
    result = launcher(tmp_path, ["serve", "m"], PATH=str(tmp_path / "empty"))
    assert_one_error(result, 127, "vllm not found", "--vllm")
    result = launcher(tmp_path, ["--vllm", str(tmp_path / "nope"), "serve", "m"])
    assert_one_error(result, 127, str(tmp_path / "nope"), "does not exist")


def test_target_not_executable_exits_126(tmp_path: Path) -> None:
    script = tmp_path / "vllm"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    assert_one_error(launcher(tmp_path, ["--vllm", str(script), "serve", "m"]), 126, "chmod +x")


def test_help_and_version(tmp_path: Path) -> None:
    result = launcher(tmp_path, ["--help"])
    assert result.returncode == 0 and "--iomp auto|always|never" in result.stdout
    result = launcher(tmp_path, ["--version"])
    assert result.returncode == 0 and result.stdout.startswith("vllm-cpu-launch ")


def test_dry_run_prints_the_plan_and_execs_nothing(
    tmp_path: Path, vllm_env: Path, record_file: Path, system_host: SystemHost
) -> None:
    args = ["--dry-run", "--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m", "-sc", NGRAM]
    result = launcher(tmp_path, args, RECORD_TO=str(record_file))
    assert result.returncode == 0 and not record_file.exists()
    assert f"LD_PRELOAD={system_host.preload(vllm_env / 'lib' / 'libiomp5.so')}" in result.stdout


def test_no_variable_of_ours_is_in_vllms_namespace() -> None:
    """vLLM reports every VLLM_* variable it does not know and, with
    --fail-on-environ-validation, refuses to start (Platform.validate_environ)."""
    from vllm_cpu_launch import handoff

    ours = [
        settings_module.CONFIG_VARIABLE,
        handoff.PLANNED_VARIABLE,
        handoff.PLUGIN_VARIABLE,
        *(entry[1] for entry in settings_module.KEYS.values()),
    ]
    assert not [name for name in ours if name.startswith("VLLM_")]


@pytest.mark.parametrize("current_too", [False, True])
def test_a_deprecated_variable_name_is_read_and_said_once(
    tmp_path: Path, vllm_env: Path, current_too: bool, system_host: SystemHost
) -> None:
    extra = {"VLLM_CPU_LAUNCH_IOMP": "never"}
    if current_too:
        extra["VLLMCPULAUNCH_IOMP"] = "always"
    args = ["--dry-run", "--json", *sd_launch(vllm_env)]
    result = launcher(tmp_path, args, **extra)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    said = [w for w in plan["warnings"] if "VLLM_CPU_LAUNCH_IOMP is deprecated" in w]
    assert len(said) == 1 and "rename it to VLLMCPULAUNCH_IOMP" in said[0]
    assert ("ignored" in said[0]) == current_too
    preloaded = [entry["kind"] for entry in plan["preload"]]
    assert preloaded == (system_host.kinds("iomp") if current_too else [])


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("IOMP", "bad", "'bad' is not one of auto, always, never"),
        ("IOMP_PATH", "relative/libiomp5.so", "is relative"),
    ],
)
def test_a_bad_value_under_a_deprecated_name_names_the_variable_set(
    tmp_path: Path, vllm_env: Path, variable: str, value: str, said: str
) -> None:
    """The user set the old name: the error names that one, and the name to use instead."""
    old, new = f"VLLM_CPU_LAUNCH_{variable}", f"VLLMCPULAUNCH_{variable}"
    result = launcher(tmp_path, ["--dry-run", *sd_launch(vllm_env)], **{old: value})
    assert_one_error(result, 2, f"error: {old} (deprecated name of {new}): ", said)


# ---------------------------------------------------------------- settings


def write_config(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_precedence_option_env_user_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    system = write_config(
        tmp_path / "etc" / "config.yaml",
        "iomp: never\ntcmalloc: never\nkmp-blocktime: 1\nstrict: true\n",
    )
    monkeypatch.setattr(settings_module, "SYSTEM_CONFIG", str(system))
    write_config(
        tmp_path / "xdg" / "vllm-cpu-launch" / "config.yaml", "tcmalloc: always\nkmp_blocktime: 2\n"
    )
    environ = {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "VLLMCPULAUNCH_KMP_BLOCKTIME": "3"}
    loaded = load_settings({"iomp": "always"}, environ)
    assert (loaded.iomp, loaded.tcmalloc, loaded.kmp_blocktime, loaded.strict) == (
        "always",
        "always",
        "3",
        True,
    )
    assert loaded.config_files == (
        str(system),
        str(tmp_path / "xdg" / "vllm-cpu-launch" / "config.yaml"),
    )
    assert load_settings({"kmp_blocktime": "4"}, environ).kmp_blocktime == "4"


def test_launcher_config_replaces_the_user_file(tmp_path: Path, vllm_env: Path) -> None:
    """As a fresh launcher reads them (both files set iomp, so /etc's does not matter)."""
    write_config(tmp_path / "xdg" / "vllm-cpu-launch" / "config.yaml", "iomp: never\n")
    chosen = write_config(tmp_path / "chosen.yaml", "iomp: always\n")
    args = ["--dry-run", "--json", "--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m"]
    xdg = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    user = tmp_path / "xdg" / "vllm-cpu-launch" / "config.yaml"
    for head, extra, reason in (
        (["--launcher-config", str(chosen)], xdg, f"iomp: always in {chosen}"),
        ([], {**xdg, "VLLMCPULAUNCH_CONFIG": str(chosen)}, f"iomp: always in {chosen}"),
        ([], xdg, f"iomp: never in {user}"),
    ):
        result = launcher(tmp_path, [*head, *args], **extra)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["reason"] == reason


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("iomp: sometimes\n", ("key 'iomp'", "'sometimes'")),
        ("iomp: off\n", ("key 'iomp'", "False")),  # YAML 1.1 reads off as a boolean
        ("colour: blue\n", ("unknown key 'colour'", "allowed keys: iomp, iomp-path")),
        ("strict: maybe\n", ("key 'strict'", "yes/no")),
        ("iomp-path: relative/libiomp5.so\n", ("key 'iomp-path'", "relative")),
        ("[a, b]\n", ("must be a mapping",)),
        ("iomp: [unclosed\n", ("invalid YAML",)),
    ],
)
def test_bad_config_file_names_file_and_key(
    tmp_path: Path, text: str, parts: tuple[str, ...]
) -> None:
    config = write_config(tmp_path / "bad.yaml", text)
    result = launcher(tmp_path, ["--launcher-config", str(config), "serve", "m"])
    assert_one_error(result, 2, str(config), *parts)


@pytest.mark.parametrize("written", ["00200", "0x10", "1_000", "5", "+5", "5ms", "'00200'"])
def test_blocktime_in_a_config_file_means_what_the_option_means(
    tmp_path: Path, vllm_env: Path, real_iomp: Path, written: str
) -> None:
    """YAML 1.1 reads 00200 as octal 128 and 0x10 as 16: a config file's kmp-blocktime is
    the text written, so it sets (or is refused as) what the same option would, and
    Intel's runtime reads the value set as the milliseconds the launcher took it for."""
    config = write_config(
        tmp_path / "launcher.yaml", f"# tuned by hand\nkmp-blocktime: {written}\n"
    )
    text = written.strip("'")
    outcomes = []
    for given in (["--launcher-config", str(config)], ["--kmp-blocktime", text]):
        result = launcher(tmp_path, [*given, "--dry-run", "--json", *sd_launch(vllm_env)])
        plan = json.loads(result.stdout) if result.returncode == 0 else {"env": {}}
        line = result.stderr.replace(f"{config}: key 'kmp-blocktime'", "--kmp-blocktime")
        outcomes.append((result.returncode, plan["env"].get("KMP_BLOCKTIME"), line))
    assert outcomes[0] == outcomes[1]
    code, blocktime, _ = outcomes[0]
    assert (code, blocktime) == ((2, None) if text in ("0x10", "1_000", "+5") else (0, text))
    if blocktime is not None:
        runtime = f"import ctypes; print(ctypes.CDLL({str(real_iomp)!r}).kmp_get_blocktime())"
        read = subprocess.run(
            [sys.executable, "-c", runtime],
            env=clean_environ(tmp_path, KMP_BLOCKTIME=blocktime),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert int(read.stdout) == blocktime_milliseconds(blocktime), read.stderr


def test_vllm_in_a_config_file_is_absolute_after_home_or_a_name_on_path(
    tmp_path: Path, vllm_env: Path
) -> None:
    """`~` is expanded (no shell did it); a relative path is refused, naming file and key,
    since each start would resolve it from its own directory; a bare name is a PATH lookup."""
    home = tmp_path / "home"
    shutil.copytree(vllm_env, home / "venv", symlinks=True)
    path = f"{home / 'venv' / 'bin'}:/usr/bin:/bin"
    for written, expected in (("~/venv/bin/vllm", 0), ("vllm", 0), ("venv/bin/vllm", 2)):
        config = write_config(tmp_path / "launcher.yaml", f"vllm: {written}\niomp: always\n")
        args = ["--launcher-config", str(config), "--dry-run", "--json", "serve", "m"]
        result = run_launcher(args, clean_environ(tmp_path, PATH=path, HOME=str(home)))
        if expected == 2:
            assert_one_error(result, 2, f"{config}: key 'vllm': 'venv/bin/vllm' is relative")
            continue
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["command"][0] == str(home / "venv" / "bin" / "vllm")


def test_missing_explicit_config_file_is_an_error(tmp_path: Path, vllm_env: Path) -> None:
    missing = str(tmp_path / "missing.yaml")
    args = ["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m"]
    for head, extra in (
        (["--launcher-config", missing], {}),
        ([], {"VLLMCPULAUNCH_CONFIG": missing}),
    ):
        result = launcher(tmp_path, [*head, *args], **extra)
        assert_one_error(result, 2, f"{missing}: config file not found")


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda path: os.mkfifo(path), "config file is a FIFO, not a regular file"),
        (lambda path: path.mkdir(), "config file is a directory, not a regular file"),
        (
            lambda path: path.symlink_to("/dev/zero"),
            "config file is a character device, not a regular file",
        ),
    ],
    ids=["fifo", "directory", "device"],
)
def test_a_config_file_that_is_no_regular_file_is_one_line_never_a_hang(
    tmp_path: Path, vllm_env: Path, make: Callable[[Path], object], problem: str
) -> None:
    """Opening a FIFO for reading waits for a writer: the launcher checks what a file is
    before it reads it (issue 35, defect 4), for its own config and vLLM's --config."""
    config = tmp_path / "config.yaml"
    make(config)
    vllm = str(vllm_env / "bin" / "vllm")
    result = launcher(tmp_path, ["--launcher-config", str(config), "--vllm", vllm, "serve", "m"])
    assert_one_error(result, 2, f"{config}: {problem}")
    doctor = launcher(tmp_path, ["doctor"], VLLMCPULAUNCH_CONFIG=str(config))
    assert "Traceback" not in doctor.stderr and f"{config}: {problem}" in doctor.stdout
    args = ["--vllm", vllm, "--dry-run", "--json", "serve", "m", "--config", str(config)]
    planned = json.loads(launcher(tmp_path, args).stdout)
    (warning,) = planned["warnings"]
    assert warning.startswith(f"vLLM config file {config} {problem.removeprefix('config file ')}")


def test_yaml_nested_deeper_than_the_reader_takes_is_one_line_in_every_verb(
    tmp_path: Path, vllm_env: Path
) -> None:
    """pyyaml composes nodes recursively: 600 levels ended in a RecursionError traceback
    (issue 35, defect 5)."""
    config = tmp_path / "deep.yaml"
    config.write_text("iomp: " + "[" * 600 + "]" * 600 + "\n")
    vllm = str(vllm_env / "bin" / "vllm")
    problem = f"{config}: config file nests its YAML deeper than the reader can take"
    for args in (["serve", "m"], ["env", "serve", "m"], ["rules", "serve", "m"]):
        result = launcher(tmp_path, ["--launcher-config", str(config), "--vllm", vllm, *args])
        assert_one_error(result, 2, problem)
    doctor = launcher(tmp_path, ["doctor"], VLLMCPULAUNCH_CONFIG=str(config))
    assert "Traceback" not in doctor.stderr and problem in doctor.stdout
    args = ["--vllm", vllm, "--dry-run", "--json", "serve", "m", "--config", str(config)]
    (warning,) = json.loads(launcher(tmp_path, args).stdout)["warnings"]
    assert "nests its YAML deeper than the reader can take" in warning


@pytest.mark.parametrize("change", ["mode 666", "owned by another user", "directory 777"])
def test_a_config_file_another_user_can_change_is_refused_with_the_fix(
    tmp_path: Path, vllm_env: Path, change: str
) -> None:
    """A config file says what runs and what is preloaded: as root, one another user can
    change was read silently (issue 35, defect 3). Refused, naming owner and mode; the
    printed fix is run, and the file is then read."""
    if os.geteuid() != 0 and change != "mode 666":
        pytest.skip("a file owned by another user, as root: this test runs as a user")
    directory = tmp_path / "etc"
    directory.mkdir()
    config = directory / "config.yaml"
    config.write_text("iomp: never\n")
    if change == "mode 666":
        config.chmod(0o666)
    elif change == "owned by another user":
        os.chown(config, 1000, 1000)
    else:
        directory.chmod(0o777)
    args = ["--launcher-config", str(config), "--vllm", str(vllm_env / "bin" / "vllm")]
    args += ["--dry-run", "--json", "serve", "m", "-sc", NGRAM_TOKENS]
    result = launcher(tmp_path, args)
    assert_one_error(result, 2, f"{config}: config file not read: ", "Fix: ")
    line = result.stderr.strip()
    # The owner and mode of what is at fault: the directory's drwxrwxrwx, not the file's
    # -rw-r--r-- shown as if the directory's (issue 45).
    faulty = directory if change == "directory 777" else config
    status = faulty.stat()
    kind = "directory " if faulty == directory else ""
    owner_and_mode = f"(owner uid {status.st_uid}, mode {stat.filemode(status.st_mode)})"
    assert f"{kind}{faulty} is " in line and owner_and_mode in line
    assert stat.filemode(config.stat().st_mode) not in line or faulty == config
    doctor = launcher(tmp_path, ["doctor"], VLLMCPULAUNCH_CONFIG=str(config))
    assert "config file not read" in doctor.stdout and "Traceback" not in doctor.stderr
    subprocess.run(["sh", "-c", line.rpartition("Fix: ")[2]], check=True, timeout=60)
    fixed = launcher(tmp_path, args)
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads(fixed.stdout)["preload"] == []  # its iomp: never, read now


def vllm_config_refusals(tmp_path: Path, vllm: str, config: Path) -> str:
    """The one error line of each verb that reads `serve m --config CONFIG` (the launch,
    --dry-run, env, rules), the same in all; and doctor's, which reads a vLLM command only
    in a tune record from before scoping: in its report, as a launcher config's error."""
    command = ["serve", "m", "--config", str(config)]
    lines = set()
    for verb in ([], ["--dry-run"], ["env"], ["rules"]):
        result = launcher(tmp_path, ["--vllm", vllm, *verb, *command])
        assert_one_error(result, 2, f"vLLM config file {config} not read: ", "Fix: ")
        lines.add(result.stderr.strip())
    (line,) = lines
    record = {"when": "2026-01-01", "iomp": "always", "result": "r", "rounds": 1}
    launcher_config = tmp_path / "launcher.yaml"
    launcher_config.write_text(json.dumps({"tuned": [{**record, "command": shlex.join(command)}]}))
    doctor = launcher(
        tmp_path, ["--vllm", vllm, "doctor", "--json"], VLLMCPULAUNCH_CONFIG=str(launcher_config)
    )
    assert doctor.returncode == 0 and "Traceback" not in doctor.stderr, doctor.stderr
    error = json.loads(doctor.stdout)["settings"]["error"]
    assert f"vllm-cpu-launch: error: {error}" == line
    return line


@pytest.mark.parametrize("change", ["owned by another user", "directory writable by its group"])
def test_a_vllm_config_another_user_can_change_is_refused_as_root_with_the_fix(
    tmp_path: Path, vllm_env: Path, record_file: Path, change: str
) -> None:
    """vLLM's --config YAML says what vLLM runs as root, as a launcher config does: one
    another user can change was read (issue 35). Refused by every verb with one line
    naming the file, its owner and mode, and the fix; the fix is run, and the launch
    then reads the file (its speculative config preloads a runtime)."""
    if os.geteuid() != 0:
        pytest.skip("another user's file, read as root: this test runs as a user")
    directory = tmp_path / "vllm-configs"
    directory.mkdir()
    config = directory / "serve.yaml"
    config.write_text(f"speculative_config: {NGRAM_TOKENS}\n")
    if change == "owned by another user":
        os.chown(config, NOBODY, NOBODY)
    else:
        directory.chmod(0o775)
    vllm = str(vllm_env / "bin" / "vllm")
    line = vllm_config_refusals(tmp_path, vllm, config)
    status = (config if change == "owned by another user" else directory).stat()
    assert f"(owner uid {status.st_uid}, mode {stat.filemode(status.st_mode)})" in line
    subprocess.run(["sh", "-c", line.rpartition("Fix: ")[2]], check=True, timeout=60)
    args = ["--vllm", vllm, "serve", "m", "--config", str(config)]
    fixed = launcher(tmp_path, args, RECORD_TO=str(record_file))
    assert fixed.returncode == 0, fixed.stderr
    started = read_record(record_file)
    assert started["argv"] == args[2:]
    assert "libiomp5.so" in str(started["LD_PRELOAD"])


def test_a_vllm_config_is_read_as_the_user_who_owns_it(nobody_launcher: list[str]) -> None:
    """The file root refuses above (owned by uid 65534), read by the launcher running as
    uid 65534: that user's own settings, as its own code, are its to choose."""
    with public_directory() as root:
        vllm = fake_vllm(root / "env")
        (root / "env" / "bin" / "python").unlink()
        (root / "env" / "bin" / "python").symlink_to("/bin/sh")  # uid 65534 can stat it
        config = root / "serve.yaml"
        config.write_text(f"speculative_config: {NGRAM_TOKENS}\n")
        os.chown(config, NOBODY, NOBODY)
        args = ["--vllm", str(vllm), "serve", "m", "--config", str(config)]
        plan = dry_run_plan(args, base_environ(root / "home"), nobody_launcher, AS_NOBODY)
    assert plan["speculative"]["requested"] is True
    assert str(config) in plan["speculative"]["source"]


def test_a_relative_launcher_config_is_read_from_the_working_directory(
    tmp_path: Path, vllm_env: Path
) -> None:
    """`--launcher-config launcher.yaml` names a file of the working directory, which the
    launcher reads once: the trust rule checked `/launcher.yaml` instead and refused it
    ("cannot check its permissions")."""
    (tmp_path / "launcher.yaml").write_text("iomp: never\n")
    args = ["--launcher-config", "launcher.yaml", "--vllm", str(vllm_env / "bin" / "vllm")]
    args += ["--dry-run", "--json", "serve", "m", "-sc", NGRAM_TOKENS]
    result = subprocess.run(
        [*LAUNCHER, *args],
        env=clean_environ(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["preload"] == []  # its iomp: never, read


def test_dev_null_is_an_empty_config_file(tmp_path: Path, vllm_env: Path) -> None:
    """The usual way to say "no file" (it hides the user's config): read as empty."""
    (tmp_path / "no-user-config" / "vllm-cpu-launch").mkdir(parents=True)
    (tmp_path / "no-user-config" / "vllm-cpu-launch" / "config.yaml").write_text("iomp: never\n")
    args = ["--vllm", str(vllm_env / "bin" / "vllm"), "--dry-run", "--json", "serve", "m"]
    hidden = launcher(tmp_path, ["--launcher-config", os.devnull, *args, "-sc", NGRAM_TOKENS])
    assert hidden.returncode == 0, hidden.stderr
    assert json.loads(hidden.stdout)["preload"]
    read = launcher(tmp_path, [*args, "-sc", NGRAM_TOKENS])
    assert not json.loads(read.stdout)["preload"]  # the user's iomp: never, without it


# The package's modules a launch imports (issue 35: at most 12, the package included;
# issue 47: the launch core, each runtime family, the ELF reader and the messages each a
# module of its own; issue 46: the shape).
EXEC_PATH = [
    "vllm_cpu_launch",
    *("vllm_cpu_launch.cli", "vllm_cpu_launch.command", "vllm_cpu_launch.elf"),
    *("vllm_cpu_launch.errors", "vllm_cpu_launch.gather", "vllm_cpu_launch.handoff"),
    *("vllm_cpu_launch.launch", "vllm_cpu_launch.libraries", "vllm_cpu_launch.messages"),
    *("vllm_cpu_launch.plan", "vllm_cpu_launch.records", "vllm_cpu_launch.rules"),
    "vllm_cpu_launch.runtimes",
    *("vllm_cpu_launch.runtimes.family", "vllm_cpu_launch.runtimes.gnu"),
    *("vllm_cpu_launch.runtimes.intel", "vllm_cpu_launch.runtimes.llvm"),
    *("vllm_cpu_launch.settings", "vllm_cpu_launch.shape", "vllm_cpu_launch.target"),
    "vllm_cpu_launch.trust",
]


def test_exec_path_imports_no_heavy_module(tmp_path: Path, vllm_env: Path) -> None:
    """psutil, cpuinfo, yaml, torch and vLLM stay out of a real launch, and dataclasses
    too (with inspect, about half of the launcher's start-up: records.record makes
    the records instead); of the package only EXEC_PATH. The rest of the standard library is
    welcome (json, re, signal).

    The modules are read at the moment of the exec, which the probe intercepts: what the
    launcher imported up to there is all it will ever import.
    """
    probe = (
        "import json, os, sys\n"
        "def report(*_):\n"
        "    heavy = ('psutil', 'cpuinfo', 'yaml', 'torch', 'vllm', 'dataclasses', 'inspect')\n"
        "    ours = [m for m in sys.modules if m.split('.')[0] == 'vllm_cpu_launch']\n"
        "    loaded = [m for m in heavy if m in sys.modules]\n"
        "    print(json.dumps([loaded, sorted(ours)]), flush=True)\n"
        "    os._exit(0)\n"
        "os.execve = report\n"
        "from vllm_cpu_launch.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    dotted = ["--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens"]
    for request in (["-sc", NGRAM], [*dotted, "3"], []):
        launch = [sys.executable, "-c", probe, "-q", *sd_launch(vllm_env)[:-2], *request]
        result = subprocess.run(
            launch, env=clean_environ(tmp_path), capture_output=True, text=True, timeout=60
        )
        assert (result.returncode, result.stderr) == (0, ""), result.stderr
        assert json.loads(result.stdout) == [[], EXEC_PATH]


def test_json_without_dry_run_is_a_usage_error_before_anything_else(tmp_path: Path) -> None:
    result = launcher(tmp_path, ["--json", "--vllm", str(tmp_path / "nowhere"), "serve", "m"])
    assert_one_error(result, 2, "--json goes with --dry-run")


def test_exec_help(tmp_path: Path) -> None:
    result = launcher(tmp_path, ["exec", "--help"])
    assert result.returncode == 0 and "exec [OPTIONS] -- PROGRAM" in result.stdout


def test_bad_explicit_library_is_an_error_even_without_sd(tmp_path: Path, vllm_env: Path) -> None:
    missing = tmp_path / "gone" / "libiomp5.so"
    args = ["--iomp-path", str(missing), "--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m"]
    assert_one_error(launcher(tmp_path, args), 2, str(missing), "does not exist")


def test_dangling_vllm_beside_the_launcher_falls_back_to_path(
    tmp_path: Path, vllm_env: Path, record_file: Path
) -> None:
    environment = make_environment(tmp_path / "launcher-env")
    (environment / "bin" / "vllm").symlink_to(tmp_path / "removed-vllm")
    result = run_launcher(
        ["serve", "m"],
        clean_environ(tmp_path, RECORD_TO=str(record_file), PATH=f"{vllm_env / 'bin'}:/usr/bin"),
        launcher=[str(environment / "bin" / "python"), "-m", "vllm_cpu_launch"],
    )
    assert result.returncode == 0, result.stderr
    assert read_record(record_file)["argv"] == ["serve", "m"]


# -------------------- Formerly tests/test_exec.py --------------------
# The launcher for real: a process that execs a recording stand-in for `vllm`.


AWKWARD = [
    "",
    "two words",
    " leading and trailing ",
    "new\nline",
    "tab\there",
    "ünïcødé ✓",
    "$HOME",
    "'single' \"double\" \\back",
    "--",
    "-",
    "--speculative-config-lookalike",
    os.fsdecode(b"not-utf8-\xff\xfe"),
]

ZLIB = next(
    p for p in (Path("/lib/x86_64-linux-gnu/libz.so.1"), Path("/usr/lib/libz.so.1")) if p.exists()
)
Launch = Callable[..., tuple[subprocess.CompletedProcess[str], dict[str, object]]]


def start(args: list[str], environ: dict[str, str]) -> tuple[int, subprocess.CompletedProcess[str]]:
    """Start the launcher and report the PID it started with and how it ended."""
    process = subprocess.Popen(
        [*LAUNCHER, *args], env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = process.communicate(timeout=120)
    return process.pid, subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_exec_keeps_pid_argv_and_maps_real_libiomp(
    tmp_path: Path, vllm_env: Path, record_file: Path, system_host: SystemHost
) -> None:
    vllm_args = ["serve", "model dir", "--speculative-config", NGRAM, *AWKWARD]
    environ = clean_environ(tmp_path, RECORD_TO=str(record_file))
    pid, result = start(["--vllm", str(vllm_env / "bin" / "vllm"), *vllm_args], environ)
    assert result.returncode == 0, result.stderr
    record = read_record(record_file)
    assert record["pid"] == pid  # exec: the launcher's process became vLLM
    assert record["argv"] == vllm_args
    library = str(vllm_env / "lib" / "libiomp5.so")
    assert record["LD_PRELOAD"] == system_host.preload(library)
    assert record["KMP_BLOCKTIME"] == "5"
    assert library in record["mapped"]  # type: ignore[operator]
    assert not any("libgomp" in m for m in record["mapped"])  # type: ignore[attr-defined]
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("vllm-cpu-launch: speculative decoding requested by")


def test_target_environment_beats_the_launchers_own(
    launch: Launch, vllm_env: Path, system_host: SystemHost
) -> None:
    """The launcher's venv has the wheel's libiomp5 too; vLLM's environment comes first."""
    own = Path(sys.prefix) / "lib" / "libiomp5.so"
    assert own.is_file()
    _, record = launch(["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m", "-sc", NGRAM])
    assert record["LD_PRELOAD"] == system_host.preload(vllm_env / "lib" / "libiomp5.so")


def test_launcher_environment_is_used_when_vllms_has_none(
    launch: Launch, tmp_path: Path, system_host: SystemHost
) -> None:
    environment = make_environment(tmp_path / "bare-env")
    vllm = install_recorder(environment)
    result, record = launch(["--vllm", str(vllm), "serve", "m", "-sc", NGRAM])
    assert result.returncode == 0, result.stderr
    assert record["LD_PRELOAD"] == system_host.preload(Path(sys.prefix) / "lib" / "libiomp5.so")


def test_callers_preload_and_blocktime_are_respected(
    launch: Launch, vllm_env: Path, tmp_path: Path, system_host: SystemHost
) -> None:
    # A real, harmless library of the caller's, under a name vLLM does not look for.
    other = shutil.copy2(ZLIB, tmp_path / "libcaller.so")
    result, record = launch(
        ["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m", "-sc", NGRAM],
        LD_PRELOAD=str(other),
        KMP_BLOCKTIME="200",
    )
    assert result.returncode == 0, result.stderr
    assert record["LD_PRELOAD"] == system_host.preload(vllm_env / "lib" / "libiomp5.so", other)
    assert record["KMP_BLOCKTIME"] == "200"
    assert str(other) in record["mapped"]  # type: ignore[operator]


def test_launching_the_launcher_through_itself_adds_nothing_twice(
    launch: Launch, vllm_env: Path, system_host: SystemHost
) -> None:
    vllm = str(vllm_env / "bin" / "vllm")
    inner = [*LAUNCHER, "--vllm", vllm, "serve", "m", "-sc", NGRAM]
    result, record = launch(["--vllm", vllm, "exec", "--", *inner])
    assert result.returncode == 0, result.stderr
    # The outer launch preloads the library of the program it starts (the launcher's own
    # Python); the inner one finds it in LD_PRELOAD and keeps it, adding no second one.
    assert record["LD_PRELOAD"] == system_host.preload(Path(sys.prefix) / "lib" / "libiomp5.so")
    assert record["argv"] == ["serve", "m", "-sc", NGRAM]


def test_without_sd_nothing_is_preloaded(launch: Launch, vllm_env: Path) -> None:
    result, record = launch(["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m"])
    assert result.returncode == 0, result.stderr
    assert record["LD_PRELOAD"] is None and record["KMP_BLOCKTIME"] is None
    assert not any("libiomp" in m for m in record["mapped"])  # type: ignore[attr-defined]
    assert "no speculative decoding requested" in result.stderr


def test_vllm_beside_the_launchers_python_is_found(tmp_path: Path, record_file: Path) -> None:
    """Default target: `vllm` in the launcher's own bin/ (same venv), before PATH."""
    environment = make_environment(tmp_path / "env")
    install_recorder(environment)
    environ = clean_environ(tmp_path, RECORD_TO=str(record_file), PATH="/usr/bin:/bin")
    python = environment / "bin" / "python"
    result = run_launcher(
        ["serve", "m", "-sc", NGRAM], environ, launcher=[str(python), "-m", "vllm_cpu_launch"]
    )
    assert result.returncode == 0, result.stderr
    assert read_record(record_file)["argv"] == ["serve", "m", "-sc", NGRAM]


def test_vllm_on_path(tmp_path: Path, vllm_env: Path, record_file: Path) -> None:
    environ = clean_environ(
        tmp_path, RECORD_TO=str(record_file), PATH=f"{vllm_env / 'bin'}:/usr/bin:/bin"
    )
    pid, result = start(["serve", "m", "-sc", NGRAM], environ)
    assert result.returncode == 0, result.stderr
    assert read_record(record_file)["pid"] == pid


def test_console_script(
    tmp_path: Path, vllm_env: Path, record_file: Path, system_host: SystemHost
) -> None:
    script = Path(sys.executable).parent / "vllm-cpu-launch"
    if not script.exists():
        pytest.fail(f"{script} missing: install the package (pip install -e .)")
    environ = clean_environ(tmp_path, RECORD_TO=str(record_file))
    args = ["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m", "-sc", NGRAM]
    result = run_launcher(args, environ, launcher=[str(script)])
    assert result.returncode == 0, result.stderr
    library = vllm_env / "lib" / "libiomp5.so"
    assert read_record(record_file)["LD_PRELOAD"] == system_host.preload(library)


def test_exit_status_is_vllms(launch: Launch, vllm_env: Path) -> None:
    result, _ = launch(["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m"], RECORD_EXIT="42")
    assert result.returncode == 42


def test_vllm_help_goes_to_vllm(launch: Launch, vllm_env: Path) -> None:
    result, record = launch(["--vllm", str(vllm_env / "bin" / "vllm"), "serve", "--help"])
    assert result.returncode == 0
    assert record["argv"] == ["serve", "--help"]


# -------------------- Formerly tests/test_hardening_exec.py --------------------
# Exec semantics: the launcher becomes the target. Same PID, the target's exit status,
# signals straight to the target, the caller's file descriptors kept, no helper process.


@pytest.fixture
def vllm(tmp_path: Path) -> Path:
    return fake_vllm(tmp_path / "env")


def wait_for(path: Path, process: subprocess.Popen[bytes]) -> None:
    """Until `path` exists (the target is ready); a hang guard, not a timing assertion."""
    deadline = time.monotonic() + GUARD
    while not path.exists():
        assert process.poll() is None, f"exited early with {process.returncode}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


# ------------------------------------------------------------------ exit status


@pytest.mark.parametrize("code", [0, 1, 42, 255])
def test_exit_status_is_the_targets(tmp_path: Path, vllm: Path, code: int) -> None:
    record = tmp_path / "record.json"
    environ = base_environ(tmp_path / "home", HARDENING_RECORD=str(record))
    environ["HARDENING_EXIT"] = str(code)
    result = run(["-q", "--vllm", str(vllm), "serve", "m", "-sc", NGRAM], environ)
    assert result.returncode == code, text(result.stderr)
    assert record.exists()


@pytest.mark.parametrize("number", [signal.SIGKILL, signal.SIGTERM, signal.SIGUSR1])
def test_death_by_signal_is_seen_by_the_caller(
    tmp_path: Path, vllm: Path, number: signal.Signals
) -> None:
    record = tmp_path / "record.json"
    environ = base_environ(tmp_path / "home", HARDENING_RECORD=str(record))
    environ["HARDENING_KILL"] = str(int(number))
    result = run(["-q", "--vllm", str(vllm), "serve", "m", "-sc", NGRAM], environ)
    assert result.returncode == -number, text(result.stderr)
    assert record.exists()


# ------------------------------------------------------------------ signals, one process


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_signals_to_the_launchers_pid_reach_the_target(
    tmp_path: Path, vllm: Path, number: signal.Signals
) -> None:
    record = tmp_path / "record.json"
    caught = tmp_path / "signal.txt"
    environ = base_environ(tmp_path / "home", HARDENING_RECORD=str(record))
    environ["HARDENING_SIGNALS"] = str(caught)
    before = children_of(os.getpid())
    process = subprocess.Popen(
        [*LAUNCHER, "-q", "--vllm", str(vllm), "serve", "m", "-sc", NGRAM],
        env=environ,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(record, process)
        data = read_plain_record(record)
        # One process: the PID the test started is the target itself, running the
        # vllm script (not the launcher), with no child of its own and no sibling.
        assert data["pid"] == process.pid
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[1] == os.fsencode(str(vllm)), cmdline
        assert b"vllm_cpu_launch" not in b" ".join(cmdline)
        assert children_of(process.pid) == set()
        assert children_of(os.getpid()) - before == {process.pid}
        process.send_signal(number)
        _, stderr = process.communicate(timeout=GUARD)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert caught.read_text() == number.name
    assert process.returncode == 128 + number, text(stderr)
    assert b"Traceback" not in stderr


def signal_sets(status: bytes) -> list[str]:
    """The ignored and blocked signal masks of a /proc/PID/status text."""
    return [line for line in status.decode().splitlines() if line.startswith(("SigIgn", "SigBlk"))]


def test_target_gets_the_signal_dispositions_it_would_get_directly(tmp_path: Path) -> None:
    """Python ignores SIGPIPE and SIGXFSZ; exec keeps ignored signals ignored. The target
    (cat, printing its own /proc/self/status) must see the same ignored and blocked sets
    as when the test starts it itself."""
    cat = shutil.which("cat")
    assert cat is not None
    link = tmp_path / "bin" / "vllm"  # a `vllm` that is cat, for the --vllm route
    link.parent.mkdir()
    link.symlink_to(cat)
    environ = base_environ(tmp_path / "home")
    direct = subprocess.run(
        [cat, "/proc/self/status"], env=environ, capture_output=True, timeout=GUARD, check=True
    )
    assert len(signal_sets(direct.stdout)) == 2
    for args in (["--vllm", str(link)], ["exec", "--", cat]):
        result = run(["-q", "--iomp", "never", *args, "/proc/self/status"], environ)
        assert result.returncode == 0, text(result.stderr)
        assert signal_sets(result.stdout) == signal_sets(direct.stdout)


def test_sigpipe_kills_a_program_writing_to_a_closed_pipe(tmp_path: Path) -> None:
    """What the default disposition means in practice: `launcher exec -- yes | head -1`
    ends because `yes` dies of SIGPIPE, instead of writing into the void with EPIPE."""
    launcher = shlex.join(LAUNCHER)
    command = f"{launcher} -q --iomp never exec -- yes | head -n 1; echo ${{PIPESTATUS[0]}}"
    result = subprocess.run(
        ["bash", "-c", command],
        env=base_environ(tmp_path / "home"),
        capture_output=True,
        timeout=GUARD,
        check=False,
    )
    assert result.stdout.decode().split() == ["y", str(128 + signal.SIGPIPE)], result


# ------------------------------------------------------------------ file descriptors


def test_socket_activation_fd_3_survives_the_exec(tmp_path: Path, vllm: Path) -> None:
    """systemd socket activation: a listening socket on fd 3, LISTEN_FDS=1, LISTEN_PID
    the service's PID. The target accepts a connection on fd 3 and answers with its PID.
    An extra pipe passed at another fd number is kept as well."""
    listener = socket.create_server(("127.0.0.1", 0))
    read_end, write_end = os.pipe()
    record = tmp_path / "record.json"
    environ = base_environ(tmp_path / "home", HARDENING_RECORD=str(record))
    environ.update(HARDENING_ACCEPT="1", HARDENING_PIPE_FD=str(write_end))
    # sh moves the socket from stdin to fd 3 and sets LISTEN_PID to its own PID, which
    # the launcher and then the target keep, since each execs the next.
    wrapper = 'exec 3<&0 0</dev/null; export LISTEN_FDS=1 LISTEN_PID=$$; exec "$@"'
    command = ["sh", "-c", wrapper, "sh", *LAUNCHER, "--vllm", str(vllm), "serve", "m"]
    process = subprocess.Popen(
        [*command, "-sc", NGRAM],
        env=environ,
        stdin=listener.fileno(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=(write_end,),
    )
    os.close(write_end)
    try:
        with socket.create_connection(listener.getsockname(), timeout=GUARD) as client:
            answer = b""
            while chunk := client.recv(1024):
                answer += chunk
        _, stderr = process.communicate(timeout=GUARD)
        piped = os.read(read_end, 1024)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        listener.close()
        os.close(read_end)
    assert process.returncode == 0, text(stderr)
    assert answer.decode() == f"pid {process.pid} listen_pid {process.pid}"
    assert piped.decode() == f"pipe from {process.pid}"
    data = read_plain_record(record)
    assert data["env"]["LISTEN_FDS"] == "1"
    assert data["fds"]["3"].startswith("socket:")
    assert data["env"]["LD_PRELOAD"] == str(vllm.parent.parent / "lib" / "libiomp5.so")
    assert record_argv(data) == [b"serve", b"m", b"-sc", NGRAM.encode()]


def test_the_launcher_leaks_no_descriptor_into_the_target(tmp_path: Path, vllm: Path) -> None:
    """The launcher opens libraries, scripts and config files; none may stay open."""
    record = tmp_path / "record.json"
    environ = base_environ(tmp_path / "home", HARDENING_RECORD=str(record))
    config = tmp_path / "launcher.yaml"
    config.write_text("kmp-blocktime: 7\n")
    args = ["--launcher-config", str(config), "--vllm", str(vllm), "serve", "m", "-sc", NGRAM]
    result = run(args, environ)
    assert result.returncode == 0, text(result.stderr)
    data = read_plain_record(record)
    assert data["fds"]["3"] is None and data["fds"]["4"] is None, data["fds"]
    assert data["env"]["KMP_BLOCKTIME"] == "7"
    assert str(REAL_IOMP) not in (data["fds"]["0"] or "")


# -------------------- Formerly tests/test_hardening_parallel.py --------------------
# Many at once: 50 launches started together plan alike and exec correctly.


COUNT = 50


def start_all(
    commands: list[list[str]], environs: list[dict[str, str]]
) -> list[tuple[int, int, bytes, bytes]]:
    """Start every command before waiting for any; (pid, exit code, stdout, stderr) each."""
    processes = [
        subprocess.Popen(
            command,
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for command, environ in zip(commands, environs, strict=True)
    ]
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=GUARD)  # hang guard
            results.append((process.pid, process.returncode, stdout, stderr))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def test_fifty_parallel_launches_plan_alike_and_exec(tmp_path: Path) -> None:
    vllm = fake_vllm(tmp_path / "env")
    environ = base_environ(tmp_path / "home")
    args = ["--vllm", str(vllm), "serve", "m", "-sc", NGRAM]

    plans = start_all([[*LAUNCHER, "--dry-run", "--json", *args]] * COUNT, [environ] * COUNT)
    assert all(code == 0 for _, code, _, _ in plans), [text(e) for _, _, _, e in plans]
    assert all(b"Traceback" not in stderr for _, _, _, stderr in plans)
    first = json.loads(plans[0][2])
    assert all(json.loads(stdout) == first for _, _, stdout, _ in plans)
    library = str(vllm.parent.parent / "lib" / "libiomp5.so")
    assert first["env"] == {
        "LD_PRELOAD": library,
        "KMP_BLOCKTIME": "5",
        "VLLMCPULAUNCH_PLANNED": "launcher:started",
    }

    records = [tmp_path / f"record-{index}.json" for index in range(COUNT)]
    launches = start_all(
        [[*LAUNCHER, "-q", *args, f"launch-{index}"] for index in range(COUNT)],
        [{**environ, "HARDENING_RECORD": str(record)} for record in records],
    )
    for index, (pid, code, _, stderr) in enumerate(launches):
        assert code == 0, text(stderr)
        assert b"Traceback" not in stderr
        data = read_plain_record(records[index])
        assert data["pid"] == pid
        assert record_argv(data) == [
            b"serve",
            b"m",
            b"-sc",
            NGRAM.encode(),
            f"launch-{index}".encode(),
        ]
        assert data["env"]["LD_PRELOAD"] == first["env"]["LD_PRELOAD"]
        assert data["env"]["KMP_BLOCKTIME"] == first["env"]["KMP_BLOCKTIME"]


# -------------------- PATH, HOME and closed streams: tests/test_hardening_environment.py
# Broken environments: each gives its exit code and one clear error line, no traceback.


def test_path_unset_still_starts_an_explicit_vllm(tmp_path: Path, vllm: Path) -> None:
    record = tmp_path / "record.json"
    environ = base_environ(tmp_path / "home", HARDENING_RECORD=str(record))
    del environ["PATH"]
    result = run(["--vllm", str(vllm), "serve", "m", "-sc", NGRAM], environ)
    assert result.returncode == 0, text(result.stderr)
    data = read_plain_record(record)
    assert record_argv(data) == [b"serve", b"m", b"-sc", NGRAM.encode()]
    assert data["env"]["PATH"] is None  # not invented for the target either
    assert data["env"]["LD_PRELOAD"] == str(vllm.parent.parent / "lib" / "libiomp5.so")


def test_home_and_xdg_unset_still_start(tmp_path: Path, vllm: Path) -> None:
    record = tmp_path / "record.json"
    environ = base_environ(tmp_path / "home", HARDENING_RECORD=str(record))
    del environ["HOME"], environ["XDG_CONFIG_HOME"]
    result = run(["--vllm", str(vllm), "serve", "m", "-sc", NGRAM], environ)
    assert result.returncode == 0, text(result.stderr)
    assert "Traceback" not in text(result.stderr)
    assert record_argv(read_plain_record(record))[:2] == [b"serve", b"m"]


CLOSE = {"stdin+stdout": "0<&- 1>&-", "all three": "0<&- 1>&- 2>&-"}


@pytest.mark.parametrize("closed", list(CLOSE))
def test_closed_standard_streams_still_exec(tmp_path: Path, vllm: Path, closed: str) -> None:
    """Started with fds closed, as some service managers do: the target still starts,
    with the same fds closed (the launcher leaves nothing of its own on them)."""
    record = tmp_path / "record.json"
    environ = base_environ(tmp_path / "home", HARDENING_RECORD=str(record))
    command = [
        "sh",
        "-c",
        f'exec {CLOSE[closed]} "$@"',
        "sh",
        *LAUNCHER,
        "--vllm",
        str(vllm),
        "serve",
        "m",
        "-sc",
        NGRAM,
    ]
    result = subprocess.run(command, env=environ, capture_output=True, timeout=GUARD, check=False)
    assert result.returncode == 0, text(result.stderr)
    data = read_plain_record(record)
    assert record_argv(data) == [b"serve", b"m", b"-sc", NGRAM.encode()]
    assert data["env"]["LD_PRELOAD"] == str(vllm.parent.parent / "lib" / "libiomp5.so")
    assert data["fds"]["0"] is None
    assert data["fds"]["1"] is None
    if closed == "all three":
        assert data["fds"]["2"] is None
    else:
        assert b"preloading" in result.stderr  # the INFO line still reached stderr


def test_closed_stderr_keeps_the_exit_code_of_an_error(tmp_path: Path) -> None:
    command = ["sh", "-c", 'exec 2>&- "$@"', "sh", *LAUNCHER, "--vllm", str(tmp_path / "nope")]
    result = subprocess.run(
        [*command, "serve", "m"],
        env=base_environ(tmp_path / "home"),
        capture_output=True,
        timeout=GUARD,
        check=False,
    )
    assert result.returncode == 127
    assert result.stdout == b""
