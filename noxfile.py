"""The launcher's tests on every Python it claims (setup.cfg's python_requires), one nox
session per version: `nox` runs all four, `nox -s tests-3.10` one, `nox -s tests-3.12 --
tests/test_cli.py -k help` a selection. scripts/test runs them (docs/testing.md).

Each session is a fresh venv of that Python with this checkout and its `test` extra, and
runs by default the tests of the launcher's command line and plan, which start it as fresh
processes of that Python (what a user's `python3.X -m vllm_cpu_launch` meets): import-time
differences between versions show there and nowhere else.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
# The launcher's command line, its exec and its plan, each test a fresh launcher process.
CLI_AND_PLAN = [
    "tests/test_cli.py",
    "tests/test_launch.py",
    "tests/test_plan.py",
    "tests/test_command.py",
    "tests/test_target.py",
    "tests/test_settings.py",
]

nox.options.sessions = ["tests"]
nox.options.error_on_missing_interpreters = True  # a Python we claim and cannot test fails


def pyenv_pythons() -> list[str]:
    """The bin directories of pyenv's builds of PYTHONS (newest patch of each), where
    pyenv installed them: nox looks for `python3.X` on PATH."""
    versions = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    found = []
    for python in PYTHONS:
        builds = sorted(
            (p for p in versions.glob(f"{python}.*") if (p / "bin" / f"python{python}").exists()),
            key=lambda p: tuple(int(part) for part in p.name.split(".") if part.isdigit()),
        )
        if builds:
            found.append(str(builds[-1] / "bin"))
    return found


os.environ["PATH"] = os.pathsep.join([*pyenv_pythons(), os.environ.get("PATH", "")])


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """The CLI and plan tests (or the pytest arguments given after --) on one Python."""
    session.install("--quiet", "--disable-pip-version-check", "-e", ".[test]")
    arguments = session.posargs or CLI_AND_PLAN
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *arguments)
