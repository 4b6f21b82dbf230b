"""The Pythons the launcher claims are the ones CI tests (issue 23): setup.cfg's floor and
classifiers, the nox sessions scripts/test runs, and what the README says, in agreement."""

from __future__ import annotations

import ast
import configparser
import re

from tests.conftest import REPO


def nox_pythons() -> list[str]:
    """noxfile.PYTHONS, read without importing the noxfile (it changes PATH on import)."""
    tree = ast.parse((REPO / "noxfile.py").read_text(encoding="utf-8"))
    (value,) = (
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(target, "id", None) for target in node.targets] == ["PYTHONS"]
    )
    pythons: list[str] = ast.literal_eval(value)
    return pythons


def test_what_is_claimed_is_what_nox_tests_and_the_readme_says() -> None:
    pythons = nox_pythons()
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg", encoding="utf-8")
    floor = setup["options"]["python_requires"].strip()
    classified = re.findall(r"Python :: (3\.\d+)$", setup["metadata"]["classifiers"], re.M)
    assert floor == f">={pythons[0]}" and classified == pythons
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    *first, last = pythons
    claim = f"**Python {pythons[0]} or newer** (CI runs its command line and plan on "
    assert f"{claim}{', '.join(first)} and {last}:" in readme
