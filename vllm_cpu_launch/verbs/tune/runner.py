"""One benchmark run: started in its own session, bounded, killed with its processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
from typing import TYPE_CHECKING

from vllm_cpu_launch.cli import provide_metadata
from vllm_cpu_launch.errors import EXIT_PROBLEM, LaunchError, emit

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence, Sized

    from vllm_cpu_launch.plan import Plan
    from vllm_cpu_launch.verbs.tune.contest import Contender

KILL_WAIT_S = 30
LOG_TAIL_LINES = 15
VOCABULARY_HINT = (
    "vllm bench latency draws random prompt token ids below 10000; this model's vocabulary "
    "is smaller"
)


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the run's session (vLLM's engine core and workers too); bounded wait."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=KILL_WAIT_S)


def log_tail(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as stream:
        return stream.read().splitlines()[-LOG_TAIL_LINES:]


def start_logged(
    command: Sequence[str], log_path: str, environment: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """command in a session of its own (to be killed whole), its output into log_path."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
        )


def ended(stopped: str, done: Mapping[Contender, Sized], verb: str) -> None:
    """After the rounds: the time limit's warning, and nothing decided (exit 1) unless
    every contender `verb` (ran, started) at least once."""
    if stopped:
        emit("warning", f"{stopped}; using what was done")
    if not all(done.values()):
        raise LaunchError(
            EXIT_PROBLEM, f"{stopped}: not every candidate {verb} once; nothing decided"
        )


def run_once(plan: Plan, log_path: str, output_json: str, limit_s: float) -> float | None:
    """One benchmark run: the median of its latencies, or None when limit_s ran out (the
    run's whole session is killed). A failed run raises, with its log's last lines shown."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(output_json)

    provide_metadata(plan)
    process = start_logged(plan.command, log_path, {**os.environ, **dict(plan.env)})
    try:
        code = process.wait(timeout=max(limit_s, 0.0))
    except subprocess.TimeoutExpired:
        return None
    finally:
        kill_group(process)  # leftovers of a finished run, or all of an unfinished one
    latencies: object = None
    if code == 0:
        with contextlib.suppress(OSError, ValueError), open(output_json, encoding="utf-8") as f:
            latencies = json.load(f).get("latencies")
    if code == 0 and isinstance(latencies, list) and latencies:
        return float(statistics.median(float(value) for value in latencies))
    if code == 0:  # the log holds no error to show: the result is what is missing
        what = (
            f"its result file {output_json} holds no latencies"
            if os.path.exists(output_json)
            else f"wrote no result file ({output_json})"
        )
        raise LaunchError(
            EXIT_PROBLEM,
            f"vllm bench latency exited 0 but {what}; log: {log_path}",
            subject=os.path.dirname(log_path),
        )
    tail = log_tail(log_path)
    for line in tail:
        emit("error", f"  {line}")
    hint = f" ({VOCABULARY_HINT})" if any("out of vocabulary" in line for line in tail) else ""
    raise LaunchError(
        code if 0 < code < 256 else 128 - code if code < 0 else EXIT_PROBLEM,
        f"vllm bench latency failed (exit code {code}){hint}; log: {log_path}",
        subject=os.path.dirname(log_path),
    )
