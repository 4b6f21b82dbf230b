"""Who won, by the noise rule, and the table of the runs."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import record
from vllm_cpu_launch.handoff import LD_PRELOAD
from vllm_cpu_launch.libraries import read_preload
from vllm_cpu_launch.settings import Mode

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence


MIN_RUNS_FOR_A_WINNER = 2
# Rounds a contender must all win, in rotated order, to win on that alone (with fewer, its
# median must also beat the other's by more than the larger range).
ROUNDS_FOR_A_SWEEP = 3


@record
class Contender:
    """One --iomp value tune measures (a candidate, to the user), by its runtime's name."""

    name: str  # libgomp | libiomp5
    iomp: Mode  # the --iomp value that makes it


CONTENDERS = (Contender("libgomp", Mode.NEVER), Contender("libiomp5", Mode.ALWAYS))


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
    def quartiles(self) -> tuple[float, float]:
        if len(self.runs) < 2:
            return self.runs[0], self.runs[0]
        q1, _, q3 = statistics.quantiles(self.runs, n=4, method="inclusive")
        return q1, q3

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


# ---------------------------------------------------------------- the outcome


def rounds_won(fast: Summary, slow: Summary) -> tuple[int, int]:
    """(rounds `fast` ran faster in, rounds both ran in): a round's runs are a pair, run
    back to back in rotated order, so drift on the machine hits both alike."""
    pairs = list(zip(fast.runs, slow.runs, strict=False))  # the time limit may cut a round
    return sum(1 for mine, theirs in pairs if mine < theirs), len(pairs)


def outcome_of(summaries: Sequence[Summary], default: Contender) -> Outcome:
    """The rule of the help text: a winner ran faster in every round, ROUNDS_FOR_A_SWEEP
    or more; with fewer (MIN_RUNS_FOR_A_WINNER at least), its median also beats the
    other's by more than the larger range. The result says what was measured either way,
    and "faster" only of a winner."""
    ranked = sorted(summaries, key=lambda s: s.median)
    fast, slow = ranked[0], ranked[-1]
    if min(len(s.runs) for s in summaries) < MIN_RUNS_FOR_A_WINNER:
        return Outcome(None, Mode.AUTO, "fewer than 2 runs each, no noise estimate: default kept")
    won, rounds = rounds_won(fast, slow)
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


def table(summaries: Sequence[Summary], baseline: str = "libgomp") -> str:
    """Median, quartiles and range of the runs' median latencies; speed against libgomp."""
    base = next((s.median for s in summaries if s.contender.name == baseline), None)
    lines = [
        f"{'candidate':<10} {'--iomp':<7} {'runs':>4} {'median s':>10} {'q1-q3 s':>17} "
        f"{'min-max s':>17} {'speed vs ' + baseline:>17}"
    ]
    for s in summaries:
        q1, q3 = s.quartiles
        speed = f"{base / s.median:.2f}x" if base else "-"
        lines.append(
            f"{s.contender.name:<10} {s.contender.iomp:<7} {len(s.runs):>4} {s.median:>10.4f} "
            f"{f'{q1:.4f}-{q3:.4f}':>17} {f'{min(s.runs):.4f}-{max(s.runs):.4f}':>17} {speed:>17}"
        )
    return "\n".join(lines)


# What goes with a runtime rather than besides it: its own block time, and the mark.
RUNTIME_VARIABLES = ("KMP_BLOCKTIME", "VLLMCPULAUNCH_PLANNED")


def extras(env: Mapping[str, str], inherited: str) -> list[str]:
    """What a contender's environment adds besides its OpenMP runtime: the other
    LD_PRELOAD entries (tcmalloc), and every other variable it sets."""
    entries = read_preload(env.get(LD_PRELOAD, inherited))
    added = [f"preloads {e.path}" for e in entries if not e.kind.runtime]
    added += [f"sets {k}={v}" for k, v in env.items() if k not in (LD_PRELOAD, *RUNTIME_VARIABLES)]
    return added


def besides_runtime(envs: Mapping[str, Mapping[str, str]], inherited: str) -> str:
    """One line: the contenders differ in the OpenMP runtime only, or what else differs
    (a rule may add tcmalloc or a binding to one of them), so a result is read as what it
    measured."""
    found = {name: extras(env, inherited) for name, env in envs.items()}
    common = set.intersection(*(set(items) for items in found.values()))
    differing = {name: [i for i in items if i not in common] for name, items in found.items()}
    if not any(differing.values()):
        return "compared:  the OpenMP runtime only (and its KMP_BLOCKTIME)"
    said = [
        f"{name} {', '.join(items) or 'adds nothing else'}" for name, items in differing.items()
    ]
    return f"compared:  the OpenMP runtime and more: {'; '.join(said)}"
