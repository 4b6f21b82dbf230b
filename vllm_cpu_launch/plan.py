"""The plan: what to exec and with which environment, decided (never executed) from the
facts (gather.py, all of its I/O) by small pure stages, each returning a new Decision;
then said: its warnings, notes and reason derive from the decision's fields."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_cpu_launch.elf import Library, library_of
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.gather import (
    PYTHONPATH,
    Alias,
    ReleaseStatus,
    effective_tune,
    mode_of,
    pythonpath_with,
    version_key,
)
from vllm_cpu_launch.handoff import (
    LD_PRELOAD,
    NOT_FOUND_MARK,
    PLANNED_VARIABLE,
    STARTED_MARK,
    Planner,
)
from vllm_cpu_launch.libraries import IOMP, TCMALLOC, CandidateVerdict, Origin
from vllm_cpu_launch.messages import StrEnum
from vllm_cpu_launch.records import record, replace
from vllm_cpu_launch.rules import (
    BIND_VARIABLE,
    BLOCKTIME_VARIABLE,
    HOST_WORDS,
    RESERVED_VARIABLE,
    THREADS_VARIABLE,
    Allocator,
    Setting,
    Start,
    bound_worker_overrides,
    llvm_runtime,
    override_words,
    setting_rule,
)
from vllm_cpu_launch.runtimes import (
    by_word,
    opt_in_on,
    preloaded_on,
    vllm_reads,
    vllm_reads_gnu,
    wanted_on,
)
from vllm_cpu_launch.settings import Mode, blocktime_problem, said_setting
from vllm_cpu_launch.shape import (
    VISIBLE_NODES,
    HostUse,
    shape_json,
    visible_nodes,
    visible_nodes_problem,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    from vllm_cpu_launch.command import SpeculativeRequest
    from vllm_cpu_launch.gather import Facts
    from vllm_cpu_launch.libraries import Candidate, Finding, PreloadEntry, Search
    from vllm_cpu_launch.rules import Override, Rule
    from vllm_cpu_launch.settings import Scope, Tuned
    from vllm_cpu_launch.shape import Shape, Use


# The value vLLM's own CPU workers use since PR #42666 (1 ms let threads sleep too soon).
DEFAULT_KMP_BLOCKTIME = "5"


class MachineGate(StrEnum):
    """What the host's architecture does to the runtime the plan wants."""

    OPT_IN = "opt-in"  # --iomp always where LLVM's libomp is the one KMP runtime built
    OFF = "off"  # no Intel OpenMP for this architecture


@record
class Decision:
    """What the stages decided so far; each stage returns a new one."""

    mode: Mode = Mode.AUTO  # --iomp as it applies (a tune's, else the settings')
    tuned: Tuned | None = None  # the tune record applied
    tune_dropped: bool = False  # a tune that kept libgomp, not applied to SD
    wants_iomp: bool = False
    release_gate: ReleaseStatus | None = None  # the release's status where it decides
    machine_gate: MachineGate | None = None
    yours: tuple[str, ...] = ()  # the caller's OpenMP runtime entries
    allocators: tuple[str, ...] = ()  # the caller's malloc entries (tcmalloc or other)
    other_malloc: tuple[str, ...] = ()  # those that are no tcmalloc
    setting: Setting = Setting(None, "")  # the setting rule, or why none applies
    start: Start | None = None  # what the rules matched (rules_stage), for SD on x86-64
    runtime: Setting | None = None  # LLVM's libomp standing in: its rule, or why not
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

    @property
    def searches(self) -> tuple[Search, ...]:
        """The searches the plan used, as its candidates report them."""
        return tuple(s for s in (self.iomp_search, self.tcmalloc_search) if s)


def mode_stage(facts: Facts, decision: Decision) -> Decision:
    """--iomp in effect, and whether an OpenMP runtime is wanted for it."""
    mode, tuned = mode_of(facts), effective_tune(facts)
    wants = mode == Mode.ALWAYS or (mode == Mode.AUTO and facts.auto_iomp)
    dropped = facts.tuned is not None and tuned is None
    return replace(decision, mode=mode, tuned=tuned, tune_dropped=dropped, wants_iomp=wants)


def release_gate(facts: Facts, decision: Decision) -> Decision:
    """For SD, an older vLLM than the window starts unchanged under --iomp auto."""
    status = facts.release.status
    if not facts.speculative.requested or status not in (ReleaseStatus.OLDER, ReleaseStatus.NEWER):
        return decision
    if status == ReleaseStatus.OLDER and decision.mode != Mode.AUTO:
        return decision
    wants = decision.wants_iomp and status != ReleaseStatus.OLDER
    return replace(decision, release_gate=status, wants_iomp=wants)


def architecture_gate(facts: Facts, decision: Decision) -> Decision:
    """Intel OpenMP on x86-64 only; LLVM's libomp opt-in where it is the one KMP one built."""
    machine, wants = facts.host.machine, decision.wants_iomp
    if wants and opt_in_on(machine) and decision.mode == Mode.ALWAYS:
        return replace(decision, machine_gate=MachineGate.OPT_IN)
    if wants and not preloaded_on(machine):
        return replace(decision, machine_gate=MachineGate.OFF, wants_iomp=False)
    return decision


def callers_stage(facts: Facts, decision: Decision) -> Decision:
    """The caller's OpenMP runtime and malloc in LD_PRELOAD: theirs, nothing beside them; a
    runtime by its file, or an entry vLLM takes for Intel's by its name (examined: warned)."""
    entries = facts.host.preload
    yours = tuple(e.path for e in entries if e.kind.kmp or e.path in facts.host.taken_for_intel)
    allocators = tuple(e.path for e in entries if e.kind.allocator)
    other = tuple(e.path for e in entries if e.kind is Library.MALLOC)
    return replace(decision, yours=yours, allocators=allocators, other_malloc=other)


def x86_sd(facts: Facts, decision: Decision) -> bool:
    """SD on x86-64 with no runtime of the caller's: where the measured rules may apply."""
    machine = facts.host.machine
    return facts.speculative.requested and preloaded_on(machine) and not decision.yours


def start_of(facts: Facts) -> Start:
    """The one start the plan's stages, `rules serve ...` and doctor's advice match against."""
    callers, use = callers_stage(facts, Decision()), facts.host.use
    found = facts.tcmalloc is not None and facts.tcmalloc.chosen is not None
    tcmalloc = Allocator.TCMALLOC if callers.allocators else None
    theirs = Allocator.OTHER if callers.other_malloc else tcmalloc
    return Start(
        facts.host.machine,
        facts.host.cpus,
        facts.release.release,
        facts.one_worker,
        facts.speculative.method,
        facts.speculative.tokens,
        facts.host.environ,
        facts.settings.kmp_blocktime,
        facts.settings.tcmalloc,
        found and not callers.other_malloc,
        theirs,
        callers_runtime=next(iter(callers.yours), None),
        host=use.kind if use else HostUse.UNKNOWN,
        host_why=use.why if use else "not watched",
    )


def rules_stage(facts: Facts, decision: Decision) -> Decision:
    """The setting rule that applies here (rules.setting_rule), for SD on x86-64."""
    if not (x86_sd(facts, decision) and decision.wants_iomp):
        return decision
    start = start_of(facts)
    return replace(decision, start=start, setting=setting_rule(start))


def runtime_stage(facts: Facts, decision: Decision) -> Decision:
    """The OpenMP runtime to preload: the search's choice, but a stand-in (LLVM's) for SD
    under --iomp auto only where a runtimes rule lets it, and none beside a runtime of the
    caller's own (`foreign`: theirs, broken or not; --iomp-path too is a usage error)."""
    search = facts.iomp
    if not decision.wants_iomp or search is None:
        return decision
    found, runtime = search.chosen, None
    family = by_word(found.flavor) if found and found.origin != Origin.EXPLICIT else None
    if family and family.stand_in and decision.start and x86_sd(facts, decision):
        runtime = llvm_runtime(decision.start)
    declined = None  # why the stand-in is turned down, where it is
    if runtime is not None and runtime.rule is None and decision.mode == Mode.AUTO:
        declined = runtime.note
    iomp = found if declined is None else None
    foreign = next((e for e in decision.yours if iomp is None or e != iomp.path), None)
    if foreign and IOMP in facts.explicit:
        raise LaunchError(
            EXIT_USAGE,
            f"--iomp-path {facts.settings.iomp_path} and your LD_PRELOAD entry "
            f"{foreign} would put two OpenMP runtimes in one process: give one of them",
        )
    candidates = tuple(runtime_verdict(c, declined, foreign) for c in search.candidates)
    theirs = [c for c in candidates if c.origin == Origin.LD_PRELOAD and c.path in decision.yours]
    broken = tuple(c for c in theirs if c.verdict == CandidateVerdict.REJECTED) if foreign else ()
    search = replace(search, chosen=iomp, candidates=candidates)
    missing = bool(broken) if foreign else iomp is None
    decision = replace(decision, runtime=runtime, iomp_search=search, broken=broken)
    return replace(decision, iomp=None if foreign else iomp, iomp_missing=missing)


def runtime_verdict(candidate: Candidate, declined: str | None, foreign: str | None) -> Candidate:
    """A candidate as runtime_stage leaves it: turned down where the stand-in was declined
    (for the reason `declined`; saying how to take it anyway), or set aside for the caller's
    `foreign` runtime."""
    usable = (CandidateVerdict.CHOSEN, CandidateVerdict.USABLE)
    if declined is not None and candidate.verdict in usable:
        reason = (
            f"LLVM's libomp, {declined}: not preloaded in Intel OpenMP's place; "
            f"--iomp-path {candidate.path} or --iomp always preloads it anyway"
        )
        return replace(candidate, verdict=CandidateVerdict.REJECTED, reason=reason)
    chosen = candidate.verdict == CandidateVerdict.CHOSEN
    if foreign and chosen and candidate.origin != Origin.LD_PRELOAD:
        reason = (
            f"not preloaded: your LD_PRELOAD entry {foreign} is named as an OpenMP "
            "runtime, kept as set, and none goes beside it"
        )
        return replace(candidate, verdict=CandidateVerdict.USABLE, reason=reason)
    return candidate


def allocator_stage(facts: Facts, decision: Decision) -> Decision:
    """tcmalloc: `always`, or `auto` beside our runtime unless the rule was measured without."""
    tcmalloc_setting, applied = facts.settings.tcmalloc, decision.applied
    beside = decision.iomp is not None and not decision.yours and (not applied or applied.tcmalloc)
    auto = tcmalloc_setting == Mode.AUTO and beside
    wants = not decision.other_malloc and (tcmalloc_setting == Mode.ALWAYS or auto)
    search = facts.tcmalloc
    if not wants or search is None:
        return decision
    chosen = search.chosen
    if decision.allocators and (chosen is None or chosen.origin != Origin.LD_PRELOAD):
        chosen = None  # theirs, unusable: its warning says so; nothing goes beside it
    missing = chosen is None and not decision.allocators and tcmalloc_setting == Mode.ALWAYS
    return replace(decision, tcmalloc_search=search, tcmalloc=chosen, tcmalloc_missing=missing)


def refuse_stage(facts: Facts, decision: Decision) -> Decision:
    """A caller's entry the trust rule refuses: nothing changes (the launcher refuses)."""
    callers = [c for s in decision.searches for c in s.candidates if c.origin == Origin.LD_PRELOAD]
    refused = tuple(c for c in callers if c.unsafe)
    chosen = tuple(c for c in (decision.tcmalloc, decision.iomp) if c is not None)
    return replace(decision, refused=refused, chosen=() if refused else chosen)


def compose_ld_preload(
    current: Sequence[PreloadEntry], additions: Sequence[str]
) -> tuple[str, tuple[str, ...]]:
    """New LD_PRELOAD (additions first, the caller's entries kept in order) and the entries
    dropped: libgomp beside an Intel/LLVM runtime, as vLLM asserts not both are preloaded
    (vllm/utils/ompmultiprocessing.py). Dropped is what vLLM would read as libgomp."""
    entries = [e.path for e in current]
    added = [path for path in additions if path not in entries]
    has_iomp = any(e.kind.kmp for e in current) or any(library_of(a).kmp for a in added)
    dropped = tuple(e for e in entries if has_iomp and vllm_reads_gnu(e))
    return ":".join(e for e in added + entries if e not in dropped), dropped


def env_stage(facts: Facts, decision: Decision) -> Decision:
    """LD_PRELOAD, KMP_BLOCKTIME and the rule's variables, only what changes: the caller's
    KMP_BLOCKTIME is never replaced; a default (5, or the rule's) fills it in beside iomp."""
    host, applied = facts.host, decision.applied
    env: dict[str, str] = {}
    dropped: tuple[str, ...] = ()
    if decision.chosen:
        composed, dropped = compose_ld_preload(host.preload, [c.path for c in decision.chosen])
        if composed != ":".join(e.path for e in host.preload):  # else theirs as set
            env[LD_PRELOAD] = composed
    chosen = None if decision.refused else facts.settings.kmp_blocktime
    callers = host.environ.get(BLOCKTIME_VARIABLE)
    default = dict(applied.variables).get(BLOCKTIME_VARIABLE) if applied else None
    problem = None
    if chosen is None and any(c.kind == IOMP for c in decision.chosen):
        if callers is None:
            chosen = default or (None if decision.yours else DEFAULT_KMP_BLOCKTIME)
        else:
            problem = blocktime_problem(callers)  # the caller's is kept, but said
    if chosen is not None and callers != chosen:
        env[BLOCKTIME_VARIABLE] = chosen
    if applied and decision.chosen:
        env.update((k, v) for k, v in applied.variables if k != BLOCKTIME_VARIABLE)
    return replace(decision, env=tuple(env.items()), dropped=dropped, blocktime_problem=problem)


def mark_stage(facts: Facts, decision: Decision) -> Decision:
    """The plan's mark for vLLM's plugin (docs/design.md, "The plugin"): libgomp kept for SD,
    or a start whose LD_PRELOAD names a runtime (ours or the caller's) the launcher hands on."""
    env = dict(decision.env)
    planner, environ = facts.planner, facts.host.environ
    never, sd = decision.mode == Mode.NEVER, facts.speculative.requested
    mark = None
    if decision.iomp is None and (never or (sd and not decision.yours)):  # libgomp kept
        mark = planner.value + ("" if never or not decision.iomp_missing else NOT_FOUND_MARK)
    elif planner == Planner.LAUNCHER and vllm_reads(
        env.get(LD_PRELOAD, environ.get(LD_PRELOAD, ""))
    ):
        mark = planner.value + STARTED_MARK
    if mark and not decision.refused and environ.get(PLANNED_VARIABLE) != mark:
        env[PLANNED_VARIABLE] = mark
    if facts.alias and not facts.alias_problem:
        env[PYTHONPATH] = pythonpath_with(facts.alias, environ)
    return replace(decision, env=tuple(env.items()), mark=mark)


def nodes_stage(facts: Facts, decision: Decision) -> Decision:
    """CPU_VISIBLE_MEMORY_NODES, where vLLM would bind a worker to a node without the
    CPUs this process may run on (vLLM #43240; shape.visible_nodes)."""
    shape, release = facts.host.shape, version_key(facts.release.release or "")
    nodes = shape and visible_nodes(shape, facts.host.environ, release)
    return replace(decision, env=(*decision.env, (VISIBLE_NODES, nodes))) if nodes else decision


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
    nodes_stage,
    mark_stage,
)


def decide(facts: Facts) -> Decision:
    """The decision for `facts`: every stage in turn."""
    decision = Decision()
    for stage in STAGES:
        decision = stage(facts, decision)
    return decision


LIBRARY_TITLES: dict[str, str] = {IOMP: "Intel OpenMP (libiomp5.so)", TCMALLOC: "tcmalloc"}
STRICT_REFUSAL = "--strict: not starting"
# The caller's variables a plan reads and never changes: the decision record's `inputs`.
CALLER_VARIABLES = (
    LD_PRELOAD,
    BLOCKTIME_VARIABLE,
    THREADS_VARIABLE,
    BIND_VARIABLE,
    RESERVED_VARIABLE,
)
# Every JSON output starts with {"schema": schema(OUTPUT)}: its layout, versioned.
SCHEMA_VERSION = 2


def schema(output: str) -> str:
    """`vllm-cpu-launch/plan/2`: which output this is, and the version of its layout."""
    return f"vllm-cpu-launch/{output}/{SCHEMA_VERSION}"


@record
class Preload:
    kind: str
    path: str
    flavor: str | None
    origin: Origin


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
    relies_on: tuple[tuple[str, str], ...] = ()  # the caller's, kept: a unit must carry them
    scope: Scope | None = None  # what a tune of this launch measures (settings.py)
    rule: Rule | None = None  # the benchmark map's rule applied, with its figures
    runtime: Rule | None = None  # the runtimes rule that let LLVM's libomp stand in
    tuned: Tuned | None = None  # the tune record applied
    inputs: tuple[tuple[str, str | None], ...] = ()  # CALLER_VARIABLES, None where unset
    refused: tuple[str, ...] = ()  # the caller's entries the trust rule refuses (exit 126)
    fatal: tuple[str, ...] = ()  # --strict's not-found messages (exit 3), in warnings too
    metadata: Alias | None = None  # the `vllm` metadata supplied to a vllm-cpu install
    overridden: tuple[Override, ...] = ()  # with SD: vLLM's in bound workers
    shape: Shape | None = None  # the CPUs this launch gets (shape.py)
    use: Use | None = None  # whose they are at start (shape.host_use); None: not asked


def missing_message(search: Search, install: str, consequence: str, llvm: bool = False) -> str:
    """Not found: where it looked, what it refused, and the one fix that works here (for
    a library refused only for who may change it, that change, not another copy)."""
    rejected = ", ".join(f"{c.path or repr(c.path)} ({c.reason})" for c in search.candidates)
    tried = f"; rejected: {rejected}" if rejected else ""
    unsafe = next((c for c in search.candidates if c.fix), None)
    fix = f"{unsafe.fix}  (then {unsafe.path} is trusted)" if unsafe else install
    title = "LLVM's libomp (a libiomp5.so)" if llvm else LIBRARY_TITLES[search.kind]
    places = ", ".join(search.places)
    return f"{title} not found (searched {places}{tried}); {consequence}. Fix: {fix}"


def why(
    mode: Mode, sd: SpeculativeRequest, auto_iomp: bool, tuned: Tuned | None, named: str = ""
) -> str:
    """Why Intel OpenMP is wanted or not, for the INFO line (and where a tune decided it).
    `named`: the iomp setting as said_setting names it, where the user's setting decided."""
    if mode != Mode.AUTO:
        reason = named if named and tuned is None else f"--iomp {mode}"
    elif sd.requested:
        reason = f"speculative decoding requested by {sd.source}"
    elif auto_iomp:
        reason = "exec preloads Intel OpenMP unless --iomp never"
    else:
        reason = "no speculative decoding requested"
        if sd.near_miss:
            reason += f" ({sd.near_miss[0]}: did you mean {sd.near_miss[1]}?)"
    return reason if tuned is None else f"{reason} (from tune {tuned.when}: {tuned.result})"


def without_entry(current: Sequence[PreloadEntry], entry: str) -> str:
    """The command that removes `entry` from the caller's LD_PRELOAD, keeping the rest."""
    import shlex  # lazy: only in a refusal (it imports re)

    rest = [e.path for e in current if e.path != entry]
    return f"export LD_PRELOAD={shlex.quote(':'.join(rest))}" if rest else "unset LD_PRELOAD"


def refusal(candidate: Candidate) -> str:
    """The one line for a caller's LD_PRELOAD entry the trust rule refuses."""
    fix = candidate.fix or "make it and its directories writable by root alone"
    return (
        f"your LD_PRELOAD entry {candidate.path} is {candidate.reason}, which the trust "
        f"rule refuses; Fix: {fix}"
    )


LOADER_SKIPS = (  # an LD_PRELOAD entry it cannot load
    "the loader will print 'ERROR: ld.so: object {} ... cannot be preloaded' in every vLLM "
    "process and go on without it"
)


def callers_words(facts: Facts, decision: Decision) -> tuple[list[str], list[str], list[str]]:
    """The warnings on the caller's LD_PRELOAD, each entry said once: (a runtime of theirs
    that cannot be used; an entry a search examined and rejected; any other entry that will
    not load, issue 31). An entry a search examined is said by it or not here (an unsafe
    one is refused), one the plan drops as dropped."""
    examined = [c for s in decision.searches for c in s.candidates if c.origin == Origin.LD_PRELOAD]
    preloads = "the loader will preload it all the same"
    loaded = {entry: preloads for entry, found in facts.entries if found.reason is None}
    broken = [
        f"your LD_PRELOAD entry {c.path} is no usable Intel OpenMP ({c.reason}): "
        f"{loaded.get(c.path, LOADER_SKIPS.format(c.path))}; nothing is preloaded beside it "
        "(it stays as you set it), so no Intel OpenMP serves vLLM; "
        f"Fix: {without_entry(facts.host.preload, c.path)}"
        for c in decision.broken
        if not c.unsafe
    ]
    rejected = [
        f"your LD_PRELOAD entry {c.path} stays as you set it, but it is no usable {c.kind} "
        f"library: {c.reason}"
        for c in examined
        if c.verdict == CandidateVerdict.REJECTED
        and not c.unsafe
        and not (c.kind == IOMP and c.path in decision.yours)  # broken
    ]
    said = {c.path for c in examined}.union(decision.dropped)
    others = [entry_words(e, found) for e, found in facts.entries if found.reason and e not in said]
    return broken, rejected, others


def entry_words(entry: str, found: Finding) -> str:
    """Another entry of the caller's that will not load as meant: unsafe, or unloadable."""
    if found.unsafe:
        fix = f"; Fix: {found.fix}" if found.fix else ""
        return (
            f"your LD_PRELOAD entry {entry} is {found.reason}: the loader will preload it into "
            f"every vLLM process all the same; it stays as you set it{fix}"
        )
    return (
        f"your LD_PRELOAD entry {entry} cannot be preloaded ({found.reason}): "
        f"{LOADER_SKIPS.format(entry)}; it stays as you set it"
    )


def missing_words(facts: Facts, decision: Decision) -> list[str]:
    """A wanted library not found: where it looked, and the fix (--strict: fatal)."""
    refuses = facts.settings.strict and facts.planner == Planner.LAUNCHER
    family = wanted_on(facts.host.machine)
    llvm = opt_in_on(facts.host.machine)
    said = []
    if decision.iomp_missing and not decision.broken and decision.iomp_search:
        consequence = "the program will use GNU libgomp"
        if facts.speculative.requested and not llvm:
            consequence = "speculative decoding on CPU runs about 2x slower with GNU libgomp"
        consequence = STRICT_REFUSAL if refuses else consequence
        install = facts.install_fixes[family.value]
        said.append(missing_message(decision.iomp_search, install, consequence, llvm))
    if decision.tcmalloc_missing and decision.tcmalloc_search:
        consequence = STRICT_REFUSAL if refuses else "vLLM will use glibc's malloc"
        install = facts.install_fixes[TCMALLOC]
        said.append(missing_message(decision.tcmalloc_search, install, consequence))
    return said


def warnings_of(facts: Facts, decision: Decision) -> tuple[list[str], list[str], list[str]]:
    """(warnings, the target's unsafe problems, --strict's fatal messages), in order."""
    unsafe = [f"{text}; Fix: {fix}" if fix else text for text, fix in facts.target_problems]
    said = [*facts.settings.deprecated, *filter(None, [facts.speculative.note])]
    if decision.release_gate != ReleaseStatus.OLDER:  # an older vLLM refuses SD on CPU altogether
        said += facts.speculative.refusals
    said += [*filter(None, [facts.target.disagreement]), *unsafe]
    if decision.machine_gate == MachineGate.OFF and decision.mode == Mode.ALWAYS:
        said.append(machine_words(facts.host.machine))
    if decision.yours and decision.mode == Mode.NEVER and not decision.wants_iomp:
        names = ", ".join(decision.yours)
        said.append(
            f"{said_setting(facts.settings, 'iomp')}, but your LD_PRELOAD names {names}: "
            "it stays as you set it"
        )
    if decision.other_malloc and facts.settings.tcmalloc == Mode.ALWAYS:
        said.append(
            f"{said_setting(facts.settings, 'tcmalloc')}, but your LD_PRELOAD names "
            f"{', '.join(decision.other_malloc)}:"
            " it stays as you set it, no tcmalloc beside it"
        )
    broken, rejected, others = callers_words(facts, decision)
    missing = missing_words(facts, decision)
    said += broken + missing + rejected + others
    said += [
        f"removed {entry} from LD_PRELOAD: vLLM refuses to start with both libgomp and "
        "Intel's (or LLVM's) OpenMP preloaded"
        for entry in decision.dropped
    ]
    if decision.blocktime_problem:
        said.append(
            f"{decision.blocktime_problem} (yours is kept; --kmp-blocktime "
            f"{DEFAULT_KMP_BLOCKTIME} overrides it)"
        )
    if facts.alias and facts.alias_problem:
        (problem, fix), directory = facts.alias_problem, facts.alias.directory
        where = f" from {directory}" if directory else ""
        fix = f"; Fix: {fix}" if fix else ""
        said.append(
            f"not supplying vLLM's missing `vllm` metadata{where}: {problem}, so `vllm` may "
            f"fail with PackageNotFoundError{fix}"
        )
    shape = facts.host.shape
    said += filter(None, [visible_nodes_problem(shape, facts.host.environ) if shape else None])
    refuses = facts.settings.strict and facts.planner == Planner.LAUNCHER
    return said, unsafe, missing if refuses else []


def machine_words(machine: str) -> str:
    message = f"not preloading Intel OpenMP: this host is {machine}, not x86-64"
    if opt_in_on(machine):
        message += "; LLVM's libomp is opt-in here until measured: --iomp always"
    return message


def notes_of(facts: Facts, decision: Decision) -> list[str]:
    """The notes (-v, --dry-run), in the order the decision was made."""
    target = facts.target
    said = []
    if target.prefix:
        owner = f"{target.executable}'s" if target.found_via == "program" else "vLLM's"
        said.append(f"{owner} environment: {target.prefix} ({target.evidence})")
    said += facts.tune_notes
    if decision.tune_dropped and facts.tuned:
        said.append(
            f"tune of {facts.tuned.when} not applied after all: it kept libgomp "
            f"({facts.tuned.result}), but speculative decoding gets Intel OpenMP unless "
            "you set iomp: never"
        )
    machine = facts.host.machine
    if decision.machine_gate == MachineGate.OPT_IN:
        said.append(
            f"--iomp always on {machine}: LLVM's libomp, never measured on such a host "
            "(the runtimes map ran on x86-64)"
        )
    elif decision.machine_gate == MachineGate.OFF and decision.mode != Mode.ALWAYS:
        said.append(machine_words(machine))
    if decision.setting.note and decision.setting.rule is None:
        said.append(decision.setting.note)
    runtime, applied = decision.runtime, decision.applied
    if runtime and runtime.rule is None and decision.mode != Mode.AUTO:
        said.append(f"LLVM's libomp preloaded, as iomp always asks: {runtime.note}")
    elif runtime and runtime.rule:
        said.append(runtime.note)
    if not decision.wants_iomp and decision.mode == Mode.AUTO and not facts.auto_iomp:
        said.append("no speculative decoding requested: Intel OpenMP not needed")
    if applied and not applied.tcmalloc and facts.settings.tcmalloc == Mode.AUTO:
        said.append("tcmalloc not preloaded: the map measured this setting without it")
    wanted = decision.tcmalloc_search is not None
    absent = decision.tcmalloc is None and not decision.tcmalloc_missing
    if wanted and absent and not decision.allocators:
        said.append("tcmalloc not found; optional (install libtcmalloc-minimal4)")
    if applied and decision.chosen:
        said.append(applied.note)
    if nodes := dict(decision.env).get(VISIBLE_NODES):
        said.append(
            f"{VISIBLE_NODES}={nodes}: the NUMA nodes of the CPUs this process may run on, "
            "where vLLM would bind its worker to the first memory node allowed (vLLM #43240)"
        )
    return said


def reason_of(facts: Facts, decision: Decision) -> str:
    """Why Intel OpenMP is wanted or not, and the rules applied: the INFO line's reason."""
    release, iomp = facts.release, decision.iomp
    named = said_setting(facts.settings, "iomp")
    reasons = [why(decision.mode, facts.speculative, facts.auto_iomp, decision.tuned, named)]
    if decision.release_gate == ReleaseStatus.OLDER:
        reasons.append(f"{release.note}: starting it unchanged; --iomp always preloads anyway")
    elif decision.release_gate == ReleaseStatus.NEWER:
        reasons.append(release.note)
    if decision.yours and decision.wants_iomp:
        reasons.append("your LD_PRELOAD names an OpenMP runtime: kept as set, nothing added")
    runtime = decision.runtime.rule if decision.runtime else None
    if runtime and iomp in decision.chosen:
        reasons.append(f"runtimes rule {runtime.id}")
    applied = decision.applied
    if applied and applied.rule and decision.chosen:
        reasons.append(f"map rule {applied.rule.id}")
    return "; ".join(reasons)


def relies_on(facts: Facts, decision: Decision) -> tuple[tuple[str, str], ...]:
    """The caller's variables the plan keeps and depends on (a unit must carry them)."""
    environ, env = facts.host.environ, dict(decision.env)
    relied = [LD_PRELOAD, BLOCKTIME_VARIABLE] if decision.chosen or decision.yours else []
    if decision.setting.read:  # the rules read these
        relied += [BIND_VARIABLE, RESERVED_VARIABLE, BLOCKTIME_VARIABLE, THREADS_VARIABLE]
    kept = {name: environ[name] for name in relied if name in environ}
    return tuple((name, value) for name, value in kept.items() if name not in env)


def said(facts: Facts, decision: Decision) -> Plan:
    """The plan as printed and executed: the decision, and the words derived from it."""
    warnings, unsafe, fatal = warnings_of(facts, decision)
    chosen = decision.chosen
    runtime = decision.runtime.rule if decision.runtime else None
    applied = decision.applied
    environ = {**facts.host.environ, **dict(decision.env)}  # what vLLM starts with
    overridden = bound_worker_overrides(environ) if facts.speculative.requested else ()
    # A rule's own value needs no such note: the rule says where it reaches (shapes-1).
    ours = applied.variables if applied else ()
    overridden = tuple(o for o in overridden if (o.name, o.value) not in ours)
    overridden_note = (override_words(overridden),) if overridden else ()
    return Plan(
        command=(facts.target.executable, *facts.arguments),
        speculative=facts.speculative,
        reason=reason_of(facts, decision),
        preload=tuple(Preload(c.kind, c.path, c.flavor, c.origin) for c in chosen),
        env=decision.env,
        warnings=tuple(warnings),
        notes=(*notes_of(facts, decision), *overridden_note),
        candidates=tuple(c for s in decision.searches for c in s.candidates),
        missing=(IOMP,) * decision.iomp_missing + (TCMALLOC,) * decision.tcmalloc_missing,
        unsafe=tuple(unsafe),
        relies_on=relies_on(facts, decision),
        scope=facts.scope,
        rule=applied.rule if applied and chosen else None,
        runtime=runtime if decision.iomp in chosen else None,
        tuned=decision.tuned,
        inputs=tuple((n, facts.host.environ.get(n)) for n in CALLER_VARIABLES),
        refused=tuple(refusal(c) for c in decision.refused),
        fatal=tuple(fatal),
        metadata=facts.alias if facts.alias and not facts.alias_problem else None,
        overridden=overridden,
        shape=facts.host.shape,
        use=facts.host.use,
    )


def plan_of(facts: Facts) -> Plan:
    """The plan for the gathered facts: decided, then said."""
    return said(facts, decide(facts))


def rule_json(rule: Rule | None) -> dict[str, Any] | None:
    """A measured rule in the decision record (its `rule` and `runtime`)."""
    if rule is None:
        return None
    said = {key: getattr(rule, key) for key in ("id", "adds", "figures", "versus", "source")}
    paired = list(rule.paired) if rule.paired else None  # None: a gain in every round
    return {**said, "figures": list(rule.figures), "paired": paired}


def plan_as_json(plan: Plan) -> dict[str, Any]:
    """The decision record (docs/design.md): `--dry-run --json`, `env --format json`, doctor."""
    tuned, speculative = plan.tuned, ("requested", "source", "method", "tokens")
    preload = ("kind", "path", "flavor", "origin")
    candidate = ("kind", "path", "origin", "flavor", "verdict", "reason")
    return {
        "schema": schema("plan"),
        "command": list(plan.command),
        "speculative": {key: getattr(plan.speculative, key) for key in speculative},
        "reason": plan.reason,
        "rule": rule_json(plan.rule),
        "runtime": rule_json(plan.runtime),
        "tune": tuned and {"when": tuned.when, "result": tuned.result, "origin": tuned.origin},
        "inputs": dict(plan.inputs),
        "preload": [{key: getattr(p, key) for key in preload} for p in plan.preload],
        "env": dict(plan.env),
        "relies_on": dict(plan.relies_on),
        **{key: list(getattr(plan, key)) for key in ("warnings", "notes", "missing", "unsafe")},
        "refused": list(plan.refused),
        "shape": shape_json(plan.shape),
        "host_use": plan.use and {"kind": str(plan.use.kind), "why": plan.use.why},
        "candidates": [{key: getattr(c, key) for key in candidate} for c in plan.candidates],
    }


def summary_line(plan: Plan, unchanged: str | None = None) -> str:
    """The one INFO line: what is preloaded, what is set, and why (the plan's mark is
    bookkeeping: --dry-run shows it). `unchanged`: what to say when nothing changes."""
    parts = [
        f"{'keeping your' if p.origin == Origin.LD_PRELOAD else 'preloading'} {p.path} "
        f"({p.flavor or p.kind}, from {p.origin})"
        for p in plan.preload
    ]
    shown = (LD_PRELOAD, PLANNED_VARIABLE, PYTHONPATH if plan.metadata else "")
    parts += [f"{name}={value}" for name, value in plan.env if name not in shown]
    if plan.metadata:
        parts.append(metadata_words(plan.metadata))
    if plan.overridden:
        parts.append(override_words(plan.overridden, short=True))
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
    """Where SD was asked for, or turned off (`--speculative-config null` after --config)."""
    return ("requested" if requested else "not requested") + (f" ({source})" if source else "")


def rule_words(rule: dict[str, Any]) -> str:
    """A measured rule of the decision record, with its figures, as --dry-run and doctor say."""
    low, high = rule["figures"]
    paired = rule["paired"]  # None: every round a gain
    rounds = f", faster in {paired[0]} of {paired[1]} paired rounds" if paired else ""
    return (
        f"{rule['id']} adds {rule['adds']}: TPOT {low}-{high}x of {rule['versus']}'s speed"
        f"{rounds} ({rule['source']})"
    )


def plan_as_text(plan: Plan) -> str:
    """The decision record for a person (`--dry-run`): plan_as_json's record, line by line."""
    import shlex  # lazy: only --dry-run

    record = plan_as_json(plan)
    speculative, tune, inputs = record["speculative"], record["tune"], record["inputs"]
    use = record["host_use"]
    sd = described_request(speculative["requested"], speculative["source"])
    method, tokens = speculative["method"], speculative["tokens"]
    sd += f", method {method}" if method is not None else ""
    sd += f", {tokens} tokens" if tokens is not None else ""
    read = [f"{name}={shlex.quote(v)}" for name, v in inputs.items() if v is not None]
    unset = " ".join(name for name, value in inputs.items() if value is None)
    preload = [
        f"{p['kind']} {p['path']} ({p['flavor'] + ', ' if p['flavor'] else ''}{p['origin']})"
        for p in record["preload"]
    ]
    # Each field's lines; its label is on the first alone.
    fields = {
        "command": [shlex.join(record["command"])],
        "speculative": [sd],
        "shape": [record["shape"]["line"]] if record["shape"] else [],
        "cpus": [f"{HOST_WORDS[HostUse(use['kind'])]} ({use['why']})"] if use else [],
        "reason": [record["reason"]],
        "rule": [rule_words(record["rule"])] if record["rule"] else [],
        "runtime": [rule_words(record["runtime"])] if record["runtime"] else [],
        "tune": [f"{tune['when']}: {tune['result']} ({tune['origin']})"] if tune else [],
        "read": [" ".join(read) or "nothing set"] + ([f"unset: {unset}"] if unset else []),
        "preload": preload or ["nothing"],
        "env": [f"{n}={shlex.quote(v)}" for n, v in record["env"].items()] or ["unchanged"],
        "metadata": [metadata_words(plan.metadata)] if plan.metadata else [],
        "relies on": [
            f"{n}={shlex.quote(v)} (yours, kept)" for n, v in record["relies_on"].items()
        ],
    }
    lines = [
        f"{'' if index else label + ':':<12} {line}"
        for label, said in fields.items()
        for index, line in enumerate(said)
    ]
    each = ("refused", "warnings", "unsafe", "missing", "notes")  # singular, on every line
    lines += [f"{key.rstrip('s') + ':':<12} {line}" for key in each for line in record[key]]
    lines += [
        f"candidate:   {c['kind']} {c['verdict']:<8} {c['path'] or repr(c['path'])} "
        f"(from {c['origin']}{', ' + c['flavor'] if c['flavor'] else ''}): {c['reason']}"
        for c in record["candidates"]
    ]
    return "\n".join(lines)
