"""The package's shape: no function over 60 lines (issue 29), plan_of at most 40, and
each stage of the decision at most 50: what one reader holds in mind at once; and the
package's weight, which issue 35 cut from 11,503 lines to 8,782."""

from __future__ import annotations

import ast
from pathlib import Path

from vllm_cpu_launch import plan as decide

# The package under test: the checkout's, or the installed one (scripts/dist_check test).
PACKAGE = Path(decide.__file__).parent


def lengths() -> dict[str, int]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{path.relative_to(PACKAGE.parent)}:{node.name}"
                found[name] = (node.end_lineno or node.lineno) - node.lineno + 1
    return found


def test_no_function_in_the_package_is_over_60_lines() -> None:
    assert {name: n for name, n in lengths().items() if n > 60} == {}


def test_plan_of_and_every_stage_are_short() -> None:
    found = lengths()
    assert found["vllm_cpu_launch/plan.py:plan_of"] <= 40
    stages = {f"vllm_cpu_launch/plan.py:{stage.__name__}" for stage in decide.STAGES}
    assert {name: found[name] for name in stages if found[name] > 50} == {}


def test_the_package_keeps_the_weight_issue_35_cut() -> None:
    """A ratchet, not a target: a change that needs more lines raises it in its own diff."""
    files = sorted(PACKAGE.rglob("*.py"))
    total = sum(len(path.read_text(encoding="utf-8").splitlines()) for path in files)
    assert total <= 8_819  # issue 45's additions paid for by doctor --measure's move (47)
