"""`vllm-cpu-launch rules`: the measured rules, and which one a command gets here.

A rule applies by rules.py's matcher, the plan's own, over the start a launch plans
(launch.launch_facts, plan.start_of); with no vLLM installed, the vLLM condition fails.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

from vllm_cpu_launch import launch, rules
from vllm_cpu_launch.command import read_command
from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.handoff import LD_PRELOAD
from vllm_cpu_launch.plan import start_of
from vllm_cpu_launch.records import replace
from vllm_cpu_launch.rules import HOST_WORDS, LOAD_JSON, REAL_JSON, REAL_MODEL, RULES
from vllm_cpu_launch.runtimes import INTEL, vllm_reads
from vllm_cpu_launch.shape import shape_json, shape_line
from vllm_cpu_launch.target import Target, resolve_vllm

if TYPE_CHECKING:
    from vllm_cpu_launch.command import SpeculativeRequest
    from vllm_cpu_launch.libraries import Host

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
INDENT = " " * 15  # the table's rows under a rule's id
NO_VLLM = "vLLM: none found (--vllm, beside this Python, PATH): no rule's vLLM holds"
NO_SD = "no speculative decoding requested"
NO_METHOD = "speculative decoding requested without a method or a draft model: no rule applies"


def rule_json(rule: rules.Rule) -> dict[str, Any]:
    """A rule as --json writes it (tuples become lists)."""
    real, load = rule.real, rule.load
    adds = {"words": rule.adds, "variables": dict(rule.variables)}
    return {
        "id": rule.id,
        "measured": vars(rule.measured),  # Measured's fields, in their order
        "adds": {**adds, "allocator": rule.allocator, "runtime": rule.runtime},
        "figures": rule.figures,
        "versus": rule.versus,
        "paired": rule.paired,
        "source": rule.source,
        "evidence": rule.evidence,
        "rule": not rule.why,
        "why": rule.why or None,
        "real": None
        if real is None
        else {"model": REAL_MODEL, **vars(real), "evidence": REAL_JSON},
        "load": None
        if not load
        else {"model": REAL_MODEL, "levels": [vars(at) for at in load], "evidence": LOAD_JSON},
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
            *([f"unset: {' '.join(where.unset)}"] if where.unset else []),
        ]
        if where.within:
            measured.append(f"in the setting of {' or '.join(where.within)}")
        else:
            with_it = where.allocator == rules.Allocator.TCMALLOC
            measured.append("with tcmalloc" if with_it else "without tcmalloc")
        real = f" ({REAL_MODEL}, {REAL_JSON})" if rule.real else ""
        load = f" ({LOAD_JSON})" if rule.load else ""
        adds = f"adds {rule.adds}" if not rule.why else f"no rule: {rule.why}"
        rounds = f", {rules.rounds_words(rule)}" if not rule.why else ""
        lines += [
            f"{rule.id:<14} {adds}",
            f"{INDENT}measured under: {'; '.join(measured)}",
            f"{INDENT}figures: TPOT {rules.figures(rule.figures)} of {rule.versus}{rounds} "
            f"({rule.source})",
            f"{INDENT}real weights: {rules.real_words(rule)}{real}",
            f"{INDENT}at load: {rules.load_words(rule)}{load}",
            f"{INDENT}evidence: {rule.evidence}",
        ]
    return lines


def command_start(
    values: dict[str, object], command: list[str], host: Host
) -> tuple[rules.Start, str, SpeculativeRequest]:
    """The start the rules read for `command` (as a launch plans it), where its vLLM was
    found, and its SD request; without a vLLM, the host's and the caller's facts alone."""
    settings = launch.launch_settings(values)
    try:
        target: Target | None = resolve_vllm(settings.vllm, os.environ, sys.executable)
    except LaunchError:
        target = None
    facts = launch.launch_facts(
        settings, target or Target("", "none"), read_command(command), host=host
    )
    start = start_of(facts)
    if target is None:
        return replace(start, vllm_found=False), NO_VLLM, facts.speculative
    return start, f"vLLM: {target.executable}", facts.speculative


def matching(start: rules.Start, requested: bool) -> dict[str, Any]:
    """Which setting rule and which runtimes rule apply to `start` (`requested`: it asks
    for SD), and every rule's conditions that fail here (the first one decides)."""
    setting = rules.setting_rule(start) if start.method else None
    if setting and not setting.note:
        setting = replace(setting, note=f"{NOT_MEASURED_HERE}; libiomp5 at vLLM's settings")
    runtime = rules.llvm_runtime(start) if start.method else None
    return {
        "rule": setting.rule.id if setting and setting.rule else None,
        "note": setting.note if setting else NO_METHOD if requested else NO_SD,
        "runtime": runtime.rule.id if runtime and runtime.rule else None,
        "runtime_note": runtime.note if runtime else None,
        "misses": {
            rule_key(rule): [rules.words(m) for m in rules.misses(rule, start)] for rule in RULES
        },
    }


def rule_key(rule: rules.Rule) -> str:
    """`map-1 ngram`, `methods-none-7 draft_model 7`: a row of the table, named for a reader."""
    tokens = f" {rule.measured.tokens}" if rule.measured.tokens is not None else ""
    return f"{rule.id} {rule.measured.method}{tokens}"


def command_lines(
    start: rules.Start, found: str, requested: bool, matched: dict[str, Any]
) -> list[str]:
    tokens = f", {start.tokens} tokens" if start.tokens is not None else ""
    workers = "one worker" if start.one_worker else "several workers or nodes"
    method = start.method or ("unnamed" if requested else "no")
    lines = [
        f"here:     {method} SD{tokens}; {start.machine}, {start.cpus} usable "
        f"CPUs, {rules.release_words(start)}, {workers}",
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


def vllm_words(start: rules.Start, speculative: SpeculativeRequest, rule: str | None) -> list[str]:
    """What vLLM itself will do with this command that the plan does not: refuse its
    speculative config or an unknown option, and write over the block time and thread
    count it hands on in each worker it binds (with libiomp5 preloaded, as SD gets it)."""
    said = [*speculative.refusals, *filter(None, [speculative.note])]
    if not speculative.requested:
        return said
    environ = dict(start.environ)
    if start.chosen_blocktime:
        environ[rules.BLOCKTIME_VARIABLE] = start.chosen_blocktime
    added = next((r.variables for r in RULES if r.id == rule), ())
    environ = {**dict(added), **environ}  # a rule adds only what is unset
    if not vllm_reads(environ.get(LD_PRELOAD, "")):
        environ[LD_PRELOAD] = INTEL.files[0]
    overrides = rules.bound_worker_overrides(environ)
    return said + ([rules.override_words(overrides)] if overrides else [])


def main(values: dict[str, object], args: list[str]) -> int:
    more, command = launch.parse_options(args, verb="rules")
    merged = {**values, **more}
    if merged.get("help"):
        launch.write_stdout(USAGE.rstrip())
        return 0
    for key, option in (("dry_run", "--dry-run"), ("version", "--version")):
        if merged.get(key):
            raise LaunchError(EXIT_USAGE, f"rules starts nothing; {option} does not apply")
    record: dict[str, Any] = {"schema": SCHEMA, "rules": [rule_json(r) for r in RULES]}
    lines = table_lines()
    if command:
        host = launch.current_host()
        start, found, speculative = command_start(merged, command, host)
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
            "host_use": {"kind": str(start.host), "why": start.host_why},
        }
        record["shape"] = shape_json(host.shape)
        record.update(**matched, vllm=said)
        lines = command_lines(start, found, speculative.requested, matched)
        cpus = f"cpus:     {HOST_WORDS[start.host]} ({start.host_why})"
        lines[2:2] = [f"shape:    {shape_line(host.shape)}", cpus] if host.shape else [cpus]
        lines += [f"vLLM:     {w}" for w in said]
    launch.write_stdout(json.dumps(record, indent=2) if merged.get("json") else "\n".join(lines))
    return 0
