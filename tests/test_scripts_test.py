"""`scripts/test --quick`, run as a developer runs it: it says what it is about to make and
what each of its pytest sessions covers before it does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

SCRIPT = REPO / "scripts" / "test"
# One quick test that is system_host: both of the quick run's sessions run it. Its module
# is named too, so that each session collects that module, not the whole suite.
ONE_TEST = "test_a_deprecated_variable_name_is_read_and_said_once"
ONE_MODULE = "tests/test_cli.py"


def developer_environ(venv: Path) -> dict[str, str]:
    """This shell's environment, without what pytest or the tests' host set in it."""
    environ = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST_", "VLLMCPULAUNCH_"))
    }
    return {**environ, "VLLMCPULAUNCH_TEST_VENV": str(venv)}


def test_the_venv_it_creates_is_said_first_with_its_size_and_how_to_move_it(
    tmp_path: Path,
) -> None:
    """Once 700 MB made without a word. A venv that cannot be made (under /proc) stops the
    run right after the line, so nothing is installed here."""
    venv = Path("/proc/no-such-process/venv")
    result = subprocess.run(
        [str(SCRIPT), "--quick"],
        env=developer_environ(venv),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert result.stdout.splitlines() == [
        f"scripts/test: creating the test venv {venv} (about 700 MB: the launcher with its "
        "test, dev and bench extras; VLLMCPULAUNCH_TEST_VENV=DIR puts it elsewhere)"
    ]


def linked_venv(root: Path) -> Path:
    """A venv that is this suite's own, by links (its Python through a wrapper, so that it
    finds its own prefix), with a pip that installs nothing: reinstalling the package into
    the venv this suite runs from would pull it from under the tests running beside."""
    bin_directory = root / "bin"
    bin_directory.mkdir(parents=True)
    (bin_directory / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_directory / "pip").write_text("#!/bin/sh\nexit 0\n")
    for tool in ("python", "pip"):
        (bin_directory / tool).chmod(0o755)
    for tool in ("ruff", "mypy", "lint-imports", "actionlint", "check-jsonschema"):
        (bin_directory / tool).symlink_to(Path(sys.executable).parent / tool)
    return root


@pytest.mark.skipif(
    os.environ.get("VLLMCPULAUNCH_TEST_INSTALLED") == "1",
    reason="scripts/test lints and types a checkout; the sdist's tree under scripts/dist_check "
    "test has its package removed (the installed one is tested)",
)
def test_each_pytest_session_of_the_quick_run_is_said_before_it_runs(tmp_path: Path) -> None:
    """Once two pytest sessions with no word of what each covers. Where the developer's
    shell says PYTHONDONTWRITEBYTECODE, the bytecode still goes to the venv (not the tree):
    the launchers' and pytest's rewritten test modules."""
    venv = linked_venv(tmp_path / "venv")
    result = subprocess.run(
        [str(SCRIPT), "--quick", ONE_MODULE, "-k", ONE_TEST, "-p", "no:cacheprovider", "-n", "0"],
        env={**developer_environ(venv), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    said = [line for line in result.stdout.splitlines() if line.startswith("scripts/test: ")]
    quick = "not real_vllm and not image and not installers and not bench"
    assert said == [
        "scripts/test: the quick tier: every test but the real-vLLM, image, installer and "
        f'benchmark ones (-m "{quick}"), on a host with Debian\'s allocators',
        "scripts/test: the quick tier's system_host tests again, on a host without system "
        "allocators (what a plan adds from the system's libraries)",
    ]
    # Each line comes before its session's own summary, and each session ran the test.
    summaries = [m.start() for m in re.finditer(r"^=+ 2 passed", result.stdout, re.MULTILINE)]
    first, second = (result.stdout.index(line) for line in said)
    assert len(summaries) == 2 and first < summaries[0] < second < summaries[1]
    assert "creating the test venv" not in result.stdout  # it exists: nothing is made
    cache = venv / "pycache"
    assert list(cache.rglob("vllm_cpu_launch/cli.*.pyc")), "no launcher bytecode in the venv"
    assert list(cache.rglob("tests/test_cli.*-pytest-*.pyc")), "no rewritten test module"
