"""`vllm-cpu-launch rules`: the measured rules, and which one a command gets here.

Whether a rule applies is rules.py's matcher, the plan's own, over the start a launch
plans (cli.launch_facts, plan.start_of). No vLLM needs to be installed: without one, the
vLLM condition fails and says so.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

from vllm_cpu_launch.cli import (
    FLAG_OPTIONS,
    VALUED_OPTIONS,
    launch_facts,
    launch_settings,
    parse_options,
    write_stdout,
)
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError, replace
from vllm_cpu_launch.handoff import LD_PRELOAD, vllm_reads
from vllm_cpu_launch.plan import start_of
from vllm_cpu_launch.rules import (
    BLOCKTIME_VARIABLE,
    LOAD_JSON,
    REAL_JSON,
    REAL_MODEL,
    RULES,
    bound_worker_overrides,
    figures,
    llvm_runtime,
    load_words,
    misses,
    override_words,
    real_words,
    release_words,
    setting_rule,
    words,
)
from vllm_cpu_launch.target import Target, resolve_vllm

if TYPE_CHECKING:
    from vllm_cpu_launch.command import SpeculativeRequest
    from vllm_cpu_launch.rules import Rule, Start

USAGE = """\
usage: vllm-cpu-launch rules [--json]
       vllm-cpu-launch rules [--json] [OPTIONS] [--] VLLM_SUBCOMMAND [VLLM ARGS...]

What the launcher adds for speculative decoding beyond Intel OpenMP at vLLM's own
settings, and why: each measured rule adds a binding, a block time or tcmalloc (or lets
LLVM's libomp stand in where no Intel OpenMP is found), and only where every condition it
was measured under holds: the SD method and tokens, the machine, the usable CPUs, the
vLLM release, one worker, and the variables you left unset. What you set stays yours.

  rules                  the table: id, measured under, adds, figures, the figures on a
                         real model's weights, and at each concurrency of the map at load
                         (requests served at once), evidence
  rules --json           the same, as data (schema vllm-cpu-launch/rules/1)
  rules serve MODEL ...  which rule this command gets on this host, and for every other
                         rule the first condition that fails here (why 2 CPUs and 4 CPUs,
                         or your OMP_NUM_THREADS, give different plans)

The launcher OPTIONS (--vllm, --kmp-blocktime, --tcmalloc, ...) are read as a start reads
them. No vLLM needs to be installed; nothing is started.
"""
SCHEMA = "vllm-cpu-launch/rules/1"
NOT_MEASURED_HERE = (
    "no setting rule was measured on this host (see each rule's first failing condition)"
)
NO_VLLM = "vLLM: none found (--vllm, beside this Python, PATH): no rule's vLLM holds"
NO_SD = "no speculative decoding requested"
NO_METHOD = "speculative decoding requested without a method or a draft model: no rule applies"
# Measured's fields, as --json writes them (in this order, tuples as lists)
MEASURED_KEYS = (
    "method",
    "tokens",
    "machine",
    "cpus",
    "vllm",
    "workers",
    "bindings",
    "unset",
    "allocator",
    "within",
)


def rule_json(rule: Rule) -> dict[str, Any]:
    return {
        "id": rule.id,
        "measured": {key: getattr(rule.measured, key) for key in MEASURED_KEYS},
        "adds": {
            "words": rule.adds,
            "variables": dict(rule.variables),
            "allocator": rule.allocator,
            "runtime": rule.runtime,
        },
        "figures": list(rule.figures),
        "versus": rule.versus,
        "source": rule.source,
        "evidence": rule.evidence,
        "rule": not rule.why,
        "why": rule.why or None,
        "real": None
        if rule.real is None
        else {
            "model": REAL_MODEL,
            "figures": list(rule.real.figures),
            "accepted": list(rule.real.accepted),
            "evidence": REAL_JSON,
        },
        "load": None
        if not rule.load
        else {
            "model": REAL_MODEL,
            "levels": [
                {"concurrency": at.concurrency, "figures": list(at.figures), "held": at.held}
                for at in rule.load
            ],
            "evidence": LOAD_JSON,
        },
    }


def table_lines() -> list[str]:
    lines = []
    for rule in RULES:
        where = rule.measured
        tokens = f" with {where.tokens} tokens" if where.tokens is not None else ""
        binding = " or ".join(b or "unset" for b in where.bindings)
        measured = [
            f"{where.method} SD{tokens}",
            f"{where.machine}, {where.cpus} CPUs, vLLM {where.vllm}, {where.workers} worker",
            f"VLLM_CPU_OMP_THREADS_BIND {binding}",
        ]
        if where.unset:
            measured.append(f"unset: {' '.join(where.unset)}")
        if where.within:
            measured.append(f"in the setting of {' or '.join(where.within)}")
        else:
            measured.append(
                "with tcmalloc" if where.allocator == "tcmalloc" else "without tcmalloc"
            )
        real = f" ({REAL_MODEL}, {REAL_JSON})" if rule.real else ""
        load = f" ({LOAD_JSON})" if rule.load else ""
        adds = f"adds {rule.adds}" if not rule.why else f"no rule: {rule.why}"
        lines += [
            f"{rule.id:<14} {adds}",
            f"{'':<14} measured under: {'; '.join(measured)}",
            f"{'':<14} figures: TPOT {figures(rule.figures)} of {rule.versus} ({rule.source})",
            f"{'':<14} real weights: {real_words(rule)}{real}",
            f"{'':<14} at load: {load_words(rule)}{load}",
            f"{'':<14} evidence: {rule.evidence}",
        ]
    return lines


def command_start(
    values: dict[str, object], command: list[str]
) -> tuple[Start, str, SpeculativeRequest]:
    """The start the rules read for `command` (as a launch plans it), where its vLLM was
    found, and its SD request; without a vLLM, the host's and the caller's facts alone."""
    settings = launch_settings(values)
    try:
        target: Target | None = resolve_vllm(settings.vllm, os.environ, sys.executable)
    except LaunchError:
        target = None
    facts = launch_facts(settings, target or Target("", "none"), command)
    start = start_of(facts)
    if target is None:
        return replace(start, vllm_found=False), NO_VLLM, facts.speculative
    return start, f"vLLM: {target.executable}", facts.speculative


def rule_key(rule: Rule) -> str:
    """`map-1 ngram`, `methods-none-7 draft_model 7`: a row of the table, named for a reader."""
    tokens = f" {rule.measured.tokens}" if rule.measured.tokens is not None else ""
    return f"{rule.id} {rule.measured.method}{tokens}"


def matching(start: Start, requested: bool) -> dict[str, Any]:
    """Which setting rule and which runtimes rule apply to `start` (`requested`: it asks
    for SD), and every rule's conditions that fail here (the first one decides)."""
    setting = setting_rule(start) if start.method else None
    if setting and not setting.note:
        setting = replace(setting, note=f"{NOT_MEASURED_HERE}; libiomp5 at vLLM's settings")
    runtime = llvm_runtime(start) if start.method else None
    return {
        "rule": setting.rule.id if setting and setting.rule else None,
        "note": setting.note if setting else NO_METHOD if requested else NO_SD,
        "runtime": runtime.rule.id if runtime and runtime.rule else None,
        "runtime_note": runtime.note if runtime else None,
        "misses": {rule_key(rule): [words(m) for m in misses(rule, start)] for rule in RULES},
    }


def command_lines(start: Start, found: str, requested: bool, matched: dict[str, Any]) -> list[str]:
    tokens = f", {start.tokens} tokens" if start.tokens is not None else ""
    workers = "one worker" if start.one_worker else "several workers or nodes"
    method = start.method or ("unnamed" if requested else "no")
    lines = [
        f"here:     {method} SD{tokens}; {start.machine}, {start.cpus} usable "
        f"CPUs, {release_words(start)}, {workers}",
        f"          {found}",
        f"setting:  {matched['rule'] or 'no rule'}: {matched['note']}",
    ]
    if matched["runtime_note"]:
        runtime = matched["runtime"] or "no rule"
        lines.append(
            f"llvm:     where LLVM's libomp is the runtime found, {runtime}: "
            f"{matched['runtime_note']}"
        )
    for key, failed in matched["misses"].items():
        lines.append(f"{key:<24} {'matches here' if not failed else 'fails: ' + failed[0]}")
    return lines


def vllm_words(start: Start, speculative: SpeculativeRequest, rule: str | None) -> list[str]:
    """What vLLM itself will do with this command that the plan does not: refuse its
    speculative config or an unknown option, and write over the block time and thread
    count it hands on in each worker it binds (with libiomp5 preloaded, as SD gets it)."""
    said = [*speculative.refusals, *filter(None, [speculative.note])]
    if not speculative.requested:
        return said
    environ = dict(start.environ)
    if start.chosen_blocktime:
        environ[BLOCKTIME_VARIABLE] = start.chosen_blocktime
    added = next((r.variables for r in RULES if r.id == rule), ())
    environ = {**dict(added), **environ}  # a rule adds only what is unset
    if not vllm_reads(environ.get(LD_PRELOAD, "")):
        environ[LD_PRELOAD] = "libiomp5.so"
    overrides = bound_worker_overrides(environ)
    return said + ([override_words(overrides)] if overrides else [])


def main(values: dict[str, object], args: list[str]) -> int:
    more, command = parse_options(args, VALUED_OPTIONS, FLAG_OPTIONS, verb="rules")
    merged = {**values, **more}
    if merged.get("help"):
        write_stdout(USAGE.rstrip())
        return 0
    for key, option in (("dry_run", "--dry-run"), ("version", "--version")):
        if merged.get(key):
            raise LaunchError(EXIT_USAGE, f"rules starts nothing; {option} does not apply")
    record: dict[str, Any] = {"schema": SCHEMA, "rules": [rule_json(r) for r in RULES]}
    lines = table_lines()
    if command:
        start, found, speculative = command_start(merged, command)
        matched = matching(start, speculative.requested)
        said = vllm_words(start, speculative, matched["rule"])
        record["start"] = {
            "machine": start.machine,
            "cpus": start.cpus,
            "vllm": start.release,
            "found": found,
            "one_worker": start.one_worker,
            "method": start.method,
            "tokens": start.tokens,
        }
        record.update(**matched, vllm=said)
        lines = command_lines(start, found, speculative.requested, matched)
        lines += [f"vLLM:     {w}" for w in said]
    write_stdout(json.dumps(record, indent=2) if merged.get("json") else "\n".join(lines))
    return 0
