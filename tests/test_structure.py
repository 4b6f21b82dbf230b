"""The package's shape: no function over 60 lines (issue 29), plan_of at most 40, and
each stage of the decision at most 50: what one reader holds in mind at once; and the
package's weight, which issue 35 cut from 11,503 lines to 8,782; no import cycle among
the package's modules, and a test file for each of them (issue 47)."""

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
    # Issue 47's structure (runtimes/, launch, records, elf, messages, the command record,
    # enums: +412) and issue 46's shape (+273) less tune's latency mode (-181): 9,275.
    # Issue 46's second stop: `servers N` (verbs/servers.py +454, verify's CPU check +41,
    # systemd-unit's template +9), whose the CPUs are (shape.py's watch +119, rules +39,
    # launch +31, plan +14, settings +9, doctor +7) and tune's busy-host line (+88).
    # Issue 46's third: shapes-1, a rule chosen by most paired rounds (rules +19, its
    # rendering in plan +6, the rules verb +3, --help +1).
    assert total <= 10_134


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.Import | ast.ImportFrom, modules: set[str]) -> set[str]:
    """The package's modules an import statement names (`from P import M`: M if a module)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & modules
    assert node.level == 0, "the package imports by absolute names"
    names = {f"{node.module}.{alias.name}" for alias in node.names}
    return (names & modules) or ({node.module or ""} & modules)


def import_graph() -> dict[str, set[str]]:
    """Each module of the package -> those it imports anywhere: at the top, inside a
    function (lazy), or for the type checker alone."""
    paths = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        statements = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        graph[name] = set().union(*(imported(n, modules) for n in statements)) - {name}
    return graph


def cycle_in(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of the graph as its modules in order (the first repeated at the end), or []."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str]:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return []
        for target in sorted(graph[name]):
            found = visit(target, [*path, name])
            if found:
                return found
        done.add(name)
        return []

    return next(filter(None, (visit(name, []) for name in sorted(graph))), [])


def test_the_package_imports_in_no_circle() -> None:
    """cli dispatches to the verbs, which stand on the launch core below both (issue 47:
    cli was dispatcher and core at once, a circle of nine files)."""
    graph = import_graph()
    assert "vllm_cpu_launch.verbs.env" in graph["vllm_cpu_launch.cli"]  # the lazy dispatch
    assert cycle_in(graph) == []


# Modules without a test file of their own, and why (issue 47: a test file per module).
UNTESTED_ALONE = {
    "__init__.py": "no code: the package's docstring and __version__ (tests/test_cli.py)",
    "verbs/__init__.py": "no code: the verbs' docstring",
    "__main__.py": "every CLI test runs `python -m vllm_cpu_launch` (tests/conftest.py LAUNCHER)",
    "runtimes/family.py": "the registry's interface, tested through tests/test_runtimes.py",
    "runtimes/gnu.py": "the registry's data, tested through tests/test_runtimes.py",
    "runtimes/intel.py": "the registry's data, tested through tests/test_runtimes.py",
    "runtimes/llvm.py": "the registry's data, tested through tests/test_runtimes.py",
}
# Test files not named by the rule: the top-level rules.py has tests/test_rules.py.
RENAMED = {"verbs/rules.py": "test_rules_verb.py"}


def its_test_file(module: Path) -> str:
    """vllm_cpu_launch/X.py -> test_X.py; verbs/X.py, verbs/X/__init__.py -> test_X.py;
    verbs/tune/X.py -> test_tune_X.py; runtimes/__init__.py -> test_runtimes.py."""
    parts = list(module.with_suffix("").parts)
    parts = parts[1:] if parts[0] == "verbs" else parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return RENAMED.get(module.as_posix(), f"test_{'_'.join(parts)}.py")


def test_every_package_module_has_its_test_file() -> None:
    tests = Path(__file__).parent
    modules = [path.relative_to(PACKAGE) for path in sorted(PACKAGE.rglob("*.py"))]
    assert set(UNTESTED_ALONE) <= {module.as_posix() for module in modules}
    missing = {
        module.as_posix(): its_test_file(module)
        for module in modules
        if module.as_posix() not in UNTESTED_ALONE and not (tests / its_test_file(module)).is_file()
    }
    assert missing == {}
