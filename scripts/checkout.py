"""This checkout, as something to build or install the package from.

setuptools writes build/ and *.egg-info into the tree it builds from, and leaves them: two
builds from one tree at once (pytest workers, nox sessions, a benchmark beside the tests)
can package each other's half-written files, a wheel without its entry points among them,
and a build after a module was removed still finds it in build/. So whatever builds or
installs the package builds it from a copy of the checkout's own files.
Standard library only; scripts and tests import it as a sibling module.
"""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What a checkout holds that is no part of it: version control, built or local state.
LOCAL = (".git", ".venv*", ".nox", ".*_cache", ".hypothesis", "__pycache__")
BUILT = ("build", "dist", "*.egg-info")
NOT_CHECKOUT = shutil.ignore_patterns(*LOCAL, *BUILT)


def checkout_copy(directory: Path, source: Path = REPO) -> Path:
    """This checkout's files (or those of `source`, a project in it: the tests' probe
    plugin) copied into `directory` (which must not exist); `directory`."""
    shutil.copytree(source, directory, ignore=NOT_CHECKOUT)
    return directory
