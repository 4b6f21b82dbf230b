"""Exec semantics: the launcher becomes the target. Same PID, the target's exit status,
signals straight to the target, the caller's file descriptors kept, no helper process."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .hardening_support import (
    GUARD,
    LAUNCHER,
    NGRAM,
    REAL_IOMP,
    base_environ,
    children_of,
    fake_vllm,
    read_record,
    record_argv,
    run,
    text,
)


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
        data = read_record(record)
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
    data = read_record(record)
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
    data = read_record(record)
    assert data["fds"]["3"] is None and data["fds"]["4"] is None, data["fds"]
    assert data["env"]["KMP_BLOCKTIME"] == "7"
    assert str(REAL_IOMP) not in (data["fds"]["0"] or "")
