"""tune's serving rounds: one start of each contender a round, rotated, measured at every
concurrency; the outcome per concurrency by the rule of the latency benchmark, and a
winner only where it won at every concurrency."""

from __future__ import annotations

import os
import statistics
import time
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import record
from vllm_cpu_launch.settings import Mode
from vllm_cpu_launch.verbs.tune.contest import CONTENDERS, Outcome, Summary, outcome_of, rotated
from vllm_cpu_launch.verbs.tune.runner import ended
from vllm_cpu_launch.verbs.tune.serving import LOOPBACK, free_port, serve_once, server_arguments

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from vllm_cpu_launch.plan import Plan
    from vllm_cpu_launch.verbs.tune.contest import Contender
    from vllm_cpu_launch.verbs.tune.serving import Load, Reading


@record
class LoadOutcome:
    """The tune's outcome over every concurrency, and each concurrency's own."""

    overall: Outcome
    at: tuple[tuple[int, Outcome], ...]

    def iomp_at(self) -> dict[int, Mode]:
        """What each concurrency alone says to set (the record keeps it)."""
        return {concurrency: outcome.iomp for concurrency, outcome in self.at}


def run_rounds(
    plan_for: Callable[[Contender, Sequence[str]], Plan],
    serve: Sequence[str],
    client: Callable[[Sequence[str], str, int, str], list[str]],
    load: Load,
    rounds: int,
    limit_s: float,
    workdir: str,
    say: Callable[[str], None],
) -> dict[Contender, list[list[Reading]]]:
    """Each contender's starts, each a list of readings by concurrency, within the limit.
    `client(program, url, concurrency, result)` is the client's command; `program` is what
    the plan runs vLLM as (the command before the arguments)."""
    starts: dict[Contender, list[list[Reading]]] = {c: [] for c in CONTENDERS}
    order = list(rotated(CONTENDERS, rounds))
    deadline = time.monotonic() + limit_s
    stopped = ""
    for number, (round_index, contender) in enumerate(order, 1):
        if time.monotonic() >= deadline:
            stopped = f"time limit of {limit_s:g} s reached before start {number}/{len(order)}"
            break
        port = free_port()
        arguments, _ = server_arguments(serve, port)
        plan = plan_for(contender, arguments)
        url = f"http://{LOOPBACK}:{port}"
        logs = os.path.join(workdir, f"{number:02d}-{contender.name}")
        started = time.monotonic()
        program = plan.command[: len(plan.command) - len(arguments)]

        def command(
            concurrency: int, result: str, program: Sequence[str] = program, url: str = url
        ) -> list[str]:
            return client(program, url, concurrency, result)

        readings = serve_once(plan, command, url, load, logs, deadline)
        if readings is None:
            stopped = (
                f"time limit of {limit_s:g} s reached during start {number}/{len(order)} (killed)"
            )
            break
        starts[contender].append(readings)
        figures = ", ".join(
            f"at {r.concurrency}: {r.tpot_ms:.2f} ms/token, {r.output_tps:.1f} tokens/s"
            for r in readings
        )
        say(
            f"start {number}/{len(order)} (round {round_index + 1}/{rounds}) {contender.name}: "
            f"{figures} ({time.monotonic() - started:.0f} s)"
        )
    ended(stopped, starts, "started")
    return starts


def summaries_at(starts: Mapping[Contender, list[list[Reading]]], index: int) -> list[Summary]:
    """Each contender's TPOT per round at the index-th concurrency."""
    return [
        Summary(c, tuple(readings[index].tpot_ms for readings in starts[c]), "ms/token")
        for c in CONTENDERS
    ]


def outcome_at_load(
    starts: Mapping[Contender, list[list[Reading]]], load: Load, default: Contender
) -> LoadOutcome:
    """Today's rule at each concurrency; a winner overall only where the same contender
    won at every one (the default kept otherwise)."""
    at = tuple(
        (concurrency, outcome_of(summaries_at(starts, index), default))
        for index, concurrency in enumerate(load.concurrencies)
    )
    winners = {outcome.winner for _, outcome in at}
    levels = ", ".join(str(c) for c in load.concurrencies)
    if len(winners) == 1 and None not in winners:
        winner = at[0][1].winner
        assert winner is not None
        iomp = Mode.AUTO if winner == default else winner.iomp
        return LoadOutcome(
            Outcome(winner, iomp, f"{winner.name} won at every concurrency ({levels})"), at
        )
    said = "; ".join(f"at {c}: {v.winner.name if v.winner else 'no clear winner'}" for c, v in at)
    return LoadOutcome(
        Outcome(None, Mode.AUTO, f"no candidate won at every concurrency ({said})"), at
    )


def table_at(
    concurrency: int, index: int, starts: Mapping[Contender, list[list[Reading]]], load: Load
) -> list[str]:
    """One concurrency's table: TPOT (median, range), output tokens/s, drafts accepted,
    speed against libgomp."""
    base = statistics.median(r[index].tpot_ms for r in starts[CONTENDERS[0]])
    lines = [
        f"concurrency {concurrency} ({load.requests(concurrency)} requests of "
        f"{load.output_len} tokens a start)",
        f"  {'candidate':<10} {'--iomp':<7} {'rounds':>6} {'TPOT ms':>9} {'min-max ms':>13} "
        f"{'tokens/s':>9} {'accepted':>15} {'speed vs libgomp':>17}",
    ]
    for contender in CONTENDERS:
        runs = [readings[index] for readings in starts[contender]]
        tpots = [r.tpot_ms for r in runs]
        median = statistics.median(tpots)
        drafted, accepted = sum(r.drafted for r in runs), sum(r.accepted for r in runs)
        drafts = f"{accepted}/{drafted}" if drafted else "none drafted"
        lines.append(
            f"  {contender.name:<10} {contender.iomp:<7} {len(runs):>6} {median:>9.2f} "
            f"{f'{min(tpots):.2f}-{max(tpots):.2f}':>13} "
            f"{statistics.median(r.output_tps for r in runs):>9.1f} {drafts:>15} "
            f"{base / median:>16.2f}x"
        )
    return lines


def report_lines(
    starts: Mapping[Contender, list[list[Reading]]], load: Load, outcome: LoadOutcome
) -> list[str]:
    """Every concurrency's table and its result line."""
    lines = []
    for index, (concurrency, at) in enumerate(outcome.at):
        lines += table_at(concurrency, index, starts, load)
        lines.append(f"  result at {concurrency}: {at.result}")
    return lines
