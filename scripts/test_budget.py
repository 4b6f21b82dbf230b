#!/usr/bin/env python3
"""What each test module cost in a run of scripts/test: the budget of docs/testing.md.

Reads the JUnit XML reports pytest wrote (`--junitxml`, one per tier; pytest-xdist merges
its workers' into one) and prints, per module, its tests and the seconds they took,
setup, call and teardown together (pytest's default `junit_duration_report = total`): a
module-scoped fixture, the vLLM server of a real-vLLM module, counts in its first test.
The seconds are a worker's, not the run's wall time: modules of one tier run side by side.

    python scripts/test_budget.py "tests without vLLM=LOG/quick.xml" "real vLLM=LOG/vllm.xml"

A report that is missing or unreadable (a tier that did not run) is said in one line and
left out. Standard library only.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from script_cli import ScriptError, exit_code, narrator

say = narrator("test_budget")


@dataclass(frozen=True)
class ModuleCost:
    tier: str
    module: str  # tests/e2e/test_plugin.py
    tests: int
    seconds: float


def module_of(classname: str) -> str:
    """The test file of a JUnit classname: `tests.e2e.test_plugin` (or
    `tests.test_cli.TestHelp`, a test class in it) is tests/e2e/test_plugin.py."""
    parts = classname.split(".")
    last = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts) - 1)
    return "/".join(parts[: last + 1]) + ".py"


def module_costs(tier: str, report: Path) -> list[ModuleCost]:
    """Every module of one JUnit report with its tests and seconds, the costliest first."""
    try:
        root = ElementTree.parse(report).getroot()
    except (OSError, ElementTree.ParseError) as error:
        raise ScriptError(f"cannot read {report}: {error}") from None
    tests: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for case in root.iter("testcase"):
        module = module_of(case.get("classname", ""))
        tests[module] = tests.get(module, 0) + 1
        seconds[module] = seconds.get(module, 0.0) + float(case.get("time") or 0)
    costs = [ModuleCost(tier, module, tests[module], seconds[module]) for module in tests]
    return sorted(costs, key=lambda cost: (-cost.seconds, cost.module))


def table(costs: Sequence[ModuleCost]) -> str:
    """The budget as the Markdown table docs/testing.md keeps, with each tier's total."""
    lines = ["| tier | module | tests | seconds |", "|---|---|---|---|"]
    for tier in dict.fromkeys(cost.tier for cost in costs):
        mine = [cost for cost in costs if cost.tier == tier]
        lines += [f"| {tier} | {c.module} | {c.tests} | {c.seconds:.1f} |" for c in mine]
        total = sum(cost.seconds for cost in mine)
        lines.append(f"| {tier} | all | {sum(c.tests for c in mine)} | {total:.1f} |")
    return "\n".join(lines)


def parse_reports(arguments: Sequence[str]) -> list[tuple[str, Path]]:
    """`TIER=REPORT` arguments as (tier, path)."""
    reports = []
    for argument in arguments:
        tier, equals, path = argument.partition("=")
        if not equals or not tier or not path:
            raise ScriptError(f"{argument!r} is not TIER=REPORT.xml")
        reports.append((tier, Path(path)))
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv

    def report() -> None:
        costs = []
        for tier, path in parse_reports(arguments):
            if not path.is_file():
                say(f"no report for {tier} ({path}): that tier did not run")
                continue
            costs += module_costs(tier, path)
        print(table(costs))

    return exit_code("test_budget", report)


if __name__ == "__main__":
    raise SystemExit(main())
