"""What the benchmark map says the launcher may add on this host (docs/benchmarks.md).

scripts/bench_vllm.py measured the real vLLM CPU build serving with ngram speculative
decoding on one kind of host (MAP_CPUS usable CPUs, vLLM MAP_VLLM), over model size,
reservation, binding, concurrency and the runtime settings a launcher can choose
(docs/bench_vllm_map.json), then draft-model and EAGLE SD on the same host at vLLM's
default reservation (the SD methods map, docs/bench_vllm_methods.json). Both keep every
run, and tests/test_evidence.py recomputes every figure quoted here from them.

Speculative decoding always gets Intel OpenMP (docs/design.md, "Never slower"); a rule here
only *adds* what the user left unset (the binding, the block time, tcmalloc), where it was
measured (that SD method and token count, that vLLM release on that many CPUs, one worker
on one node), and only where every paired round on the served-shape 105M-parameter model
was a gain. A rule that would change what the user set does not apply, and its note says
which setting stopped it. Elsewhere the launcher does what vLLM advises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_cpu_launch.records import record

if TYPE_CHECKING:
    from collections.abc import Mapping

MAP = "docs/benchmarks.md, the map"
METHODS_MAP = "docs/benchmarks.md, the SD methods map"
WAITING_MAP = "docs/benchmarks.md, the waiting policies map"
RUNTIMES_MAP = "docs/benchmarks.md, the runtimes map"
BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_VARIABLE = "VLLM_CPU_NUM_OF_RESERVED_CPU"
BLOCKTIME_VARIABLE = "KMP_BLOCKTIME"
THREADS_VARIABLE = "OMP_NUM_THREADS"
NOBIND_BLOCKTIME = "200"
# The map's model whose rounds decide (the tiny one is bound by Python, not OpenMP).
SERVED_MODEL = "100m"
PLAIN = "plain vLLM (libgomp as installed)"
LLVM_ADDS = "LLVM's libomp, no Intel OpenMP being found"


@record
class Measured:
    """Where a rule was measured: every condition must hold on a start for it to apply
    (`vllm-cpu-launch rules serve ...` names the first that does not)."""

    method: str  # vLLM's SD method
    tokens: int | None = None  # num_speculative_tokens (None: any)
    machine: str = "x86_64"
    cpus: int = 2  # usable CPUs (sched_getaffinity)
    vllm: str = "0.32"  # the release series
    workers: int = 1  # workers, on one node
    bindings: tuple[str, ...] = ("",)  # VLLM_CPU_OMP_THREADS_BIND as measured ("": unset)
    # The caller's variables it needs unset ("KMP_BLOCKTIME": unset or the rule's value).
    unset: tuple[str, ...] = (RESERVED_VARIABLE, THREADS_VARIABLE, BLOCKTIME_VARIABLE)
    allocator: str = "none"  # "tcmalloc": measured with one preloaded; "none": without
    runtime: str = "intel"  # the OpenMP runtime measured ("llvm": LLVM's libomp)


@record
class Rule:
    """A measured rule: what it adds, and the figures it rests on, the lowest and highest
    median TPOT ratio (> 1 = faster) over the concurrency levels measured on the 105M
    model, every paired round of each a gain; test_evidence.py recomputes them from
    `evidence`, the kept run. A non-rule (`adds` "nothing") records a measurement that
    was no gain in every round, and `why`."""

    id: str
    adds: str  # what it adds, in words
    figures: tuple[float, float]
    versus: str  # what the figures compare with
    source: str  # where they were measured
    measured: Measured | None = None
    evidence: str = ""  # the kept run's JSON file, from the repository's root
    variables: tuple[tuple[str, str], ...] = ()  # the variables it adds, if left unset
    allocator: str | None = None  # the allocator it adds
    runtime: str | None = None  # the OpenMP runtime it lets stand in
    why: str = ""  # a non-rule's reason


UNBOUND = ((BIND_VARIABLE, "nobind"), (BLOCKTIME_VARIABLE, NOBIND_BLOCKTIME))
MAP_JSON = "docs/bench_vllm_map.json"
METHODS_JSON = "docs/bench_vllm_methods.json"
# Every measured rule, and the measured non-rules: the one table the plan, `rules`,
# docs/design.md's table and tests/test_evidence.py read. Changing or removing a rule is
# an edit here and in its evidence test.
RULES = (
    Rule(
        "map-1",
        f"{BIND_VARIABLE}=nobind and {BLOCKTIME_VARIABLE}={NOBIND_BLOCKTIME}, no tcmalloc",
        (1.19, 1.42),
        PLAIN,
        MAP,
        Measured("ngram"),
        MAP_JSON,
        UNBOUND,
    ),
    Rule(
        "map-2",
        f"{BLOCKTIME_VARIABLE}={NOBIND_BLOCKTIME} under your {BIND_VARIABLE}=nobind, no tcmalloc",
        (1.32, 1.55),
        "libgomp under nobind",
        MAP,
        Measured("ngram", bindings=("nobind",), unset=(THREADS_VARIABLE, BLOCKTIME_VARIABLE)),
        MAP_JSON,
        UNBOUND[1:],
    ),
    *(
        Rule(
            "methods-4",
            f"tcmalloc, {BIND_VARIABLE}=nobind and {BLOCKTIME_VARIABLE}={NOBIND_BLOCKTIME}",
            figures,
            PLAIN,
            METHODS_MAP,
            Measured(method, tokens, allocator="tcmalloc"),
            METHODS_JSON,
            UNBOUND,
            "tcmalloc",
        )
        for method, tokens, figures in (
            ("draft_model", 7, (1.22, 1.41)),
            ("eagle", 3, (1.31, 1.51)),
        )
    ),
    Rule(
        "methods-none",
        "nothing",
        (0.86, 1.45),
        PLAIN,
        METHODS_MAP,
        Measured("draft_model", 3, allocator="tcmalloc"),
        METHODS_JSON,
        why="at 1 request its rounds ranged 0.86-1.45x",
    ),
    *(
        Rule(
            rule_id,
            LLVM_ADDS,
            figures,
            versus,
            RUNTIMES_MAP,
            Measured(method, tokens, bindings=bindings, allocator=allocator, runtime="llvm"),
            json_file,
            runtime="llvm",
        )
        for rule_id, method, tokens, bindings, allocator, figures, versus, json_file in (
            (
                "runtimes-1",
                "ngram",
                None,
                ("", "nobind"),
                "none",
                (1.24, 1.33),
                "libgomp under nobind",
                "docs/bench_vllm_runtimes.json",
            ),
            (
                "runtimes-2",
                "eagle",
                3,
                ("",),
                "tcmalloc",
                (1.68, 1.70),
                PLAIN,
                "docs/bench_vllm_drafter_runtimes.json",
            ),
            (
                "runtimes-3",
                "draft_model",
                7,
                ("",),
                "tcmalloc",
                (1.37, 1.39),
                PLAIN,
                "docs/bench_vllm_draft_model_runtimes.json",
            ),
        )
    ),
    Rule(
        "runtimes-none",
        "nothing",
        (0.98, 1.01),
        "libgomp",
        RUNTIMES_MAP,
        Measured("draft_model", 3, bindings=("", "auto"), runtime="llvm"),
        "docs/bench_vllm_draft_model_runtimes.json",
        runtime="llvm",
        why="at vLLM's binding (the setting the plan gives draft_model with 3 tokens, which "
        "has no map rule) it measured 0.98-1.01x of libgomp, a loss at 4 requests in every "
        "round",
    ),
)


def rule(rule_id: str, method: str | None = None) -> Rule:
    """The table's rule of that id (and method, where one id covers several)."""
    return next(
        r
        for r in RULES
        if r.id == rule_id and (method is None or (r.measured and r.measured.method == method))
    )


def measured_key(item: Rule) -> tuple[str, int | None]:
    where = item.measured
    assert where is not None  # every rule of the table says where it was measured
    return where.method, where.tokens


# Views of the table, by what the plan looks up.
NGRAM_UNBOUND = rule("map-1")
NGRAM_NOBIND = rule("map-2")
MAP_CPUS = NGRAM_UNBOUND.measured.cpus if NGRAM_UNBOUND.measured else 0
MAP_VLLM = NGRAM_UNBOUND.measured.vllm if NGRAM_UNBOUND.measured else ""
# (vLLM's method, num_speculative_tokens) -> the unbound rule with tcmalloc, where every
# round at 1 and 4 concurrent requests was a gain.
DRAFTER_RULES = {measured_key(r): r for r in RULES if r.id == "methods-4"}
# Measured, but not a gain in every round: no rule (test_evidence.py holds why).
NOT_EVERY_ROUND = {measured_key(r): r.why for r in RULES if r.id == "methods-none"}
DRAFTER_METHODS = ("draft_model", "eagle")
MAP_METHODS = ("ngram", *DRAFTER_METHODS)  # the SD methods mapped: the rules apply to them alone


@record
class MapHost:
    """A host, vLLM and command the map measured, and what the user set."""

    cpus: int
    vllm: str  # the release found in the target's environment
    method: str  # the SD method
    binding: str  # VLLM_CPU_OMP_THREADS_BIND as set: "" (unset), "auto" or "nobind"
    reserved: bool  # VLLM_CPU_NUM_OF_RESERVED_CPU set
    blocktime: str | None = None  # the caller's KMP_BLOCKTIME (their environment)
    chosen_blocktime: str | None = None  # --kmp-blocktime (option, variable, config)
    threads: str | None = None  # the caller's OMP_NUM_THREADS
    tokens: int | None = None  # num_speculative_tokens
    tcmalloc: bool = False  # a tcmalloc the settings let the launcher preload was found
    tcmalloc_always: bool = False  # the settings preload tcmalloc whatever a rule says


@record
class MapChoice:
    """The rule that applies, and what it adds (only what the user left unset)."""

    rule: Rule
    nobind: bool  # add VLLM_CPU_OMP_THREADS_BIND=nobind
    blocktime: str | None  # KMP_BLOCKTIME to add (None: the user's is the measured one)
    tcmalloc: bool  # measured with tcmalloc preloaded: the launcher preloads it too
    reason: str  # for the INFO line's reason


def on_map_host(cpus: int, release: str | None, one_worker: bool) -> bool:
    """The host and vLLM the maps measured (MAP_CPUS usable CPUs, vLLM MAP_VLLM, one
    worker on one node), whatever the SD method and the user's settings."""
    measured_release = release is not None and release.split(".")[:2] == MAP_VLLM.split(".")
    return cpus == MAP_CPUS and one_worker and measured_release


def map_host(
    environ: Mapping[str, str],
    cpus: int,
    release: str | None,
    one_worker: bool,
    method: str | None,
    tokens: int | None,
    chosen_blocktime: str | None = None,
    tcmalloc: bool = False,
    tcmalloc_always: bool = False,
) -> MapHost | None:
    """This host, vLLM release and command, where the map measured them; None elsewhere.

    `release`: the target's vLLM (releases.vllm_release). `one_worker`: the command runs
    one worker on one node, as the launcher reads it from the command line
    (single_worker) and the plugin from vLLM's parallel config. `method` and `tokens`: the
    SD method and num_speculative_tokens (None: the command does not say).
    `chosen_blocktime`: the launcher's --kmp-blocktime setting, if any. `tcmalloc`: a
    tcmalloc was found that the settings let the launcher preload; `tcmalloc_always`: the
    settings preload one whatever a rule says.
    """
    if release is None or not on_map_host(cpus, release, one_worker):
        return None
    if method not in MAP_METHODS:
        return None
    binding = environ.get(BIND_VARIABLE, "")
    if binding not in ("", "auto", "nobind"):
        return None  # a CPU list of the user's: not measured
    return MapHost(
        cpus,
        release,
        method,
        binding,
        bool(environ.get(RESERVED_VARIABLE)),
        environ.get(BLOCKTIME_VARIABLE),
        chosen_blocktime,
        environ.get(THREADS_VARIABLE),
        tokens,
        tcmalloc,
        tcmalloc_always,
    )


def figures(low_high: tuple[float, float]) -> str:
    low, high = low_high
    return f"{low:.2f}-{high:.2f}x"


def described(rule: Rule, kind: str = "map rule") -> str:
    """`map rule map-1 (adds ...: TPOT 1.19-1.42x of plain vLLM's speed, ...)`; `kind`
    names the rules it is one of (the runtimes rules)."""
    return (
        f"{kind} {rule.id} (adds {rule.adds}: TPOT {figures(rule.figures)} of "
        f"{rule.versus}'s speed on the 105M model, every round a gain; {rule.source})"
    )


def rule_for(host: MapHost) -> tuple[Rule | None, str]:
    """The rule measured for this method, tokens and binding, or None with why not."""
    where = f"{host.method} SD on {host.cpus} CPUs with vLLM {host.vllm}"
    if host.method in DRAFTER_METHODS:
        key = (host.method, host.tokens or 0)
        where = f"{host.method} SD with {host.tokens} tokens on {host.cpus} CPUs"
        if key in NOT_EVERY_ROUND:
            return None, (
                f"{where}: the unbound setting with tcmalloc was not a gain in every round "
                f"({NOT_EVERY_ROUND[key]}; {METHODS_MAP}): no rule"
            )
        if key not in DRAFTER_RULES:
            return None, f"{where}: not measured ({METHODS_MAP}): no rule"
        if host.binding or host.reserved:
            return None, f"{where}: measured only at vLLM's default binding: no rule"
        return DRAFTER_RULES[key], where
    if host.binding == "nobind":
        return NGRAM_NOBIND, where
    if host.binding or host.reserved:
        mine = f"{BIND_VARIABLE}={host.binding}" if host.binding else f"{RESERVED_VARIABLE} set"
        return None, (
            f"{where}, your {mine}: vLLM binds the worker, and bound on {host.cpus} CPUs no "
            "runtime measured faster than libgomp (one OpenMP thread at vLLM's reservation; "
            f"with none reserved 0.95-1.05x, {WAITING_MAP}): no rule, no figure claimed"
        )
    return NGRAM_UNBOUND, where


def map_choice(host: MapHost) -> tuple[MapChoice | None, str]:
    """The rule that applies here and what it adds, or None; and a note for -v/--dry-run
    saying which rule applied, or why none did (the user's setting that stopped it)."""
    rule, where = rule_for(host)
    if rule is None:
        return None, f"{where}; libiomp5 as vLLM advises"
    blocktime = host.chosen_blocktime or host.blocktime
    stopped = []
    if host.threads is not None:
        stopped.append(f"your {THREADS_VARIABLE}={host.threads} (never measured unbound)")
    if blocktime not in (None, NOBIND_BLOCKTIME):
        whose = "--kmp-blocktime" if host.chosen_blocktime else f"your {BLOCKTIME_VARIABLE}"
        stopped.append(f"{whose} {blocktime} (it needs {NOBIND_BLOCKTIME}; yours is kept)")
    if rule.source == MAP and host.tcmalloc_always:
        stopped.append("tcmalloc set to always (measured without it)")
    if rule.source == METHODS_MAP and not host.tcmalloc:
        stopped.append("no tcmalloc to preload (measured with one)")
    if stopped:
        return None, (
            f"{described(rule)} not applied for {where}: {'; '.join(stopped)}; "
            "libiomp5 as vLLM advises"
        )
    reason = f"{where}: {described(rule)}"
    choice = MapChoice(
        rule,
        nobind=not host.binding,
        blocktime=None if blocktime else NOBIND_BLOCKTIME,
        tcmalloc=rule.source == METHODS_MAP,
        reason=reason,
    )
    return choice, f"{described(rule)} applied"


# LLVM's libomp where no Intel OpenMP is found (issue 24): the runtimes maps measured it in
# the rules' unbound settings against libgomp, every paired round a gain on the 105M model.
# (vLLM's method, num_speculative_tokens; None: any) -> what LLVM's libomp measured, each
# in the setting of the map rule for that method on the map's host (map-1/map-2's nobind
# and KMP_BLOCKTIME=200; the drafters' methods-4: tcmalloc, nobind, KMP_BLOCKTIME=200).
LLVM_RUNTIME = {measured_key(r): r for r in RULES if r.runtime == "llvm" and r.why == ""}
# Measured, and no gain where the plan would run it: no rule (test_evidence.py holds why).
LLVM_NOT_A_GAIN = {measured_key(r): r.why for r in RULES if r.runtime == "llvm" and r.why}


def llvm_runtime(
    method: str | None, tokens: int | None, mapped: MapChoice | None, measured_here: bool
) -> tuple[Rule | None, str]:
    """Whether LLVM's libomp may stand in for Intel's for this SD method: the measured
    rule, or None with why not (the plan then keeps libgomp and warns, as where nothing
    was found). On the map's host (`measured_here`, on_map_host) it stands in only with the
    map rule whose setting it was measured in (`mapped`: the rule that applies here, None
    where the user's settings stop it). Elsewhere the runtimes maps measured nothing: like
    libiomp5 it is preloaded for that method, as the same runtime code (Intel's code base,
    the same KMP_* settings and defaults), which measured alike to libiomp5 where both ran
    (ngram)."""
    key = (method or "", tokens)
    rule = LLVM_RUNTIME.get((method or "", None)) or LLVM_RUNTIME.get(key)
    where = f"{method or 'an unnamed'} SD" + (
        f" with {tokens} tokens" if tokens is not None else ""
    )
    if key in LLVM_NOT_A_GAIN:
        return None, f"for {where} {LLVM_NOT_A_GAIN[key]} ({RUNTIMES_MAP})"
    if rule is None:
        return None, f"not measured against libgomp for {where} ({RUNTIMES_MAP})"
    if measured_here and mapped is None:
        # Nothing measured it faster here outside that setting; at vLLM's default binding
        # (one core, one OpenMP thread) it measured a little slower (LLVM_NOT_A_GAIN).
        return None, (
            f"for {where} measured faster than libgomp on this host only in the setting of "
            f"its map rule ({rule.id}), which this start does not get"
        )
    said = f"{described(rule, 'runtimes rule')}, for {where}"
    if measured_here:
        return rule, said
    return rule, (
        f"{said}: measured on the map's host ({MAP_CPUS} CPUs, vLLM {MAP_VLLM}) in its map "
        "rule's setting, not on this one, where it runs at vLLM's settings as libiomp5 would"
    )
