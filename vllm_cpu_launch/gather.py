"""The plan's facts: everything it reads of the target, the host and the caller, read here
once, so that the decision (plan.py) is pure over them. The release window and the metadata
a vllm-cpu install lacks: docs/design.md ("Release", "The vllm metadata"), docs/releases.md.
"""

from __future__ import annotations

import os
from contextlib import suppress
from itertools import takewhile
from types import MappingProxyType
from typing import TYPE_CHECKING

from vllm_cpu_launch.elf import Library
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.handoff import Planner
from vllm_cpu_launch.libraries import IOMP, TCMALLOC, Finding, examine_entry, find_library
from vllm_cpu_launch.messages import StrEnum
from vllm_cpu_launch.records import record, replace
from vllm_cpu_launch.runtimes import INTEL, opt_in_on, preloadable, preloaded_on
from vllm_cpu_launch.settings import Mode, choose, launch_scope
from vllm_cpu_launch.target import site_packages
from vllm_cpu_launch.trust import insecure_reason, owners

if TYPE_CHECKING:
    from collections.abc import Mapping

    from vllm_cpu_launch.command import SpeculativeRequest, VllmCommand
    from vllm_cpu_launch.libraries import Host, Search
    from vllm_cpu_launch.settings import Scope, Settings, Tuned
    from vllm_cpu_launch.target import Target

WINDOW = ((0, 20), (0, 34))  # first and last minor release the plan holds for, as read
FIRST, LAST = (".".join(map(str, edge)) for edge in WINDOW)  # as said: "0.20", "0.34"
V1_SD_REFUSED = (0, 9, 1)  # from here until WINDOW[0], the CPU model runner refuses SD
RELEASES_DOC = "docs/releases.md"


class ReleaseStatus(StrEnum):
    """Where the installed vLLM release stands against the releases the plan was read for."""

    WINDOW = "window"
    OLDER = "older"
    NEWER = "newer"
    UNKNOWN = "unknown"  # no dist-info names one


@record
class Support:
    release: str | None  # as installed ("0.32.0"), None when no dist-info names one
    status: ReleaseStatus
    note: str


def version_key(version: str) -> tuple[int, ...]:
    """(0, 32, 0) for '0.32.0', '0.32.0+cpu' or '0.9.0.post2'; () for what is no version."""
    return tuple(int(part) for part in takewhile(str.isdigit, version.split("+")[0].split(".")))


def target_release(target: Target | None) -> str | None:
    """A `pip install --user` vLLM's user base first (first on sys.path), then its prefix."""
    return vllm_release(target.user_base, target.prefix) if target else None


def vllm_release(*prefixes: str | None) -> str | None:
    """The version of the first `vllm-cpu` (else `vllm`) dist-info under `prefixes`: a `vllm`
    beside `vllm-cpu` is an alias (ours, or the `vllm-0.0.0` some releases write)."""
    for prefix in prefixes:
        found: dict[str, str] = {}
        for directory in site_packages(prefix):
            for project, version in dist_infos(directory):
                if version_key(version) > (0, 0, 0):
                    found.setdefault(project, version)
        release = found.get("vllm_cpu") or found.get("vllm")
        if release:
            return release
    return None


def dist_infos(directory: str) -> list[tuple[str, str]]:
    """(project, version) of each dist-info directory in `directory` (none if unreadable)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    split = (n.removesuffix(".dist-info").partition("-") for n in names if n.endswith(".dist-info"))
    return [(project.lower(), version) for project, _, version in split]


def support(release: str | None) -> Support:
    if release is None:
        return Support(
            None, ReleaseStatus.UNKNOWN, "no installed vLLM release found to check against"
        )
    key = version_key(release)
    if key[:2] < WINDOW[0]:
        why = (
            "its CPU engine refuses speculative decoding"
            if key >= V1_SD_REFUSED
            else "it runs speculative decoding on CPU only on its old V0 engine"
        )
        note = f"vLLM {release} is older than {FIRST}: {why} ({RELEASES_DOC})"
        return Support(release, ReleaseStatus.OLDER, note)
    if key[:2] > WINDOW[1]:
        note = (
            f"vLLM {release} is newer than the releases read ({FIRST} to {LAST}): the plan "
            f"follows {LAST}, not checked against this one ({RELEASES_DOC})"
        )
        return Support(release, ReleaseStatus.NEWER, note)
    read = f"vLLM {release}: in the releases read ({FIRST} to {LAST})"
    return Support(release, ReleaseStatus.WINDOW, read)


PYTHONPATH = "PYTHONPATH"
CACHE_NAME = "vllm-metadata"


@record
class Alias:
    version: str  # "0.32.0+cpu"
    directory: str  # goes first on PYTHONPATH
    metadata: str  # directory/vllm-VERSION.dist-info/METADATA


def metadata_text(version: str) -> str:
    return f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"


def import_directories(target: Target, environ: Mapping[str, str]) -> list[str]:
    """Where the target's Python finds distributions, in sys.path's order."""
    directories = [p for p in environ.get(PYTHONPATH, "").split(":") if os.path.isabs(p)]
    return directories + site_packages(target.user_base) + site_packages(target.prefix)


# Where neither variable names a cache: said, since vLLM's CLI then fails (issue 35).
NO_CACHE = (
    "neither XDG_CACHE_HOME nor HOME is an absolute path to keep it under",
    "export HOME=$(getent passwd $(id -u) | cut -d: -f6)",
)


def alias_for(target: Target, environ: Mapping[str, str]) -> Alias | None:
    """The `vllm` dist-info a lone `vllm-cpu` lacks (no directory: no cache directory known)."""
    release = None
    for directory in import_directories(target, environ):
        found = dist_infos(directory)
        if any(project == "vllm" for project, _ in found):
            return None
        release = release or next((v for p, v in found if p == "vllm_cpu"), None)
    if release is None:
        return None
    version = f"{release}+cpu"
    xdg, home = environ.get("XDG_CACHE_HOME", ""), environ.get("HOME", "")
    cache = xdg if os.path.isabs(xdg) else os.path.join(home, ".cache")
    if not os.path.isabs(cache):
        return Alias(version, "", "")
    directory = os.path.join(cache, "vllm-cpu-launch", CACHE_NAME, version)
    return Alias(
        version, directory, os.path.join(directory, f"vllm-{version}.dist-info", "METADATA")
    )


def alias_problem(alias: Alias, euid: int, trusted: frozenset[int]) -> tuple[str, str] | None:
    """(why, fix) when another user could change the alias, or where it will be written."""
    if not alias.directory:
        return NO_CACHE
    path = alias.metadata
    while not os.path.lexists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return insecure_reason(path, euid, trusted)


def pythonpath_with(alias: Alias, environ: Mapping[str, str]) -> str:
    current = environ.get(PYTHONPATH, "")
    return f"{alias.directory}:{current}" if current else alias.directory


def write_alias(alias: Alias) -> None:
    """Write the METADATA atomically, writable by the owner only; raises OSError."""
    text = metadata_text(alias.version)
    with suppress(OSError, UnicodeDecodeError), open(alias.metadata, encoding="utf-8") as stream:
        if stream.read() == text:
            return
    os.makedirs(os.path.dirname(alias.metadata), mode=0o755, exist_ok=True)
    partial = f"{alias.metadata}.{os.getpid()}.partial"
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
        stream.write(text)
    os.replace(partial, alias.metadata)


def site_fix(site_packages: str, release: str) -> str:
    """The command giving a `vllm-cpu` environment `vllm` metadata for a plain `vllm serve`."""
    import shlex  # lazy: doctor only

    version = f"{release}+cpu"
    dist_info = shlex.quote(os.path.join(site_packages, f"vllm-{version}.dist-info"))
    text = shlex.quote(metadata_text(version).replace("\n", "\\n"))
    return f"mkdir -p {dist_info} && printf {text} > {dist_info}/METADATA"


@record
class Facts:
    """What the plan decides from: what it is asked, and what was gathered for that, once."""

    settings: Settings
    arguments: tuple[str, ...]
    speculative: SpeculativeRequest
    target: Target
    host: Host
    auto_iomp: bool  # what `--iomp auto` means here: SD requested (vLLM) or always (exec)
    one_worker: bool
    planner: Planner
    trusted: frozenset[int]  # uids besides root whose files may be preloaded
    target_problems: tuple[tuple[str, str], ...]  # (text, fix) of the target's own trust
    explicit: Mapping[str, Search]  # --iomp-path / --tcmalloc-path, validated
    release: Support
    scope: Scope
    tuned: Tuned | None  # the tune record that matches, before the SD check
    tune_notes: tuple[str, ...]
    entries: tuple[tuple[str, Finding], ...]  # the caller's LD_PRELOAD entries, examined
    alias: Alias | None  # the `vllm` metadata to supply (supply_metadata)
    alias_problem: tuple[str, str] | None  # why the alias cannot be supplied
    iomp: Search | None = None  # the search for an OpenMP runtime, where one may be wanted
    tcmalloc: Search | None = None  # the search for tcmalloc, where one may be wanted
    # The install command of each library searched for and missing (fixes.py), by package.
    install_fixes: Mapping[str, str] = MappingProxyType({})  # read-only: one shared default


def target_trust(target: Target, euid: int) -> tuple[frozenset[int], list[tuple[str, str]]]:
    """(uids trusted besides root, the target's problems as (text, fix)): as root, the owner
    of the vLLM script and its interpreter already decides what root runs."""
    programs = tuple(
        dict.fromkeys(p for p in (target.executable, target.runner, target.interpreter) if p)
    )
    trusted = owners(programs) if euid == 0 else frozenset()
    problems = []
    for path in programs:
        unsafe = insecure_reason(path, euid, trusted)
        if unsafe:
            text = f"{path} (what runs the server) is unsafe: {unsafe[0]}"
            problems.append((f"{text}, so another user could change the code it runs", unsafe[1]))
    others = sorted(uid for uid in trusted if uid != 0)
    if others:
        text = (
            f"running as root a vLLM owned by uid {', '.join(map(str, others))} "
            f"({target.executable}): that user can change the code root runs, so libraries "
            "they own are trusted alike; run the server as that user (systemd User=) or "
            "install vLLM as root"
        )
        problems.append((text, ""))
    return trusted - {0}, problems


def validated_explicit(kind: str, path: str, host: Host, trusted: frozenset[int]) -> Search:
    """An `--iomp-path`/`--tcmalloc-path` library; a bad one is an error, never skipped."""
    search = find_library(kind, host, None, explicit=path, trusted=trusted)
    if search.chosen is None:
        given = search.candidates[0]
        fix = f"; Fix: {given.fix}" if given.fix else ""
        message = f"{kind} library {path} cannot be preloaded: {given.reason}{fix}"
        raise LaunchError(EXIT_USAGE, message)
    return search


def effective_tune(facts: Facts) -> Tuned | None:
    """The tune record applied: one that kept libgomp does not keep it for SD."""
    dropped = facts.tuned and facts.tuned.iomp == Mode.NEVER and facts.speculative.requested
    return None if dropped else facts.tuned


def mode_of(facts: Facts) -> Mode:
    """--iomp as it applies: a tune of this command wins over a config file's (tunes.py)."""
    applied = effective_tune(facts)
    return applied.iomp if applied else facts.settings.iomp


def searches(facts: Facts) -> tuple[Search | None, Search | None]:
    """The searches for an OpenMP runtime and for tcmalloc, made where each may be wanted."""
    settings, host, mode = facts.settings, facts.host, mode_of(facts)
    older = (
        facts.speculative.requested
        and facts.release.status == ReleaseStatus.OLDER
        and mode == Mode.AUTO
    )
    machine = host.machine
    runtime = (mode == Mode.ALWAYS and (preloaded_on(machine) or opt_in_on(machine))) or (
        mode == Mode.AUTO and facts.auto_iomp and preloaded_on(machine) and not older
    )
    theirs = any(e.kind is Library.MALLOC for e in host.preload)
    tcmalloc = not theirs and (
        settings.tcmalloc == Mode.ALWAYS or (settings.tcmalloc == Mode.AUTO and runtime)
    )
    wanted = [kind for kind, want in ((IOMP, runtime), (TCMALLOC, tcmalloc)) if want]
    target, trusted = facts.target, facts.trusted
    found = {
        k: facts.explicit.get(k) or find_library(k, host, target, trusted=trusted) for k in wanted
    }
    return found.get(IOMP), found.get(TCMALLOC)


def gather(
    settings: Settings,
    command: VllmCommand,
    target: Target,
    host: Host,
    auto_iomp: bool,
    *,
    planner: Planner = Planner.LAUNCHER,
    supply_metadata: bool = False,
) -> Facts:
    """The facts of what the plan is asked, every file it reads read here, once."""
    trusted, problems = target_trust(target, host.euid)
    # A bad path given is an error even when that library turns out not to be wanted.
    named: dict[str, str | None] = {IOMP: settings.iomp_path, TCMALLOC: settings.tcmalloc_path}
    explicit = {k: validated_explicit(k, p, host, trusted) for k, p in named.items() if p}
    release = support(target_release(target))
    scope = launch_scope(command.model, command.speculative, release.release, host.cpus)
    tuned, tune_notes = choose(settings, scope) if settings.tuned else (None, [])
    alias = alias_for(target, host.environ) if supply_metadata else None
    # The caller's LD_PRELOAD, examined where the loader finds it ($ORIGIN: the program's).
    preload = dict.fromkeys(e.path for e in host.preload if "ORIGIN" not in e.path)
    entries = tuple((p, examine_entry(p, None, host, trusted)) for p in preload)
    facts = Facts(
        settings,
        command.arguments,
        command.speculative,
        target,
        host,
        auto_iomp,
        command.one_worker,
        planner,
        trusted,
        tuple(problems),
        explicit,
        release,
        scope,
        tuned,
        tuple(tune_notes),
        entries,
        alias,
        alias_problem(alias, host.euid, trusted) if alias else None,
    )
    iomp, tcmalloc = searches(facts)
    fixes = install_fixes(facts, iomp, tcmalloc)
    return replace(facts, iomp=iomp, tcmalloc=tcmalloc, install_fixes=fixes)


def install_fixes(facts: Facts, iomp: Search | None, tcmalloc: Search | None) -> Mapping[str, str]:
    """The install command of each library a search found none of, by package."""
    # An LLVM runtime found may still be missing to the plan (no runtimes rule for it).
    runtime = iomp is not None and (iomp.chosen is None or iomp.chosen.flavor != INTEL.word)
    always = facts.settings.tcmalloc == Mode.ALWAYS
    allocator = always and tcmalloc is not None and tcmalloc.chosen is None
    if not (runtime or allocator):
        return MappingProxyType({})
    from vllm_cpu_launch.fixes import fix_hint  # lazy: only when missing

    rows = [(f.value, IOMP, f.wheel) for f in preloadable() if f.wheel] if runtime else []
    rows += [(TCMALLOC, TCMALLOC, TCMALLOC)] if allocator else []
    path = facts.host.environ.get("PATH")
    return MappingProxyType({key: fix_hint(facts.target, k, p, path) for key, k, p in rows})
