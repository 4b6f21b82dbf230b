"""Many at once: 50 launches started together plan alike and exec correctly."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .hardening_support import (
    GUARD,
    LAUNCHER,
    NGRAM,
    base_environ,
    fake_vllm,
    read_record,
    record_argv,
    text,
)

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
        data = read_record(records[index])
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
