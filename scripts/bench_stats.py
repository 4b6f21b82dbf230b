"""How the benchmarks measure and summarise: interleaved rounds, unpolled timing, spread, ratios.

Every benchmark runs each configuration once per round, in an order rotated every round,
so that drift on a shared machine spreads over all of them; it reports medians with their
quartiles and compares configurations of the same run by ratios of medians.
Standard library only; scripts import it as a sibling module.
"""

from __future__ import annotations

import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
Item = TypeVar("Item")


def interleaved(items: Sequence[Item], rounds: int) -> Iterator[tuple[int, Item]]:
    """(round index, item) for `rounds` rounds of every item once, the order rotated by one
    each round, so that no item always goes first or always follows the same other one."""
    for round_index in range(rounds):
        shift = round_index % len(items)
        for item in [*items[shift:], *items[:shift]]:
            yield round_index, item


def wait_unpolled(process: subprocess.Popen[Any], limit_s: float) -> int:
    """The process's exit code once it exits; killed after limit_s.

    Not wait(timeout=...): that polls with growing sleeps (0.5, 1, 2, 4 ... ms) and would
    round every measurement up to those steps. A watchdog thread bounds the wait instead.
    """
    watchdog = threading.Timer(limit_s, process.kill)
    watchdog.start()
    try:
        return process.wait()
    finally:
        watchdog.cancel()


def timed_run(
    command: Sequence[str],
    limit_s: float,
    env: Mapping[str, str] | None,
    *,
    cwd: Path | None = None,
    stdout: int | IO[Any] = subprocess.DEVNULL,
    stderr: int | IO[Any] = subprocess.DEVNULL,
) -> tuple[int, float]:
    """(exit code, wall seconds from spawn to exit) of command, stdin closed, killed after
    limit_s (see wait_unpolled)."""
    started = time.perf_counter()
    process = subprocess.Popen(
        list(command),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env=None if env is None else dict(env),
        cwd=cwd,
    )
    code = wait_unpolled(process, limit_s)
    return code, time.perf_counter() - started


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); one value is all three."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def ratio_line(name: str, what: str, value: float | str, digits: int = 2) -> str:
    """`ratio NAME (WHAT): VALUE`, VALUE with `digits` decimals (or why there is none)."""
    shown = value if isinstance(value, str) else f"{value:.{digits}f}"
    return f"ratio {name} ({what}): {shown}"


def rerun_line(script: str, arguments: Sequence[str]) -> str:
    """`rerun: cd REPO && PYTHON scripts/SCRIPT ARGUMENTS`: how to run this benchmark again."""
    rerun = [sys.executable, f"scripts/{script}", *arguments]
    return f"rerun: cd {REPO} && {shlex.join(rerun)}"
