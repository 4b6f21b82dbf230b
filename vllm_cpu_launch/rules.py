"""The one matcher of the measured rules (evidence.RULES) against a start.

A rule applies where every condition it was measured under holds; `misses` lists the
ones that do not, as data, and `words` says them. Nothing here names a rule or a host:
changing, adding or removing a rule is an edit of the table alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_cpu_launch.evidence import (
    BIND_VARIABLE,
    BLOCKTIME_VARIABLE,
    NOBIND_BLOCKTIME,
    RULES,
    THREADS_VARIABLE,
    WAITING_MAP,
    described,
)
from vllm_cpu_launch.records import record

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from vllm_cpu_launch.evidence import Measured, Rule

HOST = ("machine", "cpus", "vllm", "workers")  # where, as opposed to what the user set
# Why no rule where vLLM binds the worker (tests/test_evidence.py recomputes the figure).
BOUND = (
    "vLLM binds the worker there, and bound no runtime measured faster than libgomp (with "
    f"none reserved 0.95-1.05x, {WAITING_MAP})"
)


@record
class Start:
    """What the rules read of one start: the host, the command, the caller's variables
    and settings, and which allocator the start can have."""

    machine: str
    cpus: int  # usable CPUs; 0: not known
    release: str | None  # the target's vLLM release; None: not found
    one_worker: bool
    method: str | None
    tokens: int | None
    environ: Mapping[str, str]
    chosen_blocktime: str | None = None  # --kmp-blocktime (option, variable or config)
    tcmalloc: str = "auto"  # the tcmalloc setting
    tcmalloc_found: bool = False  # a tcmalloc the settings let in was found
    callers_allocator: str | None = None  # "tcmalloc" or "other": one in their LD_PRELOAD
    vllm_found: bool = True  # False: no vLLM found (release None); True with None: unknown


@record
class Miss:
    """One condition of a rule that does not hold here."""

    condition: str  # a field of evidence.Measured, or a variable's name
    here: str  # what this start has
    measured: str  # what the rule was measured with


def words(miss: Miss) -> str:
    return f"{miss.here} ({miss.measured})"


def series(release: str | None) -> str | None:
    return ".".join(release.split(".")[:2]) if release else None


def release_words(start: Start) -> str:
    """The start's vLLM release as read: a vLLM found whose dist-info names no release is
    not "no vLLM found"."""
    if start.release:
        return f"vLLM {start.release}"
    if start.vllm_found:
        return "vLLM release unknown: no vllm-cpu or vllm dist-info in its environment"
    return "no vLLM found"


def host_misses(where: Measured, start: Start) -> list[Miss]:
    checks = [
        ("machine", start.machine == where.machine, start.machine, f"measured on {where.machine}"),
        (
            "cpus",
            start.cpus == where.cpus,
            f"{start.cpus or 'unknown'} usable CPUs",
            f"measured on {where.cpus}",
        ),
        (
            "vllm",
            series(start.release) == where.vllm,
            release_words(start),
            f"measured with vLLM {where.vllm}",
        ),
        (
            "workers",
            start.one_worker,
            "several workers or nodes",
            f"measured with {where.workers} worker on one node",
        ),
    ]
    return [Miss(name, here, measured) for name, holds, here, measured in checks if not holds]


def command_misses(where: Measured, start: Start) -> list[Miss]:
    method = start.method or "an unnamed method"
    if start.method != where.method:
        return [Miss("method", f"{method} SD", f"measured with {where.method}")]
    if where.tokens is not None and start.tokens != where.tokens:
        return [Miss("tokens", f"{start.tokens} tokens", f"measured with {where.tokens}")]
    return []


def variable_miss(name: str, start: Start) -> Miss | None:
    """The caller's variable a rule needs unset, where it is set (KMP_BLOCKTIME: to
    another value than the rules add; --kmp-blocktime counts as the caller's)."""
    if name == BLOCKTIME_VARIABLE:
        value = start.chosen_blocktime or start.environ.get(name)
        if value in (None, NOBIND_BLOCKTIME):
            return None
        whose = "--kmp-blocktime" if start.chosen_blocktime else f"your {name}"
        return Miss(name, f"{whose} {value}", f"it needs {NOBIND_BLOCKTIME}; yours is kept")
    value = start.environ.get(name)
    if not value:
        return None
    if name == THREADS_VARIABLE:
        return Miss(name, f"your {name}={value}", "never measured unbound")
    return Miss(name, f"your {name} set", f"measured unset: {BOUND}; no rule, no figure claimed")


def setting_misses(where: Measured, start: Start) -> list[Miss]:
    """The user's settings a rule needs (a runtimes rule: those of the rules it names)."""
    if where.within:
        return []
    binding = start.environ.get(BIND_VARIABLE, "")
    misses = []
    if binding not in where.bindings:
        measured = " or ".join(b or "unset" for b in where.bindings)
        why = f"measured {measured}: {BOUND}; no rule, no figure claimed"
        misses.append(Miss("bindings", f"your {BIND_VARIABLE}={binding or 'unset'}", why))
    misses += [m for name in where.unset if (m := variable_miss(name, start))]
    allocator = allocator_miss(where.allocator, start)
    return misses + ([allocator] if allocator else [])


def allocator_miss(measured: str, start: Start) -> Miss | None:
    """`none`: the start may go without tcmalloc; `tcmalloc`: it will have one."""
    theirs = start.callers_allocator
    if measured == "none" and theirs:
        return Miss("allocator", f"your LD_PRELOAD's {theirs} allocator", "measured without")
    if measured == "none" and start.tcmalloc == "always":
        return Miss("allocator", "tcmalloc set to always", "measured without it")
    found = theirs == "tcmalloc" or (
        not theirs and start.tcmalloc != "never" and start.tcmalloc_found
    )
    if measured == "tcmalloc" and not found:
        return Miss("allocator", "no tcmalloc to preload", "measured with one")
    return None


def within_misses(where: Measured, start: Start) -> list[Miss]:
    """A runtimes rule's setting: one of the rules it was measured with applies here."""
    if not where.within or any(
        not misses(r, start) for r in RULES if r.id in where.within and not r.why
    ):
        return []
    return [Miss("within", "this start's setting", f"measured in {' or '.join(where.within)}'s")]


CONDITIONS: tuple[Callable[[Measured, Start], list[Miss]], ...] = (
    host_misses,
    command_misses,
    setting_misses,
    within_misses,
)


def misses(rule: Rule, start: Start) -> list[Miss]:
    """Every condition of `rule` that does not hold for `start`, in the table's order."""
    return [miss for check in CONDITIONS for miss in check(rule.measured, start)]


def where_words(start: Start) -> str:
    tokens = f" with {start.tokens} tokens" if start.tokens is not None else ""
    return (
        f"{start.method or 'an unnamed'} SD{tokens} on {start.cpus} CPUs with vLLM {start.release}"
    )


@record
class Setting:
    """What the setting rules (those that add variables or an allocator) decide here."""

    rule: Rule | None  # the rule that applies
    note: str  # which applied, or why none did ("" where none was measured near here)
    variables: tuple[tuple[str, str], ...] = ()  # what it adds (the user left unset)
    tcmalloc: bool = False  # measured with tcmalloc: the plan preloads it
    read: bool = False  # a rule measured here for this method read the caller's variables


def setting_rule(start: Start) -> Setting:
    """The setting rule that applies to this start, or the note saying which condition
    stopped the nearest (measured here, for this method: only the user's settings)."""
    table = [r for r in RULES if r.runtime is None]
    near = [
        r
        for r in table
        if not host_misses(r.measured, start) and not command_misses(r.measured, start)
    ]
    where = where_words(start)
    if not near:
        measured_here = any(not host_misses(r.measured, start) for r in table)
        sources = ", ".join(dict.fromkeys(r.source for r in table))
        note = f"{where}: not measured ({sources}): no rule; libiomp5 as vLLM advises"
        return Setting(None, note if measured_here and start.method else "")
    rule = min(near, key=lambda r: len(misses(r, start)))
    stopped = misses(rule, start)
    if rule.why:
        note = f"{where}: not a gain in every round ({rule.why}; {rule.source}): no rule"
    elif stopped:
        said = "; ".join(words(m) for m in stopped)
        note = f"{described(rule)} not applied for {where}: {said}"
    else:
        return applied_setting(rule, start)
    return Setting(None, f"{note}; libiomp5 as vLLM advises", read=True)


def applied_setting(rule: Rule, start: Start) -> Setting:
    """What an applying rule adds: only the variables the user left unset."""
    chosen = {BLOCKTIME_VARIABLE: start.chosen_blocktime} if start.chosen_blocktime else {}
    mine = {**start.environ, **chosen}
    added = tuple((name, value) for name, value in rule.variables if not mine.get(name))
    tcmalloc = rule.allocator == "tcmalloc"
    return Setting(rule, f"{described(rule)} applied", added, tcmalloc, read=True)


@record
class Runtime:
    """Whether LLVM's libomp stands in for Intel's: the rule it rests on, or None with why."""

    rule: Rule | None
    note: str


def llvm_runtime(start: Start) -> Runtime:
    """LLVM's libomp for this SD method, by the runtimes rules: where a rule of the method
    measured a gain, in the setting it names; off the host it was measured on, by method
    alone, at vLLM's settings as libiomp5 would run (the same runtime code); never where a
    measured non-rule of the method says it was no gain."""
    tokens = f" with {start.tokens} tokens" if start.tokens is not None else ""
    where = f"{start.method or 'an unnamed'} SD{tokens}"
    ours = [r for r in RULES if r.runtime and not command_misses(r.measured, start)]
    loss = next((r for r in ours if r.why), None)
    if loss is not None:
        return Runtime(None, f"for {where} {loss.why} ({loss.source})")
    rule = next(iter(ours), None)
    if rule is None:
        sources = ", ".join(dict.fromkeys(r.source for r in RULES if r.runtime))
        return Runtime(None, f"not measured against libgomp for {where} ({sources})")
    said = f"{described(rule, 'runtimes rule')}, for {where}"
    if host_misses(rule.measured, start):
        m = rule.measured
        return Runtime(
            rule,
            f"{said}: measured on the map's host ({m.cpus} CPUs, vLLM {m.vllm}) in "
            "its map rule's setting, not on this one, where it runs at vLLM's settings as "
            "libiomp5 would",
        )
    if misses(rule, start):
        within = " or ".join(rule.measured.within)
        return Runtime(
            None,
            f"for {where} measured faster than libgomp on this host only in the setting of "
            f"its map rule ({within}), which this start does not get",
        )
    return Runtime(rule, said)


def measured_host(start: Start) -> bool:
    """Whether a setting rule was measured on this host (doctor's map line)."""
    return any(not host_misses(r.measured, start) for r in RULES if r.runtime is None)
