"""The messages the launcher prints (vllm_cpu_launch/messages.py): each one true where it
appears, and sd-daemon priorities under systemd. One section per subject; the sections
name the files they were.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_cpu_launch.handoff import PLANNED_VARIABLE, PLUGIN_VARIABLE, stands_down

from .conftest import (
    LAUNCHER,
    REPO,
    SystemHost,
    bare_system,
    clean_environ,
    install_recorder,
    read_record,
    run_launcher,
)

# -------------------- Formerly tests/test_messages.py --------------------
# Each message true where it appears (issue 21, point 8): the launcher run as a fresh
# process, as a user runs it, for every message the review found untrue or missing.


NGRAM = '{"method":"ngram","num_speculative_tokens":3}'


def launched(tmp_path: Path, args: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    return run_launcher(args, clean_environ(tmp_path, **extra))


def errors(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if "error:" in line]


def test_env_starts_nothing_and_says_so(tmp_path: Path, vllm_env: Path) -> None:
    vllm = str(vllm_env / "bin" / "vllm")
    result = launched(tmp_path, ["--vllm", vllm, "env", "serve", "m"])
    assert result.returncode == 0, result.stderr
    (line,) = result.stderr.splitlines()
    assert line == "vllm-cpu-launch: no speculative decoding requested; nothing to set"
    started = launched(tmp_path, ["--vllm", vllm, "serve", "m"], RECORD_TO=str(tmp_path / "r"))
    assert f"starting {vllm} unchanged" in started.stderr  # a launch does start it


def test_strict_prints_one_error_line_with_the_fix(tmp_path: Path, vllm_env: Path) -> None:
    """The one error is the missing library's own message, whose consequence is the
    refusal (not "vLLM will use glibc's malloc": nothing starts)."""
    vllm = str(vllm_env / "bin" / "vllm")
    args = ["--strict", "--tcmalloc", "always", "--vllm", vllm, "serve", "m", "-sc", NGRAM]
    record = str(tmp_path / "record.json")
    result = launched(tmp_path, args, RECORD_TO=record, **bare_system(tmp_path))
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    (line,) = errors(result)
    assert line.startswith("vllm-cpu-launch: error: tcmalloc not found (searched ")
    assert "; --strict: not starting. Fix: " in line
    assert "glibc" not in line
    assert not (tmp_path / "record.json").exists()
    unstrict = launched(tmp_path, args[1:], RECORD_TO=record, **bare_system(tmp_path))
    assert unstrict.returncode == 0 and "vLLM will use glibc's malloc" in unstrict.stderr


def test_a_file_that_is_no_program_gets_no_chmod_advice(tmp_path: Path) -> None:
    data = tmp_path / "passwd"
    data.write_text("root:x:0:0:root:/root:/bin/bash\n")
    for args in (["--vllm", str(data), "serve", "m"], ["exec", "--", str(data)]):
        result = launched(tmp_path, args)
        assert result.returncode == 126, result.stderr
        (line,) = result.stderr.splitlines()
        assert "neither a #! script nor an ELF executable" in line and "chmod +x" not in line


def test_an_executable_file_that_is_no_program_is_refused_before_the_exec(tmp_path: Path) -> None:
    """With the x bit set, execve would fail with "Exec format error" after the INFO line
    said what it preloads (issue 35, defect 8): refused first, as without the x bit."""
    data = tmp_path / "notes"
    data.write_text("not a program\n")
    data.chmod(0o755)
    sd = ["-sc", NGRAM]
    for args in (
        ["--vllm", str(data), "serve", "m", *sd],
        ["--iomp", "always", "exec", "--", str(data)],
    ):
        result = launched(tmp_path, args)
        assert result.returncode == 126, result.stderr
        (line,) = result.stderr.splitlines()
        assert line.startswith("vllm-cpu-launch: error: ") and "preloading" not in line
        assert "neither a #! script nor an ELF executable, so the kernel cannot run it" in line
        assert "chmod" not in line


def test_a_path_with_a_line_break_is_named_on_one_line(tmp_path: Path) -> None:
    """A message is one line whatever the input holds (issue 35, defect 8): the line break
    is shown as the escape a user can read back."""
    result = launched(tmp_path, ["--vllm", f"{tmp_path}/vllm\n", "serve", "m"])
    assert result.returncode == 127, result.stderr
    (line,) = result.stderr.splitlines()
    assert line == f"vllm-cpu-launch: error: vLLM executable {tmp_path}/vllm\\n does not exist"


def test_a_script_without_the_x_bit_gets_the_chmod_that_fixes_it(
    tmp_path: Path, vllm_env: Path, record_file: Path
) -> None:
    script = install_recorder(vllm_env, "vllm-copy")
    script.chmod(0o644)
    args = ["-q", "--vllm", str(script), "serve", "m"]
    result = launched(tmp_path, args, RECORD_TO=str(record_file))
    (line,) = result.stderr.splitlines()
    assert result.returncode == 126 and line.endswith(f"fix it with: chmod +x {script}")
    subprocess.run(shlex.split(line.rpartition("fix it with: ")[2]), check=True, timeout=60)
    result = launched(tmp_path, args, RECORD_TO=str(record_file))
    assert (result.returncode, result.stderr) == (0, "")
    assert read_record(record_file)["argv"] == ["serve", "m"]


def test_exec_names_the_programs_environment_not_vllms(tmp_path: Path) -> None:
    environ = clean_environ(tmp_path)
    program = shutil.which("true", path=environ["PATH"])
    assert program is not None
    result = run_launcher(["-v", "exec", "--", "true"], environ)
    assert result.returncode == 0, result.stderr
    assert "vLLM's environment" not in result.stderr
    assert f"{program}'s environment: " in result.stderr


def test_doctor_writes_settings_as_they_are_set_and_names_a_missing_vllm_once(
    tmp_path: Path,
) -> None:
    result = launched(tmp_path, ["doctor"], PATH=str(tmp_path / "empty"))
    assert result.returncode == 0, result.stderr
    assert "strict=no" in result.stdout and "strict=False" not in result.stdout
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("vLLM ")]
    assert line.startswith("vLLM       none to start: vllm not found: looked beside")
    assert result.stdout.count("not found") == result.stdout.count("vllm not found")
    strict = launched(tmp_path, ["doctor"], PATH=str(tmp_path / "empty"), VLLMCPULAUNCH_STRICT="1")
    assert "strict=yes" in strict.stdout


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["docter"], "unknown verb 'docter': did you mean doctor?"),
        (["verfy", "1"], "unknown verb 'verfy': did you mean verify?"),
        (["--iomp-pth", "/x.so", "serve", "m"], "'--iomp-pth' (did you mean --iomp-path?)"),
        (["--stric", "serve", "m"], "'--stric' (did you mean --strict?)"),
        (["doctor", "--jsno"], "'--jsno' for doctor (did you mean --json?)"),
        (["env", "--fromat", "json", "serve", "m"], "(did you mean --format?)"),
    ],
)
def test_a_typo_gets_a_did_you_mean(
    tmp_path: Path, vllm_env: Path, args: list[str], hint: str
) -> None:
    result = launched(tmp_path, args, VLLMCPULAUNCH_VLLM=str(vllm_env / "bin" / "vllm"))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("vllm-cpu-launch: error: ") and hint in line


def test_vllms_own_words_pass_on_without_a_guess(
    tmp_path: Path, vllm_env: Path, record_file: Path
) -> None:
    """vLLM's subcommands, an unknown word after `--` (the did-you-mean's way out), and
    vLLM's options put too early are not taken for a typo of ours."""
    vllm = str(vllm_env / "bin" / "vllm")
    for argv in (["chat"], ["collect-env"], ["run-batch", "-i", "x"], ["--", "docter"]):
        result = launched(tmp_path, ["-q", "--vllm", vllm, *argv], RECORD_TO=str(record_file))
        assert (result.returncode, result.stderr) == (0, ""), argv
        assert read_record(record_file)["argv"] == [a for a in argv if a != "--"]
    for option in ("--speculative-config", "--config", "--model"):
        result = launched(tmp_path, ["--vllm", vllm, option, "x", "serve", "m"])
        assert "did you mean" not in result.stderr and "after the subcommand" in result.stderr


EMPTY_VARIABLES = (
    "VLLMCPULAUNCH_IOMP",
    "VLLMCPULAUNCH_IOMP_PATH",
    "VLLMCPULAUNCH_TCMALLOC",
    "VLLMCPULAUNCH_TCMALLOC_PATH",
    "VLLMCPULAUNCH_KMP_BLOCKTIME",
    "VLLMCPULAUNCH_VLLM",
    "VLLMCPULAUNCH_STRICT",
    "VLLMCPULAUNCH_CONFIG",
    PLUGIN_VARIABLE,
    "VLLM_CPU_LAUNCH_IOMP_PATH",  # the deprecated names alike, and no deprecation warning
    "VLLM_CPU_LAUNCH_STRICT",
)


def test_an_empty_variable_of_ours_is_the_same_as_an_unset_one(
    tmp_path: Path, vllm_env: Path
) -> None:
    args = ["--dry-run", "--json", "--vllm", str(vllm_env / "bin" / "vllm"), "serve", "m"]
    for sd in ([], ["-sc", NGRAM]):
        unset = launched(tmp_path, [*args, *sd])
        assert unset.returncode == 0, unset.stderr
        for variable in EMPTY_VARIABLES:
            empty = launched(tmp_path, [*args, *sd], **{variable: ""})
            assert (empty.returncode, empty.stderr) == (0, unset.stderr), variable
            assert empty.stdout == unset.stdout, variable
    # vLLM's plugin reads its switch the same way: empty leaves it on.
    assert stands_down({PLUGIN_VARIABLE: ""}, "x86_64", spawned=False) is None
    assert stands_down({PLUGIN_VARIABLE: "0"}, "x86_64", spawned=False) is not None


def test_modes_are_read_in_any_case_as_yes_no_values_are(tmp_path: Path, vllm_env: Path) -> None:
    vllm = str(vllm_env / "bin" / "vllm")
    config = tmp_path / "launcher.yaml"
    config.write_text("tcmalloc: Never\n")
    base = ["--dry-run", "--json", "--vllm", vllm]
    expected = launched(tmp_path, [*base, "--iomp", "always", "--tcmalloc", "never", "serve", "m"])
    assert expected.returncode == 0, expected.stderr
    for args, extra, named in (
        (["--iomp", "ALWAYS", "--tcmalloc", "NEVER"], {}, "--iomp always"),
        (
            ["--launcher-config", str(config)],
            {"VLLMCPULAUNCH_IOMP": "Always"},
            "VLLMCPULAUNCH_IOMP=always",
        ),
    ):
        result = launched(tmp_path, [*base, *args, "serve", "m"], **extra)
        assert result.returncode == 0, result.stderr
        plan, same = json.loads(result.stdout), json.loads(expected.stdout)
        assert plan.pop("reason") == named  # the same plan, said with where iomp came from
        assert same.pop("reason") == "--iomp always" and plan == same
    strict = launched(tmp_path, [*base, "serve", "m"], VLLMCPULAUNCH_STRICT="YES")
    assert strict.returncode == 0, strict.stderr


def test_a_speculators_model_in_a_config_file_requests_sd(
    tmp_path: Path, vllm_env: Path, system_host: SystemHost
) -> None:
    model = tmp_path / "eagle"
    model.mkdir()
    speculators = {"algorithm": "eagle3", "proposal_methods": []}
    (model / "config.json").write_text(json.dumps({"speculators_config": speculators}))
    config = tmp_path / "vllm.yaml"
    config.write_text(f"model: {model}\nport: 8001\n")
    args = ["--dry-run", "--json", "--vllm", str(vllm_env / "bin" / "vllm")]
    result = launched(tmp_path, [*args, "serve", "--config", str(config)])
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["speculative"]["requested"] is True
    assert plan["speculative"]["source"] == f"{model}/config.json (speculators_config)"
    assert [p["kind"] for p in plan["preload"]] == system_host.kinds("iomp")


def test_every_env_format_carries_the_plans_mark_the_shell_too(
    tmp_path: Path, vllm_env: Path
) -> None:
    """`eval "$(vllm-cpu-launch env --iomp never ...)"` then `vllm serve` is one program
    started with the plan, as a unit's is: once the shell left the mark out, and vLLM's
    plugin then preloaded Intel OpenMP against the plan's `--iomp never`. Every format
    carries the mark now, with the value the plan (json) has; the plugin's first check,
    in a process started from that shell, leaves the plan standing."""
    environ = clean_environ(tmp_path)
    options = ["--iomp", "never", "--vllm", str(vllm_env / "bin" / "vllm")]
    sd = ["serve", "m", "-sc", NGRAM]
    plan = run_launcher(["env", "--format", "json", *options, *sd], environ)
    mark = json.loads(plan.stdout)["env"][PLANNED_VARIABLE]
    assert mark == "launcher"
    plugin = "import os; from vllm_cpu_launch.handoff import stands_down as s; "
    plugin += "print(s(os.environ, 'x86_64', spawned=False))"
    shell = (
        f'eval "$({shlex.join([*LAUNCHER, "env", *options, *sd])})" && '
        f'echo "${{{PLANNED_VARIABLE}-unset}}" && {shlex.join([*LAUNCHER[:1], "-c", plugin])}'
    )
    result = subprocess.run(
        ["bash", "-c", shell], env=environ, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        mark,
        f"{PLANNED_VARIABLE}={mark}: started with a plan already",
    ]
    for output_format in ("systemd", "docker", "kubernetes"):
        result = run_launcher(["env", "--format", output_format, *options, *sd], environ)
        assert result.returncode == 0, result.stderr
        assert PLANNED_VARIABLE in result.stdout and mark in result.stdout, output_format
    help_text = run_launcher(["env", "--help"], environ).stdout
    assert "Every format carries the plan's mark" in help_text


def test_doctor_sizes_the_kv_cache_with_vllms_option_not_its_legacy_variable(
    tmp_path: Path, vllm_env: Path
) -> None:
    """vLLM 0.32 reads VLLM_CPU_KVCACHE_SPACE as a legacy setting
    (CpuPlatform.check_and_update_config); --kv-cache-memory-bytes is the option."""
    vllm = str(vllm_env / "bin" / "vllm")
    result = launched(tmp_path, ["--vllm", vllm, "doctor", "--json"])
    assert result.returncode == 0, result.stderr
    (advice,) = [
        a for a in json.loads(result.stdout)["recommendations"] if a["id"] == "kvcache-space"
    ]
    assert "--kv-cache-memory-bytes" in advice["text"]
    assert "VLLM_CPU_KVCACHE_SPACE" not in advice["text"] + advice["command"]
    result = launched(tmp_path, ["--vllm", vllm, "doctor", "--json"], VLLM_CPU_KVCACHE_SPACE="x")
    (advice,) = [
        a for a in json.loads(result.stdout)["recommendations"] if a["id"] == "kvcache-space"
    ]
    assert "legacy" in advice["text"] and "--kv-cache-memory-bytes" in advice["text"]


# -------------------- Formerly tests/test_journald.py --------------------
# Under systemd (JOURNAL_STREAM names stderr), messages carry sd-daemon priorities.
#
# The launcher runs for real with its stderr a real file; JOURNAL_STREAM is that file's
# `st_dev:st_ino` (as systemd sets it for a stream connected to journald), or another
# file's, in which case the lines stay plain text.


GOMP = "/usr/lib/x86_64-linux-gnu/libgomp.so.1"


def stream_id(path: Path) -> str:
    status = os.stat(path)
    return f"{status.st_dev}:{status.st_ino}"


def run_with_stderr_file(
    tmp_path: Path, args: list[str], journal_stream_of: Path | None, **extra: str
) -> tuple[int, list[str]]:
    log = tmp_path / "stderr.log"
    log.touch()
    environ = clean_environ(tmp_path, **extra)
    if journal_stream_of is not None:
        environ["JOURNAL_STREAM"] = stream_id(journal_stream_of)
    with open(log, "wb") as stderr:
        code = subprocess.run(
            [sys.executable, "-m", "vllm_cpu_launch", *args],
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            timeout=120,
            check=False,
            cwd=REPO,
        ).returncode
    return code, log.read_text().splitlines()


# iomp is preloaded for exec; a libgomp entry in LD_PRELOAD is dropped with a warning.
EXEC_TRUE = ["exec", "--", "/bin/true"]


def test_priorities_when_stderr_is_the_journal_stream(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    log.touch()
    code, lines = run_with_stderr_file(tmp_path, EXEC_TRUE, log, LD_PRELOAD=GOMP)
    assert code == 0
    assert lines[0].startswith("<4>vllm-cpu-launch: warning: removed " + GOMP), lines
    assert lines[1].startswith("<6>vllm-cpu-launch: exec preloads Intel OpenMP"), lines
    code, lines = run_with_stderr_file(tmp_path, ["--iomp", "sometimes", *EXEC_TRUE], log)
    assert code == 2
    assert lines == [
        "<3>vllm-cpu-launch: error: --iomp: 'sometimes' is not one of auto, always, never"
    ]


def test_plain_text_when_journal_stream_is_another_file(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.touch()
    code, lines = run_with_stderr_file(tmp_path, EXEC_TRUE, other, LD_PRELOAD=GOMP)
    assert code == 0
    assert lines[0].startswith("vllm-cpu-launch: warning: removed " + GOMP), lines
    assert lines[1].startswith("vllm-cpu-launch: exec preloads Intel OpenMP"), lines
    assert not any(line.startswith("<") for line in lines)


def test_plain_text_without_journal_stream(tmp_path: Path) -> None:
    code, lines = run_with_stderr_file(tmp_path, EXEC_TRUE, None)
    assert code == 0
    assert lines and lines[0].startswith("vllm-cpu-launch: exec preloads Intel OpenMP"), lines


def test_priorities_through_a_pipe(tmp_path: Path) -> None:
    """journald connects a stream socket; a pipe's inode identifies it the same way."""
    read_end, write_end = os.pipe()
    status = os.fstat(write_end)
    environ = clean_environ(tmp_path, JOURNAL_STREAM=f"{status.st_dev}:{status.st_ino}")
    with os.fdopen(read_end, "rb") as reader:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm_cpu_launch", *EXEC_TRUE],
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=write_end,
            cwd=REPO,
        )
        os.close(write_end)
        output = reader.read().decode()
        assert process.wait(timeout=120) == 0
    assert output.startswith("<6>vllm-cpu-launch: exec preloads Intel OpenMP"), output
