"""The plan: what to exec and with which environment. Computed, never executed, here."""

from __future__ import annotations

from vllm_cpu_launch.errors import EXIT_USAGE, LaunchError
from vllm_cpu_launch.evidence import (
    BIND_VARIABLE,
    BLOCKTIME_VARIABLE,
    DRAFTER_METHODS,
    RESERVED_VARIABLE,
    THREADS_VARIABLE,
    map_choice,
    map_host,
)
from vllm_cpu_launch.handoff import IOMP_MACHINES, PLANNED_VARIABLE
from vllm_cpu_launch.libraries import Candidate, Search, find_library
from vllm_cpu_launch.metadata import PYTHONPATH, Alias, alias_for, alias_problem, pythonpath_with
from vllm_cpu_launch.places import IOMP, TCMALLOC, Host, preload_entries
from vllm_cpu_launch.records import record
from vllm_cpu_launch.releases import support, target_release
from vllm_cpu_launch.settings import blocktime_problem
from vllm_cpu_launch.speculative import model_of
from vllm_cpu_launch.tunes import choose, launch_scope

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any

    from vllm_cpu_launch.settings import Scope, Settings, Tuned
    from vllm_cpu_launch.speculative import SpeculativeRequest
    from vllm_cpu_launch.target import Target

# The value vLLM's own CPU workers use since PR #42666 (1 ms let threads sleep too soon).
DEFAULT_KMP_BLOCKTIME = "5"
LD_PRELOAD = "LD_PRELOAD"
LIBRARY_TITLES = {IOMP: "Intel OpenMP (libiomp5.so)", TCMALLOC: "tcmalloc"}


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
    # The `vllm` metadata the launcher supplies to a vllm-cpu install (metadata.py).
    metadata: Alias | None = None


def compose_ld_preload(current: str, additions: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """New LD_PRELOAD (additions first, caller's entries kept in order) and dropped entries.

    A libgomp entry is dropped once an Intel/LLVM OpenMP runtime is in the list:
    vLLM asserts that not both are preloaded (vllm/utils/ompmultiprocessing.py).
    """
    entries = preload_entries(current)
    merged = [path for path in additions if path not in entries] + entries
    has_iomp = any("libiomp" in e or "libomp" in e for e in merged)
    dropped = tuple(e for e in merged if has_iomp and "libgomp" in e)
    return ":".join(e for e in merged if e not in dropped), dropped


def validated_explicit(kind: str, path: str, host: Host, trusted: frozenset[int]) -> Search:
    """An `--iomp-path`/`--tcmalloc-path` library; a bad one is an error, never skipped."""
    search = find_library(kind, host, None, explicit=path, trusted=trusted)
    if search.chosen is None:
        given = search.candidates[0]
        fix = f"; Fix: {given.fix}" if given.fix else ""
        message = f"{kind} library {path} cannot be preloaded: {given.reason}{fix}"
        raise LaunchError(EXIT_USAGE, message)
    return search


def missing_message(search: Search, target: Target, consequence: str) -> str:
    """Not found: where it looked, what it refused, and the one fix that works here.

    A library refused only for who may change it is fixed by changing that (the
    first such candidate's chmod/chown), not by installing another copy.
    """
    from vllm_cpu_launch.fixes import fix_hint

    rejected = [f"{c.path or repr(c.path)} ({c.reason})" for c in search.candidates]
    tried = f"; rejected: {', '.join(rejected)}" if rejected else ""
    unsafe = next((c for c in search.candidates if c.fix), None)
    fix = (
        f"{unsafe.fix}  (then {unsafe.path} is trusted)"
        if unsafe
        else fix_hint(target, search.kind)
    )
    return (
        f"{LIBRARY_TITLES[search.kind]} not found (searched {', '.join(search.places)}"
        f"{tried}); {consequence}. Fix: {fix}"
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
    default_blocktime: str = DEFAULT_KMP_BLOCKTIME,
) -> dict[str, str]:
    """LD_PRELOAD and KMP_BLOCKTIME as they must change (only what changes)."""
    env: dict[str, str] = {}
    current = environ.get("LD_PRELOAD", "")
    if chosen:
        composed, dropped = compose_ld_preload(current, [c.path for c in chosen])
        for entry in dropped:
            warnings.append(
                f"removed {entry} from LD_PRELOAD: vLLM refuses to start with both "
                "libgomp and Intel OpenMP preloaded"
            )
        if composed != current:
            env["LD_PRELOAD"] = composed
    callers = environ.get("KMP_BLOCKTIME")
    iomp_preloaded = any(c.kind == IOMP for c in chosen)
    if kmp_blocktime is None and iomp_preloaded:
        if callers is None:
            kmp_blocktime = default_blocktime
        elif problem := blocktime_problem(callers):  # the caller's is kept, but said
            warnings.append(
                f"{problem} (yours is kept; --kmp-blocktime {default_blocktime} overrides it)"
            )
    if kmp_blocktime is not None and callers != kmp_blocktime:
        env["KMP_BLOCKTIME"] = kmp_blocktime
    return env


def without_openmp(current: str, warnings: list[str]) -> dict[str, str]:
    """LD_PRELOAD without the caller's Intel/LLVM OpenMP entries, each said ({} if none)."""
    entries = preload_entries(current)
    dropped = [e for e in entries if "libiomp" in e or "libomp" in e]
    for entry in dropped:
        warnings.append(
            f"removed {entry} from LD_PRELOAD: this plan keeps GNU libgomp (its reason "
            "says why); --iomp always keeps Intel OpenMP"
        )
    return {"LD_PRELOAD": ":".join(e for e in entries if e not in dropped)} if dropped else {}


def build_plan(
    settings: Settings,
    arguments: Sequence[str],
    speculative: SpeculativeRequest,
    target: Target,
    host: Host,
    auto_iomp: bool,
    *,
    one_worker: bool,
    planner: str = "launcher",
    model: str | None = None,
    supply_metadata: bool = False,
) -> Plan:
    """Decide what to preload and which variables to set for `target arguments...`.

    `auto_iomp` is what `--iomp auto` means here: SD requested (vLLM) or always (exec).
    `one_worker`: one worker on one node (where the benchmark map's rules may apply).
    `model`: the model served (default: the one `arguments` name), a tune's scope.
    `planner` ("launcher" or "plugin") is what PLANNED_VARIABLE says where the plan keeps
    libgomp for SD or refuses Intel OpenMP (the one choice LD_PRELOAD does not show).
    `supply_metadata`: the launcher execs this vLLM, so it gives a vllm-cpu install the
    `vllm` metadata it lacks (metadata.py), with or without SD.
    """
    warnings: list[str] = []
    notes: list[str] = []
    missing: list[str] = []
    searches: list[Search] = []
    warnings += settings.deprecated
    if speculative.note:
        warnings.append(speculative.note)
    if target.prefix:
        notes.append(f"vLLM's environment: {target.prefix} ({target.evidence})")
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
    # A drafter's method was measured unbound only with tcmalloc: whether one is found
    # decides its rule (evidence.map_choice), so it is looked for first.
    tcmalloc_search: Search | None = None
    drafter = speculative.requested and speculative.method in DRAFTER_METHODS
    if drafter and settings.tcmalloc != "never":
        tcmalloc_search = explicit.get(TCMALLOC) or find_library(
            TCMALLOC, host, target, trusted=trusted
        )
    measured = (
        map_host(
            host.environ,
            host.cpus,
            release.release,
            one_worker,
            speculative.method,
            speculative.tokens,
            settings.kmp_blocktime,
            tcmalloc_search is not None and tcmalloc_search.chosen is not None,
        )
        if speculative.requested
        else None
    )
    choice = map_choice(measured) if measured else None
    if choice and not choice.iomp and mode == "auto":
        reasons.append(choice.reason)
        wants_iomp = False
    if wants_iomp and host.machine not in IOMP_MACHINES:
        message = f"not preloading Intel OpenMP: this host is {host.machine}, not x86-64"
        (warnings if mode == "always" else notes).append(message)
        wants_iomp = False
    iomp: Candidate | None = None
    if wants_iomp:
        search = explicit.get(IOMP) or find_library(IOMP, host, target, trusted=trusted)
        searches.append(search)
        iomp = search.chosen
        if iomp is None:
            missing.append(IOMP)
            consequence = (
                "speculative decoding on CPU runs about 2x slower with GNU libgomp"
                if speculative.requested
                else "the program will use GNU libgomp"
            )
            warnings.append(missing_message(search, target, consequence))
    elif mode == "auto" and not auto_iomp:
        notes.append("no speculative decoding requested: Intel OpenMP not needed")

    # How the map measured Intel OpenMP fastest here goes with it, whoever chose it.
    map_iomp = choice if choice and choice.iomp and iomp is not None else None
    wants_tcmalloc = settings.tcmalloc == "always" or (
        settings.tcmalloc == "auto" and iomp is not None and (not map_iomp or map_iomp.tcmalloc)
    )
    if map_iomp and not map_iomp.tcmalloc and settings.tcmalloc == "auto":
        notes.append("tcmalloc not preloaded: the map measured this libiomp5 setting without it")
    tcmalloc: Candidate | None = None
    if wants_tcmalloc:
        search = (
            tcmalloc_search
            or explicit.get(TCMALLOC)
            or find_library(TCMALLOC, host, target, trusted=trusted)
        )
        searches.append(search)
        tcmalloc = search.chosen
        if tcmalloc is None and settings.tcmalloc == "always":
            missing.append(TCMALLOC)
            warnings.append(missing_message(search, target, "vLLM will use glibc's malloc"))
        elif tcmalloc is None:
            needed = map_iomp and map_iomp.tcmalloc  # rule 4 of the methods map needs one
            why_install = "the map's fastest setting here needs it" if needed else "optional"
            notes.append(f"tcmalloc not found; {why_install} (install libtcmalloc-minimal4)")

    for candidate in (c for search in searches for c in search.candidates):
        if candidate.origin == "ld-preload" and candidate.verdict == "rejected":
            warnings.append(
                f"your LD_PRELOAD entry {candidate.path} stays as you set it, but it is no "
                f"usable {candidate.kind} library: {candidate.reason}"
            )
    chosen = [c for c in (tcmalloc, iomp) if c is not None]
    default_blocktime = (map_iomp and map_iomp.blocktime) or DEFAULT_KMP_BLOCKTIME
    kmp_blocktime = settings.kmp_blocktime
    if map_iomp and map_iomp.replaces_callers:
        warnings.append(map_iomp.replaces_callers)
        kmp_blocktime = map_iomp.blocktime
    env = environment_changes(host.environ, chosen, kmp_blocktime, warnings, default_blocktime)
    if map_iomp:
        reasons.append(map_iomp.reason)
        if map_iomp.nobind:
            env[BIND_VARIABLE] = "nobind"
    # libgomp kept although SD is requested or Intel OpenMP refused: that choice does not
    # show in LD_PRELOAD, so it is marked for vLLM's plugin (docs/design.md, "The plugin").
    keeps_gomp = iomp is None and (speculative.requested or mode == "never")
    if keeps_gomp and host.environ.get(PLANNED_VARIABLE) != planner:
        env[PLANNED_VARIABLE] = planner
    if keeps_gomp and IOMP not in missing and host.machine in IOMP_MACHINES:
        # Kept on purpose (the settings, a tune, the map, the release): an Intel or LLVM
        # OpenMP of the caller's would make it a configuration nobody chose.
        env.update(without_openmp(host.environ.get("LD_PRELOAD", ""), warnings))
    alias = supplied_metadata(target, host, trusted, warnings) if supply_metadata else None
    if alias:
        env[PYTHONPATH] = pythonpath_with(alias, host.environ)
    relied = [LD_PRELOAD, BLOCKTIME_VARIABLE] if chosen else []
    if measured:  # the map's rule read these
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


def plan_as_json(plan: Plan) -> dict[str, Any]:
    """The plan in the JSON form of docs/design.md (`--dry-run --json`, `env --format json`)."""
    return {
        "command": list(plan.command),
        "speculative": {
            "requested": plan.speculative.requested,
            "source": plan.speculative.source,
        },
        "reason": plan.reason,
        "preload": [
            {"kind": p.kind, "path": p.path, "flavor": p.flavor, "origin": p.origin}
            for p in plan.preload
        ],
        "env": dict(plan.env),
        "relies_on": dict(plan.relies_on),
        "warnings": list(plan.warnings),
        "candidates": [
            {"kind": c.kind, "path": c.path, "verdict": c.verdict, "reason": c.reason}
            for c in plan.candidates
        ],
    }


def summary_line(plan: Plan, unchanged: str | None = None) -> str:
    """The one INFO line: what is preloaded, what is set, and why (the plan's own mark,
    PLANNED_VARIABLE, is bookkeeping: --dry-run shows it). `unchanged`: what to say
    when nothing else changes (default: starting the command unchanged)."""
    parts = [f"preloading {p.path} ({p.flavor or p.kind}, from {p.origin})" for p in plan.preload]
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


def render_text(plan: Plan) -> str:
    """The plan for a person (`--dry-run`)."""
    import shlex

    speculative = described_request(plan.speculative.requested, plan.speculative.source)
    lines = [
        f"command:     {shlex.join(plan.command)}",
        f"speculative: {speculative}",
        f"reason:      {plan.reason}",
    ]
    for index, p in enumerate(plan.preload):
        label = "preload:" if index == 0 else ""
        flavor = f"{p.flavor}, " if p.flavor else ""  # an iomp always has one (libraries.py)
        lines.append(f"{label:<12} {p.kind} {p.path} ({flavor}{p.origin})")
    if not plan.preload:
        lines.append("preload:     nothing")
    for index, (name, value) in enumerate(plan.env):
        label = "env:" if index == 0 else ""
        lines.append(f"{label:<12} {name}={shlex.quote(value)}")
    if not plan.env:
        lines.append("env:         unchanged")
    if plan.metadata:
        lines.append(f"metadata:    {metadata_words(plan.metadata)}")
    for index, (name, value) in enumerate(plan.relies_on):
        label = "relies on:" if index == 0 else ""
        lines.append(f"{label:<12} {name}={shlex.quote(value)} (yours, kept)")
    lines += [f"warning:     {w}" for w in plan.warnings]
    lines += [f"note:        {n}" for n in plan.notes]
    for c in plan.candidates:
        lines.append(f"candidate:   {c.kind} {c.verdict:<8} {c.path or repr(c.path)}: {c.reason}")
    return "\n".join(lines)
