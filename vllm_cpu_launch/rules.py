"""The measured rules, as data, and the one matcher of them against a start. A rule only
*adds* what the user left unset, where every condition it was measured under holds and every
paired round was a gain, or, choosing between two settings the plan gives anyway, where a
sign test of its pairs says so (`Rule.paired`; docs/benchmarks.md; tests/test_rules.py
recomputes every figure).
Nothing in the matcher names a rule or a host: changing a rule is an edit of the table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_cpu_launch.handoff import LD_PRELOAD
from vllm_cpu_launch.messages import StrEnum
from vllm_cpu_launch.records import record
from vllm_cpu_launch.runtimes import vllm_reads_kmp
from vllm_cpu_launch.settings import Mode
from vllm_cpu_launch.shape import HostUse

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

MAP = "docs/benchmarks.md, the map"
METHODS_MAP = "docs/benchmarks.md, the SD methods map"
WAITING_MAP = "docs/benchmarks.md, the waiting policies map"
RUNTIMES_MAP = "docs/benchmarks.md, the runtimes map"
SHAPES_MAP = "docs/benchmarks.md, the shapes map"
BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_VARIABLE = "VLLM_CPU_NUM_OF_RESERVED_CPU"
BLOCKTIME_VARIABLE = "KMP_BLOCKTIME"
THREADS_VARIABLE = "OMP_NUM_THREADS"
NOBIND_BLOCKTIME = "200"
PLAIN = "plain vLLM (libgomp as installed)"
REAL_JSON = "docs/bench_vllm_real.json"
LOAD_JSON = "docs/bench_vllm_load.json"
REAL_MODEL = "SmolLM2-135M-Instruct"  # scripts/real_model.py makes it
LLVM_ADDS = "LLVM's libomp, no Intel OpenMP being found"


class Allocator(StrEnum):
    """A malloc measured with, added, or in the caller's LD_PRELOAD."""

    TCMALLOC = "tcmalloc"
    OTHER = "other"  # another malloc (jemalloc, mimalloc): the caller's
    NONE = "none"  # measured without one


@record
class Measured:
    """Where a rule was measured: every condition must hold on a start for it to apply."""

    method: str  # vLLM's SD method
    tokens: int | None = None  # num_speculative_tokens (None: any)
    machine: str = "x86_64"
    cpus: int = 2  # usable CPUs (sched_getaffinity)
    vllm: str = "0.32"  # the release series
    workers: int = 1  # workers, on one node
    bindings: tuple[str, ...] = ("",)  # VLLM_CPU_OMP_THREADS_BIND as measured ("": unset)
    # The caller's variables it needs unset ("KMP_BLOCKTIME": unset or the rule's value).
    unset: tuple[str, ...] = (RESERVED_VARIABLE, THREADS_VARIABLE, BLOCKTIME_VARIABLE)
    allocator: Allocator = Allocator.NONE  # measured with tcmalloc preloaded, or without
    within: tuple[str, ...] = ()  # a runtimes rule's: measured where one of these applies
    # Whose the CPUs were (shape.HostUse): the maps ran on an idle host, vLLM's own.
    hosts: tuple[HostUse, ...] = (HostUse.OWN,)


@record
class RealWeights:
    """A rule re-judged on REAL_MODEL's weights, one request at a time: its drafts are
    accepted as users see them (the random-weights maps' never are)."""

    figures: tuple[float, float]  # lowest and highest median TPOT ratio over its drafts
    accepted: tuple[float, float]  # the share of drafted tokens accepted, lowest and highest


@record
class AtLoad:
    """A rule re-judged at one client concurrency on REAL_MODEL's weights (the map at load)."""

    concurrency: int
    figures: tuple[float, float]  # lowest and highest median TPOT ratio over its drafts
    held: bool  # a gain in every paired round of every draft


@record
class Rule:
    """A measured rule and the figures it rests on, so every claim can be recomputed from
    `evidence`; a non-rule (`adds` "nothing") records a measurement that was no gain, `why`."""

    id: str
    adds: str  # what it adds, in words
    figures: tuple[float, float]  # lowest and highest median TPOT ratio (> 1 = faster)
    source: str  # where they were measured
    measured: Measured
    evidence: str  # the kept run's JSON file, from the repository's root
    variables: tuple[tuple[str, str], ...] = ()  # the variables it adds, if left unset
    allocator: Allocator | None = None  # the allocator it adds
    runtime: str | None = None  # the OpenMP runtime it lets stand in
    why: str = ""  # a non-rule's reason
    real: RealWeights | None = None  # None: not run on real weights (EAGLE: no trained head)
    load: tuple[AtLoad, ...] = ()  # re-judged per concurrency; () where not (EAGLE)
    versus: str = PLAIN  # what the figures compare with
    # (faster, pairs): a choice between two settings of the plan's own (`versus` the other),
    # faster in most paired rounds, not all; None: a gain in every round.
    paired: tuple[int, int] | None = None


HOST_WORDS = {
    HostUse.OWN: "CPUs of vLLM's own",
    HostUse.QUOTA: "a cgroup CPU quota",
    HostUse.SHARED: "CPUs shared with other work",
    HostUse.UNKNOWN: "CPUs whose use is unknown",
}
LOAD_LEVELS = (1, 4, 8)  # the concurrencies of the map at load


def loads(*figures: tuple[float, float], lost: tuple[int, ...] = ()) -> tuple[AtLoad, ...]:
    """A rule's figures at each of LOAD_LEVELS; `lost`: where some round was no gain."""
    return tuple(
        AtLoad(n, pair, n not in lost) for n, pair in zip(LOAD_LEVELS, figures, strict=True)
    )


UNBOUND = ((BIND_VARIABLE, "nobind"), (BLOCKTIME_VARIABLE, NOBIND_BLOCKTIME))
MAP_JSON = "docs/bench_vllm_map.json"
METHODS_JSON = "docs/bench_vllm_methods.json"
# Every measured rule and non-rule: the one table the plan, `rules` and the tests read.
RULES = (
    Rule(
        "map-1",
        f"{BIND_VARIABLE}=nobind and {BLOCKTIME_VARIABLE}={NOBIND_BLOCKTIME}, no tcmalloc",
        (1.19, 1.42),
        MAP,
        Measured("ngram"),
        MAP_JSON,
        UNBOUND,
        real=RealWeights((1.39, 1.39), (0.93, 0.93)),
        load=loads((1.22, 1.22), (1.27, 1.27), (1.28, 1.28)),
    ),
    Rule(
        "map-2",
        f"{BLOCKTIME_VARIABLE}={NOBIND_BLOCKTIME} under your {BIND_VARIABLE}=nobind, no tcmalloc",
        (1.32, 1.55),
        MAP,
        Measured("ngram", bindings=("nobind",), unset=(THREADS_VARIABLE, BLOCKTIME_VARIABLE)),
        MAP_JSON,
        UNBOUND[1:],
        real=RealWeights((1.47, 1.47), (0.93, 0.93)),
        load=loads((1.50, 1.50), (1.30, 1.30), (1.28, 1.28)),
        versus="libgomp under nobind",
    ),
    Rule(
        "methods-4",
        f"tcmalloc, {BIND_VARIABLE}=nobind and {BLOCKTIME_VARIABLE}={NOBIND_BLOCKTIME}",
        (1.31, 1.51),
        METHODS_MAP,
        Measured("eagle", 3, allocator=Allocator.TCMALLOC),
        METHODS_JSON,
        UNBOUND,
        Allocator.TCMALLOC,
    ),
    Rule(
        "methods-none-3",
        "nothing",
        (0.86, 1.45),
        METHODS_MAP,
        Measured("draft_model", 3, allocator=Allocator.TCMALLOC),
        METHODS_JSON,
        why="at 1 request its rounds ranged 0.86-1.45x",
    ),
    # methods-4 for draft_model with 7 tokens until the real weights re-judged it.
    Rule(
        "methods-none-7",
        "nothing",
        (1.22, 1.41),
        METHODS_MAP,
        Measured("draft_model", 7, allocator=Allocator.TCMALLOC),
        METHODS_JSON,
        why=f"on {REAL_MODEL}'s real weights, drafting for itself (95 % of drafts accepted), "
        "its rounds ranged 1.00-1.26x (the first 0.999x), though a gain in every round with a "
        "4-layer draft (0 %) and on random weights",
        real=RealWeights((1.09, 1.46), (0.0, 0.95)),
        # At load the self-draft lost one round at 4 requests (0.72x): still no rule.
        load=loads((1.52, 1.59), (1.48, 1.57), (1.50, 1.61), lost=(4,)),
    ),
    Rule(
        "runtimes-1",
        LLVM_ADDS,
        (1.24, 1.33),
        RUNTIMES_MAP,
        Measured("ngram", within=("map-1", "map-2")),
        "docs/bench_vllm_runtimes.json",
        runtime="llvm",
        real=RealWeights((1.57, 1.57), (0.93, 0.93)),
        load=loads((1.52, 1.52), (1.29, 1.29), (1.24, 1.24)),
        versus="libgomp under nobind",
    ),
    Rule(
        "runtimes-2",
        LLVM_ADDS,
        (1.68, 1.70),
        RUNTIMES_MAP,
        Measured("eagle", 3, within=("methods-4",)),
        "docs/bench_vllm_drafter_runtimes.json",
        runtime="llvm",
    ),
    # methods-4 for draft_model 7 is gone: on the map's host this now applies nowhere
    # (`within`), off it by method alone.
    Rule(
        "runtimes-3",
        LLVM_ADDS,
        (1.37, 1.39),
        RUNTIMES_MAP,
        Measured("draft_model", 7, within=("methods-4",)),
        "docs/bench_vllm_draft_model_runtimes.json",
        runtime="llvm",
        real=RealWeights((1.21, 1.21), (0.95, 0.95)),
        load=loads((1.47, 1.47), (1.49, 1.49), (1.50, 1.50)),
    ),
    # Issue 46: beside other tenants, vLLM's binding (map-1's unbound team waits at every
    # barrier for a thread a tenant preempted, 0.49-0.64x of plain), and the API server's and
    # engine core's threads asleep at once instead of spinning 5 ms on CPUs others need.
    Rule(
        "shapes-1",
        f"{BLOCKTIME_VARIABLE}=0 in the API server and engine core (vLLM sets 5 in the "
        "worker it binds)",
        (1.02, 1.12),
        SHAPES_MAP,
        Measured("ngram", 3, bindings=("", "auto"), hosts=(HostUse.SHARED,)),
        "docs/bench_vllm_shapes/confirm2-tenants-2.json",
        ((BLOCKTIME_VARIABLE, "0"),),
        versus=f"the plan's default {BLOCKTIME_VARIABLE}=5",
        paired=(20, 24),
    ),
    Rule(
        "shapes-none-quota",
        "nothing",
        (0.82, 0.99),
        SHAPES_MAP,
        Measured("ngram", 3, hosts=(HostUse.QUOTA,)),
        "docs/bench_vllm_shapes/screen-quota-1.0.json",
        why="under a cgroup quota of 1.0 of 2 CPUs, map-1's setting ran at 0.82x of plain "
        f"vLLM's speed on {REAL_MODEL}'s real weights at 1 request (0.99x at 4), and every "
        "unbound block time, its team sized to the quota too, lost at 1 request "
        "(0.50-0.92x); libiomp5 bound as vLLM binds ran at 1.03x at 1 request, slower in no "
        "round of 4, and 0.97x at 4, and in a second run 0.99x and 0.92x, no verdict",
    ),
    Rule(
        "runtimes-none",
        "nothing",
        (0.98, 1.01),
        RUNTIMES_MAP,
        Measured("draft_model", 3, bindings=("", "auto")),
        "docs/bench_vllm_draft_model_runtimes.json",
        runtime="llvm",
        why="at vLLM's binding (the setting the plan gives draft_model with 3 tokens, which "
        "has no map rule) it measured 0.98-1.01x of libgomp, a loss at 4 requests in every "
        "round",
        versus="libgomp",
    ),
)


def rule(rule_id: str) -> Rule:
    return next(r for r in RULES if r.id == rule_id)


def measured_key(item: Rule) -> tuple[str, int | None]:
    return item.measured.method, item.measured.tokens


NGRAM_UNBOUND = rule("map-1")
NGRAM_NOBIND = rule("map-2")
MAP_CPUS = NGRAM_UNBOUND.measured.cpus
MAP_VLLM = NGRAM_UNBOUND.measured.vllm
# (vLLM's method, num_speculative_tokens) -> the unbound rule with tcmalloc.
DRAFTER_RULES = {measured_key(r): r for r in RULES if r.id == "methods-4"}


def figures(low_high: tuple[float, float]) -> str:
    low, high = low_high
    return f"{low:.2f}x" if low == high else f"{low:.2f}-{high:.2f}x"


def real_words(rule: Rule) -> str:
    if rule.source == SHAPES_MAP:
        return f"its figures: the shapes map serves {REAL_MODEL}'s real weights"
    if rule.real is None:
        return "not run (no trained EAGLE head)" if rule.measured.method == "eagle" else "not run"
    low, high = (round(100 * share) for share in rule.real.accepted)
    accepted = f"{low} %" if low == high else f"{low}-{high} %"
    return f"{figures(rule.real.figures)} at {accepted} accepted"


def load_words(rule: Rule) -> str:
    if not rule.load:
        return "not run"
    return ", ".join(
        f"{figures(at.figures)} at {at.concurrency}{'' if at.held else ' (not every round)'}"
        for at in rule.load
    )


def rounds_words(rule: Rule) -> str:
    if rule.paired is None:
        return "every round a gain"
    faster, pairs = rule.paired
    return f"faster in {faster} of {pairs} paired rounds"


def described(rule: Rule, kind: str = "map rule") -> str:
    said = f"TPOT {figures(rule.figures)} of {rule.versus}'s speed"
    if rule.source == SHAPES_MAP:
        said += f" on {REAL_MODEL}'s real weights, {rounds_words(rule)}"
    else:
        said += (
            f" on the 105M model, {rounds_words(rule)}; on {REAL_MODEL}'s real weights "
            f"{real_words(rule)}"
        )
    return f"{kind} {rule.id} (adds {rule.adds}: {said}; {rule.source})"


# What vLLM sets in each worker it binds (any binding but nobind), over what the front end
# hands on: OMP_NUM_THREADS always, KMP_BLOCKTIME=5 where LD_PRELOAD names libiomp or libomp
# (OMPProcessManager.configure_omp_envs).
BOUND_WORKERS_SOURCE = "vllm/utils/ompmultiprocessing.py:78,89, vllm-cpu 0.32.0"
BOUND_WORKER_BLOCKTIME = "5"


@record
class Override:
    """A variable vLLM sets anew in each worker it binds, so the user's value stops short."""

    name: str
    value: str
    worker: str


def bound_worker_overrides(environ: Mapping[str, str]) -> tuple[Override, ...]:
    """The variables of `environ` (what vLLM starts with) that vLLM writes over in its bound
    workers, so the user learns where their value stops."""
    if environ.get(BIND_VARIABLE) == "nobind":
        return ()
    blocktime, threads = environ.get(BLOCKTIME_VARIABLE), environ.get(THREADS_VARIABLE)
    kmp = vllm_reads_kmp(environ.get(LD_PRELOAD, ""))  # vLLM's own test
    said = []
    if kmp and blocktime is not None and blocktime != BOUND_WORKER_BLOCKTIME:
        said.append(Override(BLOCKTIME_VARIABLE, blocktime, BOUND_WORKER_BLOCKTIME))
    if threads:
        said.append(Override(THREADS_VARIABLE, threads, "its CPUs' count"))
    return tuple(said)


def override_words(overrides: Sequence[Override], short: bool = False) -> str:
    """Where the values reach and where vLLM writes over them (`short`: the INFO line's)."""
    yours = " ".join(f"{o.name}={o.value}" for o in overrides)
    workers = " ".join(f"{o.name}={o.worker}" for o in overrides)
    if short:
        return (
            f"{yours} in the front end and engine core; {workers} in the workers vLLM binds "
            f"({BIND_VARIABLE}=nobind keeps yours)"
        )
    return (
        f"{yours} reaches the front end and the engine core; vLLM sets {workers} in each "
        f"worker it binds ({BOUND_WORKERS_SOURCE}); {BIND_VARIABLE}=nobind lets yours "
        "through to the workers"
    )


# Why no rule where vLLM binds the worker (tests/test_rules.py recomputes the figure).
BOUND = (
    "vLLM binds the worker there, and bound no runtime measured faster than libgomp (with "
    f"none reserved 0.95-1.05x, {WAITING_MAP})"
)


@record
class Start:
    """What the rules read of one start, so the plan, `rules serve` and doctor match alike."""

    machine: str
    cpus: int  # usable CPUs; 0: not known
    release: str | None  # the target's vLLM release; None: not found
    one_worker: bool
    method: str | None
    tokens: int | None
    environ: Mapping[str, str]
    chosen_blocktime: str | None = None  # --kmp-blocktime (option, variable or config)
    tcmalloc: Mode = Mode.AUTO  # the tcmalloc setting
    tcmalloc_found: bool = False  # a tcmalloc the settings let in was found
    callers_allocator: Allocator | None = None  # TCMALLOC or OTHER: one in their LD_PRELOAD
    vllm_found: bool = True  # False: no vLLM found (release None); True with None: unknown
    callers_runtime: str | None = None  # their LD_PRELOAD's OpenMP runtime: kept, alone
    host: HostUse = HostUse.UNKNOWN  # whose the CPUs are at start (shape.host_use)
    host_why: str = "not watched"  # what showed it


@record
class Miss:
    """One condition of a rule that does not hold here."""

    condition: str  # a field of Measured, or a variable's name
    here: str  # what this start has
    measured: str  # what the rule was measured with


def words(miss: Miss) -> str:
    return f"{miss.here} ({miss.measured})"


def release_words(start: Start) -> str:
    if start.release:
        return f"vLLM {start.release}"
    if start.vllm_found:
        return "vLLM release unknown: no vllm-cpu or vllm dist-info in its environment"
    return "no vLLM found"


def host_misses(where: Measured, start: Start) -> list[Miss]:
    said = []
    if start.machine != where.machine:
        said.append(Miss("machine", start.machine, f"measured on {where.machine}"))
    if start.cpus != where.cpus:
        cpus = f"{start.cpus or 'unknown'} usable CPUs"
        said.append(Miss("cpus", cpus, f"measured on {where.cpus}"))
    if start.host not in where.hosts:
        measured = f"measured on {' or '.join(HOST_WORDS[h] for h in where.hosts)}"
        said.append(Miss("hosts", f"{HOST_WORDS[start.host]}: {start.host_why}", measured))
    if ".".join((start.release or "").split(".")[:2]) != where.vllm:
        said.append(Miss("vllm", release_words(start), f"measured with vLLM {where.vllm}"))
    if not start.one_worker:
        measured = f"measured with {where.workers} worker on one node"
        said.append(Miss("workers", "several workers or nodes", measured))
    return said


def command_misses(where: Measured, start: Start) -> list[Miss]:
    method = start.method or "an unnamed method"
    if start.method != where.method:
        return [Miss("method", f"{method} SD", f"measured with {where.method}")]
    if where.tokens is not None and start.tokens != where.tokens:
        return [Miss("tokens", f"{start.tokens} tokens", f"measured with {where.tokens}")]
    return []


def variable_miss(name: str, start: Start, blocktime: str) -> Miss | None:
    """The caller's variable a rule needs unset, where set (KMP_BLOCKTIME: but to the rule's
    `blocktime`)."""
    if name == BLOCKTIME_VARIABLE:
        value = start.chosen_blocktime or start.environ.get(name)
        if value in (None, blocktime):
            return None
        whose = "--kmp-blocktime" if start.chosen_blocktime else f"your {name}"
        return Miss(name, f"{whose} {value}", f"it needs {blocktime}; yours is kept")
    value = start.environ.get(name)
    if not value:
        return None
    if name == THREADS_VARIABLE:
        return Miss(name, f"your {name}={value}", "never measured unbound")
    return Miss(name, f"your {name} set", f"measured unset: {BOUND}; no rule, no figure claimed")


def setting_misses(where: Measured, start: Start, blocktime: str) -> list[Miss]:
    if where.within:
        return []
    binding = start.environ.get(BIND_VARIABLE, "")
    said = []
    if binding not in where.bindings:
        measured = " or ".join(b or "unset" for b in where.bindings)
        why = f"measured {measured}: {BOUND}; no rule, no figure claimed"
        said.append(Miss("bindings", f"your {BIND_VARIABLE}={binding or 'unset'}", why))
    said += [m for name in where.unset if (m := variable_miss(name, start, blocktime))]
    theirs, tcmalloc = start.callers_allocator, start.tcmalloc
    found = theirs == Allocator.TCMALLOC or (
        not theirs and tcmalloc != Mode.NEVER and start.tcmalloc_found
    )
    if where.allocator == Allocator.NONE and theirs:
        said.append(Miss("allocator", f"your LD_PRELOAD's {theirs} allocator", "measured without"))
    elif where.allocator == Allocator.NONE and tcmalloc == Mode.ALWAYS:
        said.append(Miss("allocator", "tcmalloc set to always", "measured without it"))
    elif where.allocator == Allocator.TCMALLOC and not found:
        said.append(Miss("allocator", "no tcmalloc to preload", "measured with one"))
    return said


def misses(rule: Rule, start: Start) -> list[Miss]:
    """Every condition of `rule` that does not hold for `start`, in the table's order; a
    runtimes rule's setting: one of the rules it was measured `within` applies here."""
    where = rule.measured
    blocktime = dict(rule.variables).get(BLOCKTIME_VARIABLE, NOBIND_BLOCKTIME)
    found = host_misses(where, start) + command_misses(where, start)
    found += setting_misses(where, start, blocktime)
    within = [r for r in RULES if r.id in where.within and not r.why]
    if where.within and all(misses(r, start) for r in within):
        measured = f"measured in {' or '.join(where.within)}'s"
        found.append(Miss("within", "this start's setting", measured))
    return found


def sd_words(start: Start) -> str:
    tokens = f" with {start.tokens} tokens" if start.tokens is not None else ""
    return f"{start.method or 'an unnamed'} SD{tokens}"


# Why no rule adds anything beside the caller's own OpenMP runtime.
KEPT = "your LD_PRELOAD names an OpenMP runtime ({}): kept as set, nothing added"


@record
class Setting:
    """What a rule decides here (a setting rule, or a runtimes rule: llvm_runtime)."""

    rule: Rule | None  # the rule that applies
    note: str  # which applied, or why none did ("" where none was measured near here)
    variables: tuple[tuple[str, str], ...] = ()  # what it adds (the user left unset)
    tcmalloc: bool = False  # measured with tcmalloc: the plan preloads it
    read: bool = False  # a rule measured here for this method read the caller's variables


def setting_rule(start: Start) -> Setting:
    """The setting rule that applies to this start, or which condition stopped the nearest."""
    if start.callers_runtime:
        return Setting(None, KEPT.format(start.callers_runtime))
    table = [r for r in RULES if r.runtime is None]
    here = [r for r in table if not host_misses(r.measured, start)]
    near = [r for r in here if not command_misses(r.measured, start)]
    cpus = f"{start.cpus} CPUs" + (
        "" if start.host == HostUse.OWN else f", {HOST_WORDS[start.host]} ({start.host_why}),"
    )
    where = f"{sd_words(start)} on {cpus} with vLLM {start.release}"
    if not near:
        sources = ", ".join(dict.fromkeys(r.source for r in table))
        note = f"{where}: not measured ({sources}): no rule; libiomp5 as vLLM advises"
        hosted = [
            r for r in table if [m.condition for m in host_misses(r.measured, start)] == ["hosts"]
        ]
        return Setting(None, note if (here or hosted) and start.method else "")
    rule = min(near, key=lambda r: len(misses(r, start)))
    stopped = misses(rule, start)
    if rule.why:
        note = f"{where}: not a gain in every round ({rule.why}; {rule.source}): no rule"
    elif stopped:
        said = "; ".join(words(m) for m in stopped)
        note = f"{described(rule)} not applied for {where}: {said}"
    else:  # it applies: it adds only the variables the user left unset
        chosen = {BLOCKTIME_VARIABLE: start.chosen_blocktime} if start.chosen_blocktime else {}
        mine = {**start.environ, **chosen}
        added = tuple((name, value) for name, value in rule.variables if not mine.get(name))
        tcmalloc = rule.allocator == Allocator.TCMALLOC
        return Setting(rule, f"{described(rule)} applied", added, tcmalloc, read=True)
    return Setting(None, f"{note}; libiomp5 as vLLM advises", read=True)


def llvm_runtime(start: Start) -> Setting:
    """Whether LLVM's libomp stands in for Intel's, by the runtimes rules: off the host they
    were measured on by method alone, at vLLM's settings as libiomp5 would run (the same
    runtime code); never where a non-rule of the method says it was no gain."""
    if start.callers_runtime:
        return Setting(None, KEPT.format(start.callers_runtime))
    where = sd_words(start)
    ours = [r for r in RULES if r.runtime and not command_misses(r.measured, start)]
    loss = next((r for r in ours if r.why), None)
    if loss is not None:
        return Setting(None, f"for {where} {loss.why} ({loss.source})")
    rule = next(iter(ours), None)
    if rule is None:
        sources = ", ".join(dict.fromkeys(r.source for r in RULES if r.runtime))
        return Setting(None, f"not measured against libgomp for {where} ({sources})")
    said = f"{described(rule, 'runtimes rule')}, for {where}"
    if host_misses(rule.measured, start):
        m = rule.measured
        said += (
            f": measured on the map's host ({m.cpus} CPUs, vLLM {m.vllm}) in its map rule's "
            "setting, not on this one, where it runs at vLLM's settings as libiomp5 would"
        )
    elif misses(rule, start):
        within = " or ".join(rule.measured.within)
        return Setting(
            None,
            f"for {where} measured faster than libgomp on this host only in the setting of "
            f"its map rule ({within}), which this start does not get",
        )
    return Setting(rule, said)


def measured_host(start: Start) -> bool:
    return any(not host_misses(r.measured, start) for r in RULES if r.runtime is None)
