"""Who won, by the noise rule, and the table of the runs."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from vllm_cpu_launch.records import record

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence


MIN_RUNS_FOR_A_WINNER = 2


@record
class Candidate:
    name: str  # libgomp | libiomp5
    iomp: str  # the --iomp value that makes it


CANDIDATES = (Candidate("libgomp", "never"), Candidate("libiomp5", "always"))


@record
class Summary:
    """One candidate's runs: each run's median latency (seconds), in the order they ran."""

    candidate: Candidate
    runs: tuple[float, ...]

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
class Verdict:
    winner: Candidate | None  # None: within the noise (or too few runs)
    iomp: str  # what --write stores: the winner's --iomp when it is not the default, else auto
    result: str  # one line: who was faster, by how much, against what spread


def rotated(items: Sequence[Candidate], rounds: int) -> Iterator[tuple[int, Candidate]]:
    """(round, candidate) for every round, the order rotated by one each round, so that
    drift on the machine spreads over all candidates (as scripts/bench_stats.py does)."""
    for round_index in range(rounds):
        shift = round_index % len(items)
        for item in [*items[shift:], *items[:shift]]:
            yield round_index, item


# ---------------------------------------------------------------- the verdict


def decide(summaries: Sequence[Summary], default: Candidate) -> Verdict:
    """The noise rule of the help text: a winner must beat the other by more than the
    larger of the two ranges, with MIN_RUNS_FOR_A_WINNER runs each."""
    ranked = sorted(summaries, key=lambda s: s.median)
    fast, slow = ranked[0], ranked[-1]
    if min(len(s.runs) for s in summaries) < MIN_RUNS_FOR_A_WINNER:
        return Verdict(None, "auto", "fewer than 2 runs each, no noise estimate: default kept")
    noise = max(fast.spread, slow.spread)
    ratio = slow.median / fast.median
    comparison = f"{fast.candidate.name} {ratio:.2f}x faster than {slow.candidate.name}"
    if slow.median - fast.median <= noise:
        return Verdict(
            None, "auto", f"within the noise, default kept: {comparison}, spread {noise:.3g} s"
        )
    winner = fast.candidate
    iomp = "auto" if winner == default else winner.iomp
    return Verdict(winner, iomp, f"{comparison}, spread {noise:.3g} s")


def table(summaries: Sequence[Summary], baseline: str = "libgomp") -> str:
    """Median, quartiles and range of the runs' median latencies; speed against libgomp."""
    base = next((s.median for s in summaries if s.candidate.name == baseline), None)
    lines = [
        f"{'candidate':<10} {'--iomp':<7} {'runs':>4} {'median s':>10} {'q1-q3 s':>17} "
        f"{'min-max s':>17} {'speed vs ' + baseline:>17}"
    ]
    for s in summaries:
        q1, q3 = s.quartiles
        speed = f"{base / s.median:.2f}x" if base else "-"
        lines.append(
            f"{s.candidate.name:<10} {s.candidate.iomp:<7} {len(s.runs):>4} {s.median:>10.4f} "
            f"{f'{q1:.4f}-{q3:.4f}':>17} {f'{min(s.runs):.4f}-{max(s.runs):.4f}':>17} {speed:>17}"
        )
    return "\n".join(lines)
