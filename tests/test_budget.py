"""scripts/test_budget.py on the JUnit XML a real pytest run writes, with xdist as CI runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .test_benchmarks import run_script

# A module whose module-scoped fixture takes at least 0.3 s, a test class beside its
# functions, and a second module: what CI's reports hold, in small.
SLOW_MODULE = """
import time
import pytest

@pytest.fixture(scope="module")
def server():
    time.sleep(0.3)

def test_first(server):
    pass

def test_second(server):
    pass

class TestInAClass:
    def test_third(self):
        pass
"""
QUICK_MODULE = "def test_alone():\n    pass\n"


def junit_report(tmp_path: Path) -> Path:
    """The report of a real pytest run (two xdist workers, each module on one) of a tiny
    package of tests."""
    package = tmp_path / "suite" / "tests"
    (package / "e2e").mkdir(parents=True)
    for init in (package / "__init__.py", package / "e2e" / "__init__.py"):
        init.write_text("", encoding="utf-8")
    (package / "e2e" / "test_slow.py").write_text(SLOW_MODULE, encoding="utf-8")
    (package / "test_quick.py").write_text(QUICK_MODULE, encoding="utf-8")
    report = tmp_path / "report.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    command += ["--dist", "loadfile", f"--junitxml={report}", "tests"]
    completed = subprocess.run(
        command, cwd=package.parent, capture_output=True, text=True, timeout=300, check=False
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return report


def test_each_module_gets_its_tests_and_seconds_with_its_fixtures(tmp_path: Path) -> None:
    report = junit_report(tmp_path)
    output = run_script("test_budget.py", f"real vLLM={report}", f"other={tmp_path / 'none.xml'}")
    rows = [line.split(" | ") for line in output.splitlines()[2:]]
    (slow, quick, total) = [[cell.strip("| ") for cell in row] for row in rows]
    # The costliest first; the class's test counts in its module; the fixture's 0.3 s in it.
    assert slow[:3] == ["real vLLM", "tests/e2e/test_slow.py", "3"] and float(slow[3]) >= 0.3
    assert quick[:3] == ["real vLLM", "tests/test_quick.py", "1"]
    assert total[:3] == ["real vLLM", "all", "4"]
    assert abs(float(total[3]) - float(slow[3]) - float(quick[3])) <= 0.11  # each rounded


def test_a_tier_without_a_report_is_said_and_a_broken_one_is_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.xml"
    broken.write_text("<testsuites><testsuite>", encoding="utf-8")
    script = Path(__file__).resolve().parent.parent / "scripts" / "test_budget.py"
    for arguments, code, said in (
        ([f"nothing={tmp_path / 'none.xml'}"], 0, "no report for nothing"),
        ([f"broken={broken}"], 1, f"test_budget: error: cannot read {broken}"),
        (["no-equals-sign"], 1, "'no-equals-sign' is not TIER=REPORT.xml"),
    ):
        completed = subprocess.run(
            [sys.executable, str(script), *arguments],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert completed.returncode == code and said in completed.stderr, completed.stderr
        assert "Traceback" not in completed.stderr
