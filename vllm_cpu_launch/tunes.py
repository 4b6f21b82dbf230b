"""Which `tune --write` result applies to a launch: only one of what it measured.

A tune measures one model with one SD method and token count, on one vLLM release and
this many usable CPUs (settings.Scope). A launch applies the record whose scope matches
its own command and host; a record that does not match is not applied, and the plan's
notes (`-v`, `--dry-run`) say which records were considered and why each was or was not
used. A record written before tunes were scoped is read as scoped to the command it
records (its model and SD options; any release and CPUs).
"""

from __future__ import annotations

import os
import shlex
from typing import TYPE_CHECKING

from vllm_cpu_launch.settings import SCOPE_FIELDS, Scope, said_setting
from vllm_cpu_launch.speculative import detect, model_of

if TYPE_CHECKING:
    from vllm_cpu_launch.settings import Settings, Tuned
    from vllm_cpu_launch.speculative import SpeculativeRequest

LABELS = {
    "model": "model",
    "method": "SD method",
    "tokens": "draft tokens",
    "vllm": "vLLM",
    "cpus": "CPUs",
}


def launch_scope(
    model: str | None, speculative: SpeculativeRequest, release: str | None, cpus: int
) -> Scope:
    """The scope of this launch: what a tune of it would have measured."""
    return Scope(normal_model(model), speculative.method, speculative.tokens, release, cpus or None)


def normal_model(model: str | None) -> str | None:
    """A local model directory by its absolute path (a tune may run from elsewhere); a hub
    name as given."""
    if model and os.path.isdir(model):
        return os.path.abspath(model)
    return model


def record_scope(tuned: Tuned) -> Scope:
    """A record's scope; one written before scoping, from the command it records."""
    if tuned.scope is not None:
        return tuned.scope
    try:
        argv = shlex.split(tuned.command)
    except ValueError:
        argv = []
    arguments = argv[1:] if argv[:1] == ["vllm"] else argv
    request = detect(arguments)
    return Scope(normal_model(model_of(arguments)), request.method, request.tokens)


def differences(recorded: Scope, launch: Scope) -> list[str]:
    """Where the launch leaves what the record measured (a field it did not record: any)."""
    found = []
    for field, label in LABELS.items():
        wanted, actual = getattr(recorded, field), getattr(launch, field)
        if wanted is not None and wanted != actual:
            found.append(f"{label} {actual if actual is not None else 'unknown'}, not {wanted}")
    return found


def describe(scope: Scope) -> str:
    """`model /m, SD method ngram, draft tokens 3, vLLM 0.32.0, 2 CPUs` (what is recorded)."""
    parts = [f"{label} {getattr(scope, field)}" for field, label in LABELS.items()]
    recorded = [part for part, field in zip(parts, LABELS, strict=True) if getattr(scope, field)]
    return ", ".join(recorded) or "any command"


def choose(settings: Settings, launch: Scope) -> tuple[Tuned | None, list[str]]:
    """The tune record that applies to this launch (None: none does), and a note on each
    record considered. Of several that match, the one that recorded the most wins (then
    the config file with the higher precedence); an --iomp option or VLLMCPULAUNCH_IOMP
    wins over all."""
    notes = []
    matching = []
    for tuned in settings.tuned:
        scope = record_scope(tuned)
        what = f"tune of {tuned.when} ({describe(scope)}; {tuned.origin})"
        missed = differences(scope, launch)
        uneven = not_won_everywhere(tuned)
        if missed or uneven:
            notes.append(f"{what} not applied: {'; '.join([*missed, *filter(None, [uneven])])}")
        elif settings.iomp_from in ("option", "variable"):
            given = said_setting(settings, "iomp")
            notes.append(f"{what} not applied: {given} given, which wins")
        else:
            matching.append((tuned, scope))
    if not matching:
        return None, notes
    detail = [sum(getattr(scope, f) is not None for f in LABELS) for _, scope in matching]
    chosen, scope = matching[detail.index(max(detail))]
    notes.append(f"tune of {chosen.when} ({describe(scope)}; {chosen.origin}) applied")
    notes += [
        f"tune of {t.when} ({describe(s)}; {t.origin}) matches too, but the applied one "
        "recorded more or comes first"
        for t, s in matching
        if t is not chosen
    ]
    return chosen, notes


def record_fields(tuned: Tuned, scope: Scope) -> dict[str, object]:
    """A record as a config file holds it (and doctor shows it), with its scope and, from
    a serving tune, what each concurrency pointed to."""
    fields: dict[str, object] = {
        "when": tuned.when,
        "iomp": tuned.iomp,
        "result": tuned.result,
        "rounds": tuned.rounds,
        "command": tuned.command,
        "scope": {field: getattr(scope, field) for field in SCOPE_FIELDS},
    }
    if tuned.concurrency:
        fields["concurrency"] = dict(tuned.concurrency)
    return fields


def not_won_everywhere(tuned: Tuned) -> str | None:
    """Why a serving record does not hold at every concurrency it measured, or None."""
    others = [f"{iomp} at {level}" for level, iomp in tuned.concurrency if iomp != tuned.iomp]
    if not others:
        return None
    return f"its iomp: {tuned.iomp} did not hold at every concurrency ({', '.join(others)})"
