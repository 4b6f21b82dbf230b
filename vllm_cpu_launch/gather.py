"""The plan's facts: everything it reads of the target, the host and the caller, with all
of the plan's I/O (trust, the release, tune records, every library search) done here,
once. The decision (decide.py) is pure over these facts."""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.handoff import IOMP_MACHINES, LLVM_OPT_IN_MACHINES
from vllm_cpu_launch.libraries import LLVM, Verdict, callers_verdict, find_library
from vllm_cpu_launch.metadata import alias_for, alias_problem
from vllm_cpu_launch.places import (
    ALLOCATOR,
    IOMP,
    TCMALLOC,
    callers_kind,
    preload_entries,
)
from vllm_cpu_launch.records import record
from vllm_cpu_launch.releases import support, target_release
from vllm_cpu_launch.speculative import model_of
from vllm_cpu_launch.tunes import choose, launch_scope

if TYPE_CHECKING:
    from collections.abc import Mapping

    from vllm_cpu_launch.libraries import Search
    from vllm_cpu_launch.metadata import Alias
    from vllm_cpu_launch.places import Host
    from vllm_cpu_launch.releases import Support
    from vllm_cpu_launch.settings import Scope, Settings, Tuned
    from vllm_cpu_launch.speculative import SpeculativeRequest
    from vllm_cpu_launch.target import Target


@record
class Request:
    """What build_plan is asked: the command, its target and host, and who plans."""

    settings: Settings
    arguments: tuple[str, ...]
    speculative: SpeculativeRequest
    target: Target
    host: Host
    auto_iomp: bool  # what `--iomp auto` means here: SD requested (vLLM) or always (exec)
    one_worker: bool
    planner: str
    model: str | None = None
    supply_metadata: bool = False


@record
class Facts:
    """What the plan decides from, gathered once."""

    request: Request
    trusted: frozenset[int]  # uids besides root whose files may be preloaded
    target_problems: tuple[tuple[str, str], ...]  # (text, fix) of the target's own trust
    explicit: Mapping[str, Search]  # --iomp-path / --tcmalloc-path, validated
    release: Support
    scope: Scope
    tuned: Tuned | None  # the tune record that matches, before the SD check
    tune_notes: tuple[str, ...]
    iomp: Search | None  # the search for an OpenMP runtime, where one may be wanted
    tcmalloc: Search | None  # the search for tcmalloc, where one may be wanted
    entries: tuple[tuple[str, Verdict], ...]  # the caller's LD_PRELOAD entries, examined
    alias: Alias | None  # the `vllm` metadata to supply (supply_metadata)
    alias_problem: tuple[str, str] | None  # why the alias cannot be supplied
    # The install command of each library a search found none of (IOMP, LLVM, TCMALLOC):
    # read here, so that the words say it without looking at the machine (fixes.py).
    install_fixes: Mapping[str, str]


def target_trust(target: Target, euid: int) -> tuple[frozenset[int], list[tuple[str, str]]]:
    """(uids trusted besides root, problems with the target itself as (text, fix)), by
    one rule.

    As root, the owner of the vLLM script and of its interpreter already decides what
    code runs as root: a library of the same owner adds no trust, so it is accepted;
    the same check that refuses a library writable by others finds such a script or
    interpreter, which is reported (and refused with --strict). See docs/design.md.
    """
    from vllm_cpu_launch.trust import insecure_reason, owners

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


def examined_entries(host: Host, trusted: frozenset[int]) -> tuple[tuple[str, Verdict], ...]:
    """Each entry of the caller's LD_PRELOAD, examined where the loader finds it ($ORIGIN
    entries are the program's to resolve: left out)."""
    found = []
    for entry in dict.fromkeys(preload_entries(host.environ.get("LD_PRELOAD", ""))):
        if "ORIGIN" in entry:
            continue
        found.append((entry, callers_verdict(entry, None, host, trusted)))
    return tuple(found)


def effective_tune(request: Request, tuned: Tuned | None) -> Tuned | None:
    """The tune record applied: one that kept libgomp does not keep it for SD."""
    dropped = tuned and tuned.iomp == "never" and request.speculative.requested
    return None if dropped else tuned


def mode_of(request: Request, tuned: Tuned | None) -> str:
    """--iomp as it applies: a tune of this command wins over a config file's (tunes.py)."""
    applied = effective_tune(request, tuned)
    return applied.iomp if applied else request.settings.iomp


def may_want(request: Request, tuned: Tuned | None, release: Support) -> tuple[bool, bool]:
    """Whether an OpenMP runtime, and tcmalloc, may be wanted: the searches to make."""
    settings, host = request.settings, request.host
    mode = mode_of(request, tuned)
    older = request.speculative.requested and release.status == "older" and mode == "auto"
    runtime = (mode == "always" and host.machine in (*IOMP_MACHINES, *LLVM_OPT_IN_MACHINES)) or (
        mode == "auto" and request.auto_iomp and host.machine in IOMP_MACHINES and not older
    )
    kinds = {callers_kind(e) for e in preload_entries(host.environ.get("LD_PRELOAD", ""))}
    tcmalloc = ALLOCATOR not in kinds and (
        settings.tcmalloc == "always" or (settings.tcmalloc == "auto" and runtime)
    )
    return runtime, tcmalloc


def gather(request: Request) -> Facts:
    """The facts of `request`: every file the plan reads, read here."""
    settings, target, host = request.settings, request.target, request.host
    trusted, problems = target_trust(target, host.euid)
    # A bad path given is an error even when that library turns out not to be wanted.
    named = {IOMP: settings.iomp_path, TCMALLOC: settings.tcmalloc_path}
    explicit = {k: validated_explicit(k, p, host, trusted) for k, p in named.items() if p}
    release = support(target_release(target))
    model = request.model or model_of(request.arguments)
    scope = launch_scope(model, request.speculative, release.release, host.cpus)
    tuned, tune_notes = choose(settings, scope) if settings.tuned else (None, [])
    wants_runtime, wants_tcmalloc = may_want(request, tuned, release)
    alias = alias_for(target, host.environ) if request.supply_metadata else None
    iomp = search(IOMP, request, explicit, trusted) if wants_runtime else None
    tcmalloc = search(TCMALLOC, request, explicit, trusted) if wants_tcmalloc else None
    return Facts(
        request,
        trusted,
        tuple(problems),
        explicit,
        release,
        scope,
        tuned,
        tuple(tune_notes),
        iomp,
        tcmalloc,
        examined_entries(host, trusted),
        alias,
        alias_problem(alias, host.euid, trusted) if alias else None,
        install_fixes(request, iomp, tcmalloc),
    )


def install_fixes(
    request: Request, iomp: Search | None, tcmalloc: Search | None
) -> Mapping[str, str]:
    """The install command of each library a search found none of (Intel's and LLVM's
    OpenMP wheels for a runtime), by package."""
    # An LLVM runtime found may still be missing to the plan (no runtimes rule for it).
    runtime = iomp is not None and (iomp.chosen is None or iomp.chosen.flavor != "intel")
    # tcmalloc is missing to the plan only where the user asked for it (--tcmalloc always).
    always = request.settings.tcmalloc == "always"
    allocator = always and tcmalloc is not None and tcmalloc.chosen is None
    if not (runtime or allocator):
        return MappingProxyType({})
    from vllm_cpu_launch.fixes import LLVM_PACKAGE, PACKAGE, fix_hint  # only when missing

    path_variable = request.host.environ.get("PATH")
    fixes = {}
    if runtime:
        fixes[IOMP] = fix_hint(request.target, IOMP, PACKAGE, path_variable)
        fixes[LLVM] = fix_hint(request.target, IOMP, LLVM_PACKAGE, path_variable)
    if allocator:
        fixes[TCMALLOC] = fix_hint(request.target, TCMALLOC, TCMALLOC, path_variable)
    return MappingProxyType(fixes)


def search(
    kind: str, request: Request, explicit: Mapping[str, Search], trusted: frozenset[int]
) -> Search:
    return explicit.get(kind) or find_library(kind, request.host, request.target, trusted=trusted)
