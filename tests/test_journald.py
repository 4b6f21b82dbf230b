"""Under systemd (JOURNAL_STREAM names stderr), messages carry sd-daemon priorities.

The launcher runs for real with its stderr a real file; JOURNAL_STREAM is that file's
`st_dev:st_ino` (as systemd sets it for a stream connected to journald), or another
file's, in which case the lines stay plain text.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, clean_environ

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
