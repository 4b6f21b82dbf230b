"""The contest: rounds of runs in rotated order, each bounded and killed with its whole
session, and who won by the noise rule."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import time
from typing import TYPE_CHECKING, TypeVar

from vllm_cpu_launch.cli import provide_metadata
from vllm_cpu_launch.errors import EXIT_PROBLEM, LaunchError, emit, record
from vllm_cpu_launch.handoff import LD_PRELOAD
from vllm_cpu_launch.libraries import read_preload
from vllm_cpu_launch.settings import Mode

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence

    from vllm_cpu_launch.plan import Plan

T = TypeVar("T")
MIN_RUNS_FOR_A_WINNER = 2
# Rounds a contender must all win, in rotated order, to win on that alone (with fewer, its
# median must also beat the other's by more than the larger range).
ROUNDS_FOR_A_SWEEP = 3
KILL_WAIT_S = 30
LOG_TAIL_LINES = 15
VOCABULARY_HINT = (
    "vllm bench latency draws random prompt token ids below 10000; this model's vocabulary "
    "is smaller"
)
# What goes with a runtime rather than besides it: its own block time, and the mark.
RUNTIME_VARIABLES = ("KMP_BLOCKTIME", "VLLMCPULAUNCH_PLANNED")


@record
class Contender:
    """One --iomp value tune measures (a candidate, to the user), by its runtime's name."""

    name: str  # libgomp | libiomp5
    iomp: Mode  # the --iomp value that makes it


CONTENDERS = (Contender("libgomp", Mode.NEVER), Contender("libiomp5", Mode.ALWAYS))
GOMP, IOMP = CONTENDERS


@record
class Summary:
    """One contender's runs, in the order they ran: each run's median latency (`vllm bench
    latency`), or its mean time per output token (`vllm bench serve`): lower is faster."""

    contender: Contender
    runs: tuple[float, ...]
    unit: str = "s"

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def spread(self) -> float:
        """The range of the runs' medians: with 2-5 rounds, quartiles understate the noise."""
        return max(self.runs) - min(self.runs)


@record
class Outcome:
    """What a tune found: the winner, what --write stores, and the result line."""

    winner: Contender | None  # None: no clear winner (or too few runs)
    iomp: Mode  # what --write stores: the winner's --iomp when it is not the default, else auto
    result: str  # one line: who was faster, by how much, against what spread


def rotated(items: Sequence[Contender], rounds: int) -> Iterator[tuple[int, Contender]]:
    """(round, contender) for every round, the order rotated by one each round, so that
    drift on the machine spreads over all contenders (as scripts/bench_stats.py does)."""
    for round_index in range(rounds):
        shift = round_index % len(items)
        for item in [*items[shift:], *items[:shift]]:
            yield round_index, item


def outcome_of(summaries: Sequence[Summary], default: Contender) -> Outcome:
    """The rule of the help text: a winner ran faster in every round, ROUNDS_FOR_A_SWEEP
    or more; with fewer, its median also beats the other's by more than the larger range.
    A round's runs are a pair, run back to back, so drift on the machine hits both alike."""
    fast, slow = sorted(summaries, key=lambda s: s.median)
    if min(len(s.runs) for s in summaries) < MIN_RUNS_FOR_A_WINNER:
        return Outcome(None, Mode.AUTO, "fewer than 2 runs each, no noise estimate: default kept")
    pairs = list(zip(fast.runs, slow.runs, strict=False))  # the time limit may cut a round
    won, rounds = sum(1 for mine, theirs in pairs if mine < theirs), len(pairs)
    unit = fast.unit
    measured = (
        f"{fast.contender.name} won {won} of {rounds} rounds; median {fast.median:.4g} {unit} "
        f"vs {slow.median:.4g} {unit} for {slow.contender.name}, spread {fast.spread:.3g} "
        f"{unit} and {slow.spread:.3g} {unit}"
    )
    beyond_noise = slow.median - fast.median > max(fast.spread, slow.spread)
    if won < rounds or (rounds < ROUNDS_FOR_A_SWEEP and not beyond_noise):
        return Outcome(None, Mode.AUTO, f"no clear winner: {measured}")
    winner = fast.contender
    iomp = Mode.AUTO if winner == default else winner.iomp
    ratio = slow.median / fast.median
    return Outcome(
        winner, iomp, f"{winner.name} {ratio:.2f}x faster than {slow.contender.name}: {measured}"
    )


def table(summaries: Sequence[Summary]) -> str:
    """Median, quartiles and range of the runs' median latencies; speed against libgomp."""
    base = next(s.median for s in summaries if s.contender == GOMP)
    lines = [
        f"{'candidate':<10} {'--iomp':<7} {'runs':>4} {'median s':>10} {'q1-q3 s':>17} "
        f"{'min-max s':>17} {'speed vs libgomp':>17}"
    ]
    for s in summaries:
        q1, q3 = s.runs[0], s.runs[0]
        if len(s.runs) > 1:
            q1, _, q3 = statistics.quantiles(s.runs, n=4, method="inclusive")
        lines.append(
            f"{s.contender.name:<10} {s.contender.iomp:<7} {len(s.runs):>4} {s.median:>10.4f} "
            f"{f'{q1:.4f}-{q3:.4f}':>17} {f'{min(s.runs):.4f}-{max(s.runs):.4f}':>17} "
            f"{f'{base / s.median:.2f}x':>17}"
        )
    return "\n".join(lines)


def besides_runtime(envs: Mapping[str, Mapping[str, str]], inherited: str) -> str:
    """One line: the contenders differ in the OpenMP runtime only, or what else differs
    (a rule may add tcmalloc or a binding to one of them), so a result is read as what it
    measured."""
    found = {}
    for name, env in envs.items():
        entries = read_preload(env.get(LD_PRELOAD, inherited))
        added = [f"preloads {e.path}" for e in entries if not e.kind.runtime]
        skip = (LD_PRELOAD, *RUNTIME_VARIABLES)
        found[name] = added + [f"sets {k}={v}" for k, v in env.items() if k not in skip]
    common = set.intersection(*(set(items) for items in found.values()))
    differing = {name: [i for i in items if i not in common] for name, items in found.items()}
    if not any(differing.values()):
        return "compared:  the OpenMP runtime only (and its KMP_BLOCKTIME)"
    said = [
        f"{name} {', '.join(items) or 'adds nothing else'}" for name, items in differing.items()
    ]
    return f"compared:  the OpenMP runtime and more: {'; '.join(said)}"


def run_rounds(
    rounds: int,
    limit_s: float,
    noun: tuple[str, str],
    attempt: Callable[[str, Contender, float], tuple[T, str] | None],
    say: Callable[[str], None],
) -> dict[Contender, list[T]]:
    """Each contender's results, round by round in rotated order, within the limit (exit 1
    unless each ran once). attempt(name, contender, deadline) gives a result and its
    progress line, or None when the deadline came first; noun: ("run", "ran") or the like."""
    done: dict[Contender, list[T]] = {c: [] for c in CONTENDERS}
    order = list(rotated(CONTENDERS, rounds))
    deadline = time.monotonic() + limit_s
    stopped = ""
    for number, (round_index, contender) in enumerate(order, 1):
        this = f"{noun[0]} {number}/{len(order)}"
        if time.monotonic() >= deadline:
            stopped = f"time limit of {limit_s:g} s reached before {this}"
            break
        started = time.monotonic()
        result = attempt(f"{number:02d}-{contender.name}", contender, deadline)
        if result is None:
            stopped = f"time limit of {limit_s:g} s reached during {this} (killed)"
            break
        done[contender].append(result[0])
        took = f"{time.monotonic() - started:.0f} s"
        say(f"{this} (round {round_index + 1}/{rounds}) {contender.name}: {result[1]} ({took})")
    if stopped:
        emit("warning", f"{stopped}; using what was done")
    if not all(done.values()):
        raise LaunchError(
            EXIT_PROBLEM, f"{stopped}: not every candidate {noun[1]} once; nothing decided"
        )
    return done


def start_logged(
    command: Sequence[str], log_path: str, plan: Plan | None = None
) -> subprocess.Popen[bytes]:
    """command in a session of its own (to be killed whole), its output into log_path; with
    plan, in its environment."""
    environment = None
    if plan is not None:
        provide_metadata(plan)
        environment = {**os.environ, **dict(plan.env)}
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
        )


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the run's session (vLLM's engine core and workers too); bounded wait."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=KILL_WAIT_S)


def run_child(
    command: Sequence[str], log_path: str, result: str, deadline: float, plan: Plan | None = None
) -> int | None:
    """The exit code of command, which writes result, or None when the deadline came first;
    its whole session is killed either way (the leftovers of a finished run too)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(result)
    process = start_logged(command, log_path, plan)
    try:
        return process.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        return None
    finally:
        kill_group(process)


def failed(what: str, log_path: str, code: int = 0, vocabulary: bool = False) -> LaunchError:
    """A child's failure, its log named and kept: a non-zero exit shows the log's last lines
    and keeps vLLM's exit code; an exit 0 without its result is EXIT_PROBLEM."""
    tail: list[str] = []
    if code:
        with open(log_path, encoding="utf-8", errors="replace") as stream:
            tail = stream.read().splitlines()[-LOG_TAIL_LINES:]
        for line in tail:
            emit("error", f"  {line}")
        what += f" (exit code {code})"
    if vocabulary and any("out of vocabulary" in line for line in tail):
        what += f" ({VOCABULARY_HINT})"
    return LaunchError(
        code if 0 < code < 256 else 128 - code if code < 0 else EXIT_PROBLEM,
        f"{what}; log: {log_path}",
        subject=os.path.dirname(log_path),
    )


def run_once(plan: Plan, log_path: str, output_json: str, deadline: float) -> float | None:
    """One `vllm bench latency` run: the median of its latencies, or None when the deadline
    came first. A failed run raises, with its log's last lines shown."""
    code = run_child(plan.command, log_path, output_json, deadline, plan)
    if code:
        raise failed("vllm bench latency failed", log_path, code, vocabulary=True)
    if code is None:
        return None
    latencies: object = None
    with contextlib.suppress(OSError, ValueError), open(output_json, encoding="utf-8") as f:
        latencies = json.load(f).get("latencies")
    if isinstance(latencies, list) and latencies:
        return float(statistics.median(float(value) for value in latencies))
    what = (  # the log holds no error to show: the result is what is missing
        f"its result file {output_json} holds no latencies"
        if os.path.exists(output_json)
        else f"wrote no result file ({output_json})"
    )
    raise failed(f"vllm bench latency exited 0 but {what}", log_path)


def latency_contest(
    plans: Mapping[Contender, Plan],
    rounds: int,
    limit_s: float,
    workdir: str,
    iterations: int,
    say: Callable[[str], None],
) -> list[Summary]:
    """Each contender's run latencies, round by round in rotated order, within the limit."""
    output_json = os.path.join(workdir, "latency.json")

    def attempt(name: str, contender: Contender, deadline: float) -> tuple[float, str] | None:
        log_path = os.path.join(workdir, f"{name}.log")
        latency = run_once(plans[contender], log_path, output_json, deadline)
        if latency is None:
            return None
        return latency, f"median latency {latency:.4f} s over {iterations} iterations"

    runs = run_rounds(rounds, limit_s, ("run", "ran"), attempt, say)
    return [Summary(c, tuple(runs[c])) for c in CONTENDERS]
