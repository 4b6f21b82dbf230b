"""The plan's decision: small pure stages over the gathered facts (gather.py), each
returning a new Decision. Nothing here reads a file or says a word: plan.py derives the
messages from the Decision's fields."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.evidence import BLOCKTIME_VARIABLE
from vllm_cpu_launch.gather import effective_tune, mode_of
from vllm_cpu_launch.handoff import (
    IOMP_MACHINES,
    LAUNCHER,
    LLVM_OPT_IN_MACHINES,
    NOT_FOUND_MARK,
    PLANNED_VARIABLE,
    STARTED_MARK,
    names_openmp_runtime,
)
from vllm_cpu_launch.libraries import LLVM
from vllm_cpu_launch.metadata import PYTHONPATH, pythonpath_with
from vllm_cpu_launch.places import (
    ALLOCATOR,
    IOMP,
    TCMALLOC,
    callers_kind,
    openmp_runtime_of,
    preload_entries,
)
from vllm_cpu_launch.records import record
from vllm_cpu_launch.rules import Runtime, Setting, Start, llvm_runtime, setting_rule
from vllm_cpu_launch.settings import blocktime_problem

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from vllm_cpu_launch.gather import Facts
    from vllm_cpu_launch.libraries import Candidate, Search
    from vllm_cpu_launch.settings import Tuned

# The value vLLM's own CPU workers use since PR #42666 (1 ms let threads sleep too soon).
DEFAULT_KMP_BLOCKTIME = "5"
LD_PRELOAD = "LD_PRELOAD"
NO_SETTING = Setting(None, "")


@record
class Decision:
    """What the stages decided so far; each stage returns a new one."""

    mode: str = "auto"  # --iomp as it applies (a tune's, else the settings')
    tuned: Tuned | None = None  # the tune record applied
    tune_dropped: bool = False  # a tune that kept libgomp, not applied to SD
    wants_iomp: bool = False
    release_gate: str | None = None  # the release's status where it decides ("older")
    machine_gate: str | None = None  # "opt-in": --iomp always where LLVM's is; "off"
    yours: tuple[str, ...] = ()  # the caller's OpenMP runtime entries
    allocators: tuple[str, ...] = ()  # the caller's malloc entries (tcmalloc or other)
    other_malloc: tuple[str, ...] = ()  # those that are no tcmalloc
    setting: Setting = NO_SETTING  # the setting rule, or why none applies
    runtime: Runtime | None = None  # LLVM's libomp standing in: its rule, or why not
    iomp_search: Search | None = None  # the runtime search, as the plan reports it
    iomp: Candidate | None = None  # the runtime the plan preloads
    broken: tuple[Candidate, ...] = ()  # the caller's runtimes that cannot be loaded
    iomp_missing: bool = False  # wanted, and none usable (or the caller's is broken)
    tcmalloc_search: Search | None = None  # the tcmalloc search, where it was wanted
    tcmalloc: Candidate | None = None
    tcmalloc_missing: bool = False  # `always`, and none found
    refused: tuple[Candidate, ...] = ()  # the caller's entries the trust rule refuses
    chosen: tuple[Candidate, ...] = ()  # what the plan preloads, in order
    env: tuple[tuple[str, str], ...] = ()  # what the plan sets or changes
    dropped: tuple[str, ...] = ()  # libgomp entries of the caller's removed
    blocktime_problem: str | None = None  # the caller's KMP_BLOCKTIME, kept but unwise
    mark: str | None = None  # PLANNED_VARIABLE's value, where one is due

    @property
    def applied(self) -> Setting | None:
        """The setting rule, where it goes with a runtime the plan preloads."""
        return self.setting if self.setting.rule and self.iomp is not None else None


def mode_stage(facts: Facts, decision: Decision) -> Decision:
    """--iomp in effect, and whether an OpenMP runtime is wanted for it."""
    request = facts.request
    mode = mode_of(request, facts.tuned)
    tuned = effective_tune(request, facts.tuned)
    wants = mode == "always" or (mode == "auto" and request.auto_iomp)
    dropped = facts.tuned is not None and tuned is None
    return replace(decision, mode=mode, tuned=tuned, tune_dropped=dropped, wants_iomp=wants)


def release_gate(facts: Facts, decision: Decision) -> Decision:
    """For SD, an older vLLM than the window starts unchanged under --iomp auto."""
    if not facts.request.speculative.requested or facts.release.status not in ("older", "newer"):
        return decision
    older = facts.release.status == "older"
    if older and decision.mode != "auto":
        return decision
    wants = decision.wants_iomp and not older
    return replace(decision, release_gate=facts.release.status, wants_iomp=wants)


def architecture_gate(facts: Facts, decision: Decision) -> Decision:
    """Intel OpenMP on x86-64 only; LLVM's libomp opt-in (--iomp always) where it is the
    one KMP-style runtime built."""
    machine = facts.request.host.machine
    if not decision.wants_iomp:
        return decision
    if machine in LLVM_OPT_IN_MACHINES and decision.mode == "always":
        return replace(decision, machine_gate="opt-in")
    if machine not in IOMP_MACHINES:
        return replace(decision, machine_gate="off", wants_iomp=False)
    return decision


def callers_stage(facts: Facts, decision: Decision) -> Decision:
    """The caller's OpenMP runtime and malloc in LD_PRELOAD: theirs, nothing beside them."""
    entries = preload_entries(facts.request.host.environ.get(LD_PRELOAD, ""))
    yours = tuple(e for e in entries if openmp_runtime_of(e) == "intel")
    allocators = tuple(e for e in entries if callers_kind(e) in (TCMALLOC, ALLOCATOR))
    other = tuple(e for e in allocators if callers_kind(e) == ALLOCATOR)
    return replace(decision, yours=yours, allocators=allocators, other_malloc=other)


def x86_sd(facts: Facts, decision: Decision) -> bool:
    """SD on x86-64 with no runtime of the caller's: where the measured rules may apply."""
    request = facts.request
    machine = request.host.machine
    return request.speculative.requested and machine in IOMP_MACHINES and not decision.yours


def start_of(facts: Facts, decision: Decision) -> Start:
    """What the rules read of this start (rules.Start)."""
    request, settings = facts.request, facts.request.settings
    theirs = {callers_kind(e) for e in decision.allocators}
    found = facts.tcmalloc is not None and facts.tcmalloc.chosen is not None
    return Start(
        request.host.machine,
        request.host.cpus,
        facts.release.release,
        request.one_worker,
        request.speculative.method,
        request.speculative.tokens,
        request.host.environ,
        settings.kmp_blocktime,
        settings.tcmalloc,
        found and not decision.other_malloc,
        "other" if ALLOCATOR in theirs else "tcmalloc" if theirs else None,
    )


def rules_stage(facts: Facts, decision: Decision) -> Decision:
    """The setting rule that applies here (rules.setting_rule), for SD on x86-64."""
    if not (x86_sd(facts, decision) and decision.wants_iomp):
        return decision
    return replace(decision, setting=setting_rule(start_of(facts, decision)))


def declined(search: Search, why: str) -> Search:
    """The search with its LLVM runtimes turned down for SD (rules.llvm_runtime): each
    says why and how to preload it anyway, in the warning that nothing usable was found."""
    candidates = tuple(
        replace(
            c,
            verdict="rejected",
            reason=f"LLVM's libomp, {why}: not preloaded in Intel OpenMP's place; "
            f"--iomp-path {c.path} or --iomp always preloads it anyway",
        )
        if c.verdict in ("chosen", "usable")
        else c
        for c in search.candidates
    )
    return replace(search, chosen=None, candidates=candidates)


def set_aside(search: Search, entry: str) -> Search:
    """The search with its choice not preloaded beside the caller's own runtime `entry`
    (kept as set, nothing added): the candidates say what the plan preloads."""
    candidates = tuple(
        replace(
            c,
            verdict="usable",
            reason=f"not preloaded: your LD_PRELOAD entry {entry} is named as an OpenMP "
            "runtime, kept as set, and none goes beside it",
        )
        if c.verdict == "chosen" and c.origin != "ld-preload"
        else c
        for c in search.candidates
    )
    return replace(search, candidates=candidates)


def runtime_stage(facts: Facts, decision: Decision) -> Decision:
    """The OpenMP runtime to preload: the search's, LLVM's only where the runtimes rules
    let it stand in (--iomp always takes it); none beside the caller's."""
    search = facts.iomp
    if not decision.wants_iomp or search is None:
        return decision
    found, runtime = search.chosen, None
    if found and found.origin != "explicit" and found.flavor == LLVM and x86_sd(facts, decision):
        runtime = llvm_runtime(start_of(facts, decision))
        if runtime.rule is None and decision.mode == "auto":
            search = declined(search, runtime.note)
    iomp = search.chosen
    foreign = [e for e in decision.yours if iomp is None or e != iomp.path]
    if foreign and IOMP in facts.explicit:
        raise LaunchError(
            EXIT_USAGE,
            f"--iomp-path {facts.request.settings.iomp_path} and your LD_PRELOAD entry "
            f"{foreign[0]} would put two OpenMP runtimes in one process: give one of them",
        )
    if foreign:
        search = set_aside(search, foreign[0])
    rejected = {c.path: c for c in search.candidates if c.origin == "ld-preload"}
    broken = tuple(rejected[e] for e in decision.yours if e in rejected)
    broken = tuple(c for c in broken if c.verdict == "rejected") if foreign else ()
    missing = bool(broken) if foreign else iomp is None
    return replace(
        decision,
        runtime=runtime,
        iomp_search=search,
        iomp=None if foreign else iomp,
        broken=broken,
        iomp_missing=missing,
    )


def allocator_stage(facts: Facts, decision: Decision) -> Decision:
    """tcmalloc: `always`, or `auto` beside the runtime the plan preloads unless the rule
    that applies was measured without; never beside a malloc of the caller's."""
    tcmalloc_setting = facts.request.settings.tcmalloc
    applied = decision.applied
    wants = not decision.other_malloc and (
        tcmalloc_setting == "always"
        or (
            tcmalloc_setting == "auto"
            and decision.iomp is not None
            and not decision.yours
            and (not applied or applied.tcmalloc)
        )
    )
    search = facts.tcmalloc
    if not wants or search is None:
        return decision
    chosen = search.chosen
    if decision.allocators and (chosen is None or chosen.origin != "ld-preload"):
        chosen = None  # theirs, unusable: its warning says so; nothing goes beside it
    missing = chosen is None and not decision.allocators and tcmalloc_setting == "always"
    return replace(decision, tcmalloc_search=search, tcmalloc=chosen, tcmalloc_missing=missing)


def searches(decision: Decision) -> tuple[Search, ...]:
    """The searches the plan used, as its candidates report them."""
    return tuple(s for s in (decision.iomp_search, decision.tcmalloc_search) if s)


def refuse_stage(facts: Facts, decision: Decision) -> Decision:
    """A caller's entry the trust rule refuses, examined beside the plan's own library:
    nothing changes (the launcher refuses to start, the plugin leaves it)."""
    callers = [c for s in searches(decision) for c in s.candidates if c.origin == "ld-preload"]
    refused = tuple(c for c in callers if c.unsafe)
    chosen = tuple(c for c in (decision.tcmalloc, decision.iomp) if c is not None)
    return replace(decision, refused=refused, chosen=() if refused else chosen)


def compose_ld_preload(current: str, additions: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """New LD_PRELOAD (additions first, caller's entries kept in order) and dropped entries.

    A libgomp entry is dropped once an Intel/LLVM OpenMP runtime is in the list:
    vLLM asserts that not both are preloaded (vllm/utils/ompmultiprocessing.py).
    """
    entries = preload_entries(current)
    merged = [path for path in additions if path not in entries] + entries
    # The runtime an entry is, by its file's name (not a directory's, `/opt/libomp-17/`);
    # dropped, what vLLM would read as libgomp: the substring anywhere in the entry.
    has_iomp = any(openmp_runtime_of(os.path.basename(e)) == "intel" for e in merged)
    dropped = tuple(e for e in merged if has_iomp and "libgomp" in e)
    return ":".join(e for e in merged if e not in dropped), dropped


def blocktime_of(
    environ: Mapping[str, str], decision: Decision, chosen: str | None
) -> tuple[str | None, str | None]:
    """(KMP_BLOCKTIME to set or None, the problem with the caller's kept one). The
    caller's is never replaced; a default only fills it in beside Intel OpenMP the plan
    preloads: 5, or what the rule that applies adds; `chosen` is --kmp-blocktime."""
    callers = environ.get(BLOCKTIME_VARIABLE)
    applied = decision.applied
    default = dict(applied.variables).get(BLOCKTIME_VARIABLE) if applied else None
    default = default or (None if decision.yours else DEFAULT_KMP_BLOCKTIME)
    problem = None
    if chosen is None and any(c.kind == IOMP for c in decision.chosen):
        if callers is None:
            chosen = default
        else:
            problem = blocktime_problem(callers)  # the caller's is kept, but said
    return (chosen if chosen is not None and callers != chosen else None), problem


def env_stage(facts: Facts, decision: Decision) -> Decision:
    """LD_PRELOAD, KMP_BLOCKTIME and the rule's variables, only what changes."""
    environ = facts.request.host.environ
    env: dict[str, str] = {}
    current = environ.get(LD_PRELOAD, "")
    dropped: tuple[str, ...] = ()
    if decision.chosen:
        composed, dropped = compose_ld_preload(current, [c.path for c in decision.chosen])
        if preload_entries(composed) != preload_entries(current):  # else theirs as set
            env[LD_PRELOAD] = composed
    chosen = None if decision.refused else facts.request.settings.kmp_blocktime
    blocktime, problem = blocktime_of(environ, decision, chosen)
    if blocktime is not None:
        env[BLOCKTIME_VARIABLE] = blocktime
    applied = decision.applied
    if applied and decision.chosen:
        env.update((k, v) for k, v in applied.variables if k != BLOCKTIME_VARIABLE)
    return replace(decision, env=tuple(env.items()), dropped=dropped, blocktime_problem=problem)


def mark_stage(facts: Facts, decision: Decision) -> Decision:
    """The plan's mark for vLLM's plugin (docs/design.md, "The plugin"): libgomp kept
    although SD is requested or Intel OpenMP refused does not show in LD_PRELOAD; the
    launcher marks a start whose LD_PRELOAD names a runtime, its own or the caller's."""
    request, env = facts.request, dict(decision.env)
    planner, environ = request.planner, request.host.environ
    requested = request.speculative.requested
    keeps_gomp = decision.iomp is None and (
        decision.mode == "never" or (requested and not decision.yours)
    )
    mark = None
    if keeps_gomp:
        found = decision.mode == "never" or not decision.iomp_missing
        mark = planner if found else planner + NOT_FOUND_MARK
    elif planner == LAUNCHER and names_openmp_runtime(
        env.get(LD_PRELOAD, environ.get(LD_PRELOAD, ""))
    ):
        mark = planner + STARTED_MARK
    if mark and not decision.refused and environ.get(PLANNED_VARIABLE) != mark:
        env[PLANNED_VARIABLE] = mark
    if facts.alias and not facts.alias_problem:
        env[PYTHONPATH] = pythonpath_with(facts.alias, environ)
    return replace(decision, env=tuple(env.items()), mark=mark)


STAGES: tuple[Callable[[Facts, Decision], Decision], ...] = (
    mode_stage,
    release_gate,
    architecture_gate,
    callers_stage,
    rules_stage,
    runtime_stage,
    allocator_stage,
    refuse_stage,
    env_stage,
    mark_stage,
)


def decide(facts: Facts) -> Decision:
    """The decision for `facts`: every stage in turn."""
    decision = Decision()
    for stage in STAGES:
        decision = stage(facts, decision)
    return decision
